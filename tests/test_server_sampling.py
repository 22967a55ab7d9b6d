"""Issue 19's leftovers through the server, in process: metrics with n > 1, prompt_logprobs, vLLM's
allowed_token_ids and bad_words."""
from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
pytest.importorskip("httpx", reason="the server tests need the server/test extras (httpx)")


@pytest.fixture(scope="module")
def app_and_http(tiny_qwen3):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine
    from asyncllm.server import create_app

    engine = AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=64)
    app = create_app(engine, "tiny", api_key=None, max_tokens_limit=64)
    with TestClient(app) as http:
        yield app, http


def samples(http) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {sample.name: sample.value for family in text_string_to_metric_families(http.get("/metrics").text)
            for sample in family.samples if not sample.labels.get("le") and "finish_reason" not in sample.labels}


@pytest.mark.parametrize("n", [1, 3])
def test_metrics_count_every_sequence_of_n(app_and_http, n):
    _, http = app_and_http
    before = samples(http)
    r = http.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 5, "ignore_eos": True, "n": n,
                                           "temperature": 1.0, "seed": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 * n
    after = samples(http)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["asyncllm_generation_tokens_total"] == 5 * n  # before: only the first sequence's 5
    # one gap per token after each sequence's first: each sequence has 4 (before: the first sequence's only)
    assert delta["asyncllm_inter_token_latency_seconds_count"] == 4 * n
    assert delta["asyncllm_time_to_first_token_seconds_count"] == 1
    assert delta["asyncllm_e2e_request_latency_seconds_count"] == 1


PROMPT_IDS = [9707, 11, 1879, 0, 358, 1079, 264, 1273, 13]


def test_completions_prompt_logprobs_are_hf_log_softmax_in_vllms_shape(app_and_http, tiny_qwen3):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, http = app_and_http
    r = http.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 2, "n": 2,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    scored = body["prompt_logprobs"]
    assert all(choice["prompt_logprobs"] == scored for choice in body["choices"])  # vLLM's place for completions
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    with torch.inference_mode():
        expected = model(torch.tensor([PROMPT_IDS])).logits[0, :-1].float().log_softmax(-1)
    assert len(scored) == len(PROMPT_IDS) and scored[0] is None
    for position, entry in enumerate(scored[1:]):
        token_id = PROMPT_IDS[position + 1]
        top = expected[position].topk(2).indices.tolist()
        # the prompt's own token first, then the top 2 (once, if the prompt's token is one of them)
        assert list(entry) == list(dict.fromkeys(str(t) for t in [token_id, *top]))
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(expected[position, token_id].item(), abs=1e-4)
        assert own["rank"] == 1 + int((expected[position] > expected[position, token_id]).sum())
        assert own["decoded_token"] == tokenizer.decode([token_id])
        for rank, t in enumerate(top, start=1):
            assert entry[str(t)]["logprob"] == pytest.approx(expected[position, t].item(), abs=1e-4)
            assert entry[str(t)]["rank"] == rank and entry[str(t)]["decoded_token"] == tokenizer.decode([t])


def test_chat_prompt_logprobs_top_level(app_and_http):
    _, http = app_and_http
    messages = [{"role": "user", "content": "Hi"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    scored = body["prompt_logprobs"]
    assert scored[0] is None and len(scored) == body["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in scored[1:])  # 0: the prompt's own token only
    assert "prompt_logprobs" not in body["choices"][0]
    # not asked: no field
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert "prompt_logprobs" not in r.json()


@pytest.mark.parametrize("body, message", [
    ({"prompt_logprobs": 1, "stream": True}, "not available with 'stream'"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
])
def test_prompt_logprobs_refused(app_and_http, body, message):
    _, http = app_and_http
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs" and message in r.json()["error"]["message"]


def test_prompt_logprobs_zero_with_stream_is_accepted_and_not_sent(app_and_http):
    _, http = app_and_http
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 0, "stream": True})
    assert r.status_code == 200 and "data: [DONE]" in r.text and "prompt_logprobs" not in r.text


ALLOWED = [11, 12, 13]


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_allowed_token_ids_and_bad_words_are_applied_not_ignored(app_and_http, route, body):
    _, http = app_and_http
    # ignored before (unknown fields): the answer then used tokens outside the list
    r = http.post(route, json={**body, "max_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 0,
                               "allowed_token_ids": ALLOWED, "logprobs": True if "messages" in body else 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tokens = [t["token"] for t in choice["logprobs"]["content"]] if "messages" in body else choice["logprobs"]["tokens"]
    engine = app_and_http[0].state.server.engine
    assert len(tokens) == 12 and set(tokens) <= {engine.tokenizer.decode([t]) for t in ALLOWED}, tokens
    greedy = {**body, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    text = lambda r: r.json()["choices"][0]["text" if "prompt" in body else "message"]  # noqa: E731
    first = text(http.post(route, json=greedy))
    word = (first if isinstance(first, str) else first["content"]).split()[0]
    banned = text(http.post(route, json={**greedy, "bad_words": [word]}))
    assert word not in (banned if isinstance(banned, str) else banned["content"]).split()


@pytest.mark.parametrize("body, param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**12]}, "allowed_token_ids"),
    ({"allowed_token_ids": "1"}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": [1]}, "bad_words"),
])
def test_allowed_token_ids_and_bad_words_refused_name_the_field(app_and_http, body, param):
    _, http = app_and_http
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
