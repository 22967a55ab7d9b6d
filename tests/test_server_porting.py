"""What frameworks ported from vLLM send (issue 51): completions with a list of prompts (LangChain's
`OpenAI.batch`, lm-eval's batches), `echo` (with logprobs: lm-eval's loglikelihood), and the
Responses API (`/v1/responses`: the OpenAI Agents SDK and newer clients), driven by the official
openai client, in process (Starlette's TestClient as its HTTP client) and against `asyncllm serve`.
"""
from __future__ import annotations

import json

import pytest

from helpers import live_server, live_server_client

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
    for prompt in (["ok", ""], ["ok", [1, "a"]], [[1], [10 ** 9]]):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt"), r.text
        assert "prompt[1]" in r.json()["error"]["message"], r.text
    # prompts x n x max_tokens against --max-generated-tokens (65536 by default)
    r = http.post("/v1/completions", json={"prompt": ["a"] * 40, "n": 20, "max_tokens": 100})
    assert r.status_code == 400 and "40 prompts" in r.json()["error"]["message"], r.text
    wait_blocks_free(http.engine)


# ---- completions: echo ------------------------------------------------------------------------------
def test_echo_puts_the_prompt_before_each_choice_whole_and_streamed(client, tiny_qwen3):
    from transformers import AutoTokenizer
    tokens = [785, 12884, 374]
    decoded = AutoTokenizer.from_pretrained(tiny_qwen3).decode(tokens)
    for prompt, text in (("The sky is", "The sky is"), (tokens, decoded)):
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


# ---- /v1/responses -------------------------------------------------------------------------------------
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["unit"], "additionalProperties": False}}
CHOICE = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def served(tiny_qwen3, tmp_path_factory):
    """`asyncllm serve` on a loopback port, and the official client for it."""
    with live_server(tiny_qwen3, tmp_path_factory.mktemp("server"), "--served-model-name", MODEL_NAME,
                     "--max-model-len", "512", "--num-kvcache-blocks", "64", "--log-level", "warning") as server:
        yield live_server_client(server.base)


def collapsed(kinds: list[str]) -> list[str]:
    """Event types with runs of one delta type made one."""
    return [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and i and kinds[i - 1] == k)]


def test_responses_text_whole_and_streamed(served):
    ask = dict(model=MODEL_NAME, input="Say something.", instructions="Be terse.", max_output_tokens=6,
               temperature=0, extra_body={"ignore_eos": True})
    whole = served.responses.create(**ask)
    assert whole.object == "response" and whole.id.startswith("resp") and whole.model == MODEL_NAME
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"] and whole.output[0].role == "assistant"
    assert whole.output_text and whole.usage.output_tokens == 6
    assert whole.usage.total_tokens == whole.usage.input_tokens + 6
    events = list(served.responses.create(stream=True, **ask))
    kinds = [e.type for e in events]
    assert collapsed(kinds) == ["response.created", "response.in_progress", *TEXT_EVENTS, "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.usage.output_tokens == 6


def test_responses_structured_output_completes_whole_and_streamed(served):
    ask = dict(model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_text", "text": "Yes or no?"}]}],
               text={"format": {"type": "json_schema", "name": "answer", "schema": CHOICE, "strict": True}},
               max_output_tokens=40, temperature=0)
    whole = served.responses.create(**ask)
    assert whole.status == "completed" and json.loads(whole.output_text)["answer"] in ("yes", "no")
    with served.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()  # the client's own accumulation of the events
    assert collapsed(kinds) == ["response.created", "response.in_progress", *TEXT_EVENTS, "response.completed"]
    assert final.output_text == whole.output_text and final.status == "completed"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_function_call_and_its_output_back(served, tool_choice):
    ask = dict(model=MODEL_NAME, input="What is the weather in Oslo?", tools=[WEATHER], tool_choice=tool_choice,
               parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    whole = served.responses.create(**ask)
    (call,) = whole.output
    assert whole.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit") and call.call_id.startswith("call_")
    with served.responses.stream(**ask) as stream:
        kinds = collapsed([event.type for event in stream])
        final = stream.get_final_response()
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [(c.name, c.arguments) for c in final.output] == [(call.name, call.arguments)]
    # the round trip: the call and its output go back in `input`, and the model answers in text
    answer = served.responses.create(model=MODEL_NAME, tools=[WEATHER], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "clear"})}])
    assert answer.output[0].type in ("message", "function_call")
    assert answer.usage.input_tokens > whole.usage.input_tokens  # the call and its output were rendered


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": None}, "input"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
])
def test_responses_refusals_name_the_field(http, extra, param):
    r = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error


def test_responses_neutral_fields_and_logprobs(http):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 3, "store": False, "metadata": {"k": "v"},
            "user": "u", "truncation": "disabled", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    part = r.json()["output"][0]["content"][0]
    assert len(part["logprobs"]) == 3 and all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])
    wait_blocks_free(http.engine)


def test_responses_stream_that_the_engine_dies_under_ends_with_response_failed(tiny_qwen3):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine
    from asyncllm.server import create_app

    engine = AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=16)
    with TestClient(create_app(engine, MODEL_NAME)) as http:
        def failing_step():
            raise RuntimeError("injected step failure")

        engine._core.launch_step = failing_step
        with http.stream("POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 5, "stream": True}) as r:
            assert r.status_code == 200  # the status line went out before the engine failed
            lines = [line for line in r.iter_lines() if line]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert [line[7:] for line in lines if line.startswith("event: ")] == [e["type"] for e in events]
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert "injected step failure" in failed["error"]["message"]
        r = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text


def test_odd_values_inside_responses_fields_are_never_a_500(http):
    odd = [None, -1, 0, "x", "", [], [1, "a"], {}, {"a": 1}, True, [{}], [None], [{"type": 5}]]
    bodies = [{"input": [item]} for item in [
        *({"role": "user", "content": v} for v in odd), *({"type": "reasoning", "content": v} for v in odd),
        *({"type": "function_call", key: v} for key in ("call_id", "name", "arguments") for v in odd),
        *({"type": "function_call_output", "call_id": "c", "output": v} for v in odd), *({"type": v} for v in odd),
        *odd]]
    bodies += [{"input": "Hi", "tools": [tool], "tool_choice": choice}
               for tool in [*({"type": "function", "name": "f", "parameters": v} for v in odd), *odd]
               for choice in (None, "required", {"type": "function", "name": "f"}, {"type": "function"}, 5)]
    bodies += [{"input": "Hi", "text": {"format": fmt}} for fmt in [*odd, *({"type": "json_schema", "schema": v}
                                                                          for v in odd)]]
    statuses = {}
    for body in bodies:
        status = http.post("/v1/responses", json={**body, "max_output_tokens": 1}).status_code
        statuses.setdefault(status, []).append(json.dumps(body)[:80])
    assert set(statuses) <= {200, 400}, {s: v[:5] for s, v in statuses.items()}
    wait_blocks_free(http.engine)
