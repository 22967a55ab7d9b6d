"""What frameworks ported from vLLM send (issue 51): completions with a list of prompts (LangChain's
`OpenAI.batch`, lm-eval's batches), `echo` (with logprobs: lm-eval's loglikelihood), and the
Responses API (`/v1/responses`: the OpenAI Agents SDK and newer clients), driven by the official
openai client, in process (Starlette's TestClient as its HTTP client) and against `asyncllm serve`.
"""
from __future__ import annotations

import json

import pytest

from helpers import free_port, serve_command, stop_process, wait_healthy

openai = pytest.importorskip("openai", reason="the server tests need the test extras (openai)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")

MODEL_NAME = "tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(tiny_qwen3):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine
    from asyncllm.server import create_app

    engine = AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=64, max_model_len=256)
    with TestClient(create_app(engine, MODEL_NAME)) as client:
        client.engine = engine
        yield client


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="none", http_client=http, max_retries=0)


def sse_data(response) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in response.iter_lines() if line.startswith("data: ")]


def wait_blocks_free(engine) -> None:
    import time
    deadline = time.monotonic() + 30
    while engine.stats()["num_free_blocks"] != engine.stats()["num_total_blocks"]:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.05)


# ---- completions: a list of prompts ----------------------------------------------------------------
def test_a_batch_of_prompts_is_n_choices_per_prompt_in_prompt_order(client):
    """What LangChain's OpenAI.batch sends: prompt p's n choices are p * n .. p * n + n - 1, each what
    the prompt alone gets (greedy), and the usage counts every prompt and choice."""
    prompts = ["The sky is", "Numbers: 1 2 3", "Hello"]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=5, extra_body=GREEDY)
    assert [c.index for c in batch.choices] == list(range(6))
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, extra_body=GREEDY) for p in prompts]
    for p, answer in enumerate(alone):
        for i in range(2):
            assert batch.choices[p * 2 + i].text == answer.choices[0].text
            assert batch.choices[p * 2 + i].finish_reason == "length"
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * 5


def test_a_batch_streams_every_choice(client, http):
    prompts = [[5, 6, 7], [8, 9], [10]]  # token-id prompts
    whole = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, extra_body=GREEDY)
    texts, finishes = {}, {}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}, extra_body=GREEDY):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        if chunk.usage:
            usage = chunk.usage
    assert texts == {c.index: c.text for c in whole.choices} and finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 12 and usage.prompt_tokens == 6
    wait_blocks_free(http.engine)


def test_a_batch_is_refused_whole_naming_the_prompt(http):
    for prompt, message in ((["ok", ""], "prompt[1]"), (["ok", [1, "a"]], "prompt[1]"), ([[1], [10 ** 9]], "prompt[1]")):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt"), r.text
        assert message in r.json()["error"]["message"], r.text
    # prompts x n x max_tokens against --max-generated-tokens (65536 by default)
    r = http.post("/v1/completions", json={"prompt": ["a"] * 40, "n": 20, "max_tokens": 100})
    assert r.status_code == 400 and "40 prompts" in r.json()["error"]["message"], r.text
    wait_blocks_free(http.engine)


# ---- completions: echo ------------------------------------------------------------------------------
def test_echo_puts_the_prompt_before_each_choice_whole_and_streamed(client, tiny_qwen3):
    from transformers import AutoTokenizer
    tokens = [785, 12884, 374]
    for prompt, text in (("The sky is", "The sky is"), (tokens, AutoTokenizer.from_pretrained(tiny_qwen3).decode(tokens))):
        plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, n=2, extra_body=GREEDY)
        echoed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, n=2, echo=True,
                                           extra_body=GREEDY)
        assert [c.text for c in echoed.choices] == [text + c.text for c in plain.choices]
        streamed = {}
        for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, n=2, echo=True,
                                               stream=True, extra_body=GREEDY):
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        assert streamed == {c.index: c.text for c in echoed.choices}


def test_echo_with_logprobs_scores_the_prompt_tokens(client, http):
    """lm-eval's loglikelihood request: echo, logprobs=1, a batch of prompts. Each choice's logprobs
    cover the prompt's tokens (the first without a logprob) and then the output's."""
    prompts = ["The capital of France is", "2 + 2 ="]
    answer = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=1, logprobs=1, echo=True,
                                       extra_body=GREEDY)
    for p, choice in enumerate(answer.choices):
        ids = http.post("/tokenize", json={"prompt": prompts[p]}).json()["tokens"]
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
        assert "".join(lp.tokens) == choice.text and choice.text.startswith(prompts[p])
        # the prompt tokens' logprobs are the model's: what prompt_logprobs reports for them
        scored = http.post("/v1/completions", json={"prompt": prompts[p], "max_tokens": 1, "prompt_logprobs": 1,
                                                    **GREEDY}).json()["prompt_logprobs"]
        assert [round(x, 4) for x in lp.token_logprobs[1:len(ids)]] == \
            [round(entry[str(ids[k])]["logprob"], 4) for k, entry in enumerate(scored) if k > 0]
    assert "prompt_logprobs" not in answer.model_extra  # not asked for


def test_echo_refusals(http):
    r = http.post("/v1/completions", json={"prompt": "a", "echo": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    r = http.post("/v1/completions", json={"prompt": "a", "echo": True, "logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text

