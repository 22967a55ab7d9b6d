"""Issue 19's leftovers through the server, in process: metrics with n > 1, prompt_logprobs."""
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
