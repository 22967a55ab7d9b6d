"""`asyncllm serve` as a real subprocess on a loopback port, driven by the official openai client and httpx."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import time

import pytest

from helpers import free_port, live_server, live_server_client, serve_command

httpx = pytest.importorskip("httpx", reason="the server tests need the server/test extras (httpx)")
openai = pytest.importorskip("openai", reason="the server tests need the test extras (openai)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")

API_KEY = "test-key-123"
MAX_TOKENS_LIMIT = 2048
REQUEST_TIMEOUT = 600  # --request-timeout: far beyond any request here but the ones that test it
MODEL_NAME = "tiny-qwen3"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"max_tokens": 2000, "ignore_eos": True}  # ~minutes on CPU: only ever cut short
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    # no --host: the default must be loopback. The key comes from the environment.
    with live_server(tiny_qwen3, tmp_path_factory.mktemp("server"), "--served-model-name", MODEL_NAME,
                     "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--max-num-seqs", "1",
                     "--max-queued-requests", "2", "--num-kvcache-blocks", "64", "--log-level", "warning",
                     "--request-timeout", str(REQUEST_TIMEOUT),
                     env=dict(os.environ, ASYNCLLM_API_KEY=API_KEY)) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return live_server_client(server.base, 60, API_KEY)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_qwen3)


def metrics(base: str) -> dict[str, float]:
    """This model's /metrics samples, parsed by prometheus_client, as {name{labels}: value} without
    the model_name label."""
    from prometheus_client.parser import text_string_to_metric_families
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("model_name", MODEL_NAME) != MODEL_NAME:
                continue
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
            samples[key] = sample.value
    return samples


def wait_idle(base: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if m["asyncllm_kv_blocks_in_use"] == 0 and m["asyncllm_num_requests_running"] == 0 \
                and m["asyncllm_num_requests_waiting"] == 0 and m["asyncllm_num_pending_commands"] == 0:
            return m
        assert time.monotonic() < deadline, f"the engine did not go idle: {m}"
        time.sleep(0.1)


def sse_events(response) -> "iter[dict | str]":
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def next_content(events) -> str:
    for event in events:
        assert event != "[DONE]", "the stream ended early"
        if event["choices"][0]["delta"].get("content"):
            return event["choices"][0]["delta"]["content"]
    raise AssertionError("the stream ended early")


# ---- basics --------------------------------------------------------------------------------------
def test_health_models_and_loopback_default(server, client):
    r = httpx.get(server.base + "/health", timeout=10)  # no key needed for probes
    assert r.status_code == 200 and r.json() == {"status": "ready"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    # started without --host: listening on 127.0.0.1 only
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp to read the bound address from")
    port_hex = f"{server.port:04X}"
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for row in open(table).read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if local.endswith(":" + port_hex) and state == "0A":
                    listening.append(local.split(":")[0])
    assert listening == ["0100007F"], listening  # 127.0.0.1, little-endian hex


def test_chat_non_stream(client, tokenizer):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL_NAME
    assert isinstance(r.created, int)
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == len(prompt_ids) + 6


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2  # streamed, not sent in one piece
    assert "".join(c.choices[0].delta.content for c in content_chunks) == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_stream_and_non_stream(client, tokenizer):
    prompt = "The quick brown fox"
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt)) and full.usage.completion_tokens == 7
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=7, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert sum(1 for c in chunks if c.choices[0].text) >= 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    # token ids as the prompt
    ids = client.completions.create(model=MODEL_NAME, prompt=tokenizer.encode(prompt), max_tokens=7,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert ids.choices[0].text == full.choices[0].text


def test_stop_string_and_seed(client):
    prompt = "Once upon a time"
    text = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"pick a better prompt: {text!r}"
    stopped = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                        stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(stop)]
    # seed: the same seed, the same sample
    a, b = (client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0,
                                           seed=1234, extra_body={"ignore_eos": True}).choices[0].message.content
            for _ in range(2))
    assert a == b


# ---- cancellation --------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server):
    base = server.base
    before = wait_idle(base)
    body = {"model": MODEL_NAME, "messages": MESSAGES, "stream": True, **LONG}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{base}/v1/chat/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response)  # kept referenced: dropping httpx's line iterator closes the connection
            next_content(events)
            next_content(events)
            busy = metrics(base)
            assert busy["asyncllm_num_requests_running"] == 1 and busy["asyncllm_kv_blocks_in_use"] > 0
        # leaving the block closes the connection mid-stream
    after = wait_idle(base)
    assert after['asyncllm_requests_total{finish_reason="abort"}'] == \
        before['asyncllm_requests_total{finish_reason="abort"}'] + 1


def test_disconnect_while_waiting_for_non_streamed_answer(server):
    base = server.base
    before = wait_idle(base)
    body = {"model": MODEL_NAME, "prompt": "Count to a thousand:", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=2.0))
    after = wait_idle(base)
    assert after['asyncllm_requests_total{finish_reason="abort"}'] == \
        before['asyncllm_requests_total{finish_reason="abort"}'] + 1


def test_request_timeout_ends_a_long_answer_and_bounds_what_a_request_may_ask(server, client):
    wait_idle(server.base)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=5, extra_body={"timeout": REQUEST_TIMEOUT + 1})
    assert info.value.body["param"] == "timeout" and "--request-timeout" in info.value.body["message"]
    try:  # the real clock: tokens by 0.5 s end "timeout"; none (a very busy machine) is a 408
        answer = client.completions.create(model=MODEL_NAME, prompt="Count to a thousand:", max_tokens=2000,
                                           extra_body={"timeout": 0.5, "ignore_eos": True})
        assert answer.choices[0].finish_reason == "timeout" and 1 <= answer.usage.completion_tokens < 2000
    except openai.APIStatusError as e:
        assert e.status_code == 408 and e.body["code"] == "request_timeout"
    wait_idle(server.base)


def test_queue_full_gives_429(server, client):
    # the server runs one request at a time (--max-num-seqs 1) and queues at most two (--max-queued-requests 2)
    base = server.base
    wait_idle(base)
    body = {"model": MODEL_NAME, "messages": MESSAGES, "stream": True, **LONG}
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as streams:
        running = streams.enter_context(http.stream("POST", f"{base}{CHAT}", json=body, headers=AUTH))
        assert running.status_code == 200
        events = sse_events(running)
        next_content(events)
        for _ in range(2):
            queued = streams.enter_context(http.stream("POST", f"{base}{CHAT}", json=body, headers=AUTH))
            assert queued.status_code == 200
        deadline = time.monotonic() + 20
        while metrics(base)["asyncllm_num_requests_waiting"] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
        assert info.value.status_code == 429
        error = info.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "busy" in error["message"]
    m = wait_idle(base)
    assert m['asyncllm_requests_rejected_total{status="429"}'] >= 1


# ---- refusals ------------------------------------------------------------------------------------
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def with_(**changes):
    body = dict(OK_CHAT)
    for key, value in changes.items():
        if value is ...:
            body.pop(key)
        else:
            body[key] = value
    return json.dumps(body)


BAD_REQUESTS = [
    # (id, path, raw body, status, param)
    ("bad-json", CHAT, '{"messages": [', 400, None),
    ("not-an-object", CHAT, "[1, 2]", 400, None),
    ("missing-messages", CHAT, with_(messages=...), 400, "messages"),
    ("messages-not-a-list", CHAT, with_(messages="hi"), 400, "messages"),
    ("messages-empty", CHAT, with_(messages=[]), 400, "messages"),
    ("unknown-role", CHAT, with_(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
    ("function-role", CHAT, with_(messages=[{"role": "function", "content": "hi"}]), 400, "messages[0].role"),
    ("tool-calls-from-a-user", CHAT, with_(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), 400,
     "messages[0].tool_calls"),
    ("content-not-a-string", CHAT, with_(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("max-tokens-a-string", CHAT, with_(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-zero", CHAT, with_(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-over-limit", CHAT, with_(max_tokens=MAX_TOKENS_LIMIT + 1), 400, "max_tokens"),
    ("max-completion-tokens-over-limit", CHAT, with_(max_completion_tokens=10 ** 6), 400, "max_completion_tokens"),
    ("temperature-negative", CHAT, with_(temperature=-1), 400, "temperature"),
    ("temperature-a-string", CHAT, with_(temperature="hot"), 400, "temperature"),
    ("top-p-zero", CHAT, with_(top_p=0), 400, "top_p"),
    ("top-k-zero", CHAT, with_(top_k=0), 400, "top_k"),
    ("stop-a-number", CHAT, with_(stop=5), 400, "stop"),
    ("seed-out-of-range", CHAT, with_(seed=2 ** 64), 400, "seed"),  # would kill the engine thread
    ("seed-a-float", CHAT, with_(seed=1.5), 400, "seed"),
    ("stream-not-a-bool", CHAT, with_(stream="yes"), 400, "stream"),
    ("n-0", CHAT, with_(n=0), 400, "n"),
    ("logprobs-a-number", CHAT, with_(logprobs=3), 400, "logprobs"),
    ("top-logprobs-without-logprobs", CHAT, with_(top_logprobs=2), 400, "top_logprobs"),
    ("top-logprobs-21", CHAT, with_(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("logit-bias-key", CHAT, with_(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit-bias-out-of-vocab", CHAT, with_(logit_bias={"999999999": 1}), 400, "logit_bias"),
    ("min-tokens-negative", CHAT, with_(min_tokens=-1), 400, "min_tokens"),
    ("tools-without-a-name", CHAT, with_(tools=[{"type": "function", "function": {}}]), 400, "tools[0]"),
    ("response-format-unknown", CHAT, with_(response_format={"type": "xml"}), 400, "response_format.type"),
    ("guided-regex-invalid", CHAT, with_(guided_regex="(("), 400, "guided_regex"),
    ("tools-with-n-2", CHAT, with_(tools=[{"type": "function", "function": {"name": "f"}}], n=2), 400, "n"),
    ("presence-penalty", CHAT, with_(presence_penalty=2.5), 400, "presence_penalty"),
    ("completions-logprobs-21", COMPLETIONS, json.dumps({"prompt": "a", "logprobs": 21}), 400, "logprobs"),
    ("wrong-model", CHAT, with_(model="gpt-4o"), 404, "model"),
    # a lone surrogate (valid JSON, not UTF-8) quoted in the error message
    ("model-lone-surrogate", CHAT, with_(model="\ud800"), 404, "model"),
    ("max-tokens-invalid-beside-max-completion-tokens", CHAT, with_(max_tokens="x", max_completion_tokens=2), 400,
     "max_tokens"),
    # copying it (the request's snapshot) would exhaust the stack
    ("guided-json-nested-600-deep", CHAT, with_(guided_json=functools.reduce(lambda inner, _: {"not": inner}, range(600),
                                                                             {})), 400, "guided_json"),
    ("stream-options-continuous-not-a-bool", CHAT, with_(stream=True, stream_options={"include_usage": True,
                                                                                      "continuous_usage_stats": 1}),
     400, "stream_options.continuous_usage_stats"),
    ("body-too-large", CHAT, with_(messages=[{"role": "user", "content": "x" * (1 << 20)}]), 413, None),
    ("prompt-missing", COMPLETIONS, json.dumps({"model": MODEL_NAME}), 400, "prompt"),
    ("prompt-empty", COMPLETIONS, json.dumps({"prompt": ""}), 400, "prompt"),
    ("prompt-batch-with-an-empty-prompt", COMPLETIONS, json.dumps({"prompt": ["a", ""]}), 400, "prompt"),
    ("prompt-token-out-of-vocab", COMPLETIONS, json.dumps({"prompt": [10 ** 9]}), 400, "prompt"),
    ("echo-not-a-boolean", COMPLETIONS, json.dumps({"prompt": "a", "echo": "yes"}), 400, "echo"),
    ("best-of", COMPLETIONS, json.dumps({"prompt": "a", "best_of": 3}), 400, "best_of"),
]


@pytest.mark.parametrize("path, body, status, param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    r = httpx.post(server.base + path, content=body.encode(), timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, n=1, logprobs=False,
                                       presence_penalty=0, frequency_penalty=0, user="u1")
    assert r.choices[0].finish_reason in ("length", "stop") and r.choices[0].logprobs is None


# ---- n, logprobs, penalties, logit_bias ----------------------------------------------------------
def test_chat_n_and_logprobs(server, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2, logprobs=True,
                                       top_logprobs=3, presence_penalty=0.5, frequency_penalty=0.5, seed=1,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.1, "min_tokens": 2})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    for choice in r.choices:
        assert choice.finish_reason == "length" and len(choice.logprobs.content) == 5
        for entry in choice.logprobs.content:
            assert isinstance(entry.token, str) and entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    # streamed: the chunks of both choices, each with its index and its tokens' logprobs
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=2,
                                                 logprobs=True, top_logprobs=1, stream=True,
                                                 extra_body={"ignore_eos": True}))
    tokens, finishes = {0: 0, 1: 0}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens[choice.index] += len(choice.logprobs.content)
                assert all(len(e.top_logprobs) == 1 for e in choice.logprobs.content)
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert tokens == {0: 4, 1: 4} and finishes == {0: "length", 1: "length"}
    wait_idle(server.base)


def test_completions_logprobs_and_logit_bias(server, client, tokenizer):
    forced = tokenizer.encode(" cat", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, logprobs=2, temperature=1.0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text == " cat" * 4
    lp = choice.logprobs
    assert lp.tokens == [" cat"] * 4 and len(lp.token_logprobs) == 4 and lp.text_offset == [0, 4, 8, 12]
    assert all(isinstance(top, dict) and " cat" in top and len(top) <= 3 for top in lp.top_logprobs)
    # streamed, text_offset counts on across chunks
    offsets = []
    for chunk in client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, logprobs=0,
                                           logit_bias={str(forced): 100}, stream=True,
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            offsets += chunk.choices[0].logprobs.text_offset
    assert offsets == [0, 4, 8]
    wait_idle(server.base)


def test_repetition_penalty_in_the_extra_body_changes_greedy_output(client):
    def text(**extra) -> str:
        r = client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})
        return r.choices[0].text
    assert text(repetition_penalty=0.3) != text()


def test_api_key_required(server):
    base = server.base
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(base + CHAT, json=OK_CHAT, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(base + "/v1/models", headers=headers, timeout=30).status_code == 401
    bad_client = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()


def test_metrics(server, client):
    client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    text = httpx.get(server.base + "/metrics", timeout=10).text
    assert "# TYPE asyncllm_time_to_first_token_seconds histogram" in text
    m = metrics(server.base)
    for name in ('asyncllm_time_to_first_token_seconds_bucket{le="0.005"}',
                 'asyncllm_inter_token_latency_seconds_bucket{le="+Inf"}', "asyncllm_num_requests_waiting",
                 "asyncllm_num_requests_running", "asyncllm_kv_blocks_in_use", "asyncllm_prefix_cache_hit_rate",
                 'asyncllm_requests_total{finish_reason="length"}', 'asyncllm_requests_total{finish_reason="abort"}'):
        assert name in m, name
    assert m["asyncllm_time_to_first_token_seconds_count"] >= 1
    assert m['asyncllm_time_to_first_token_seconds_bucket{le="+Inf"}'] == m["asyncllm_time_to_first_token_seconds_count"]
    assert m["asyncllm_inter_token_latency_seconds_count"] >= 3
    assert m['asyncllm_requests_total{finish_reason="length"}'] >= 1
    assert 0 <= m["asyncllm_prefix_cache_hit_rate"] <= 1


# ---- in-process --------------------------------------------------------------------------------
def test_create_app_in_process(tiny_qwen3):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine, EngineDeadError
    from asyncllm.server import create_app

    engine = AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=2, kvcache_block_size=16, max_model_len=64)
    app = create_app(engine, "tiny", api_key=None, max_tokens_limit=16)
    with TestClient(app) as http:  # the lifespan starts the engine and stops it
        assert http.get("/health").json() == {"status": "ready"}
        # the context a request can have: the KV cache's 32 tokens, not max_model_len's 64
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == engine.max_seq_len == 32
        assert http.get("/v1/models/tiny").json()["max_model_len"] == 32
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 17}).status_code == 400
    with pytest.raises(EngineDeadError):
        engine.stream("Hi")  # shut down with the app


@pytest.mark.parametrize("option, value", [("--port", "70000"), ("--port", "-1"), ("--graceful-shutdown-timeout", "nan"),
                                           ("--graceful-shutdown-timeout", "inf"), ("--body-timeout", "inf"),
                                           ("--request-timeout", "0"), ("--request-timeout", "nan")])
def test_cli_refuses_out_of_range_numbers_before_loading(option, value, capsys):
    # they passed the parser and failed after the model had loaded (round(nan), uvicorn's port)
    from asyncllm.cli import build_parser
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "m", option, value])
    assert info.value.code == 2 and option in capsys.readouterr().err


def test_serve_refuses_a_broken_checkpoint_in_one_line(tiny_qwen3, tmp_path):
    # the model loads before the HTTP server: it was uvicorn's "Application startup failed" traceback
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(tiny_qwen3):
        if not name.endswith(".safetensors"):
            os.link(os.path.join(tiny_qwen3, name), broken / name)
    with open(os.path.join(tiny_qwen3, "model.safetensors"), "rb") as f:
        (broken / "model.safetensors").write_bytes(f.read(100_000))
    run = subprocess.run(serve_command() + ["serve", str(broken), "--port", str(free_port())], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "not a readable safetensors file" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_cli_defaults_to_loopback_and_no_key(monkeypatch):
    from asyncllm.cli import build_parser
    args = build_parser().parse_args(["serve", "some/model"])
    assert (args.host, args.port, args.api_key, args.max_body_bytes) == ("127.0.0.1", 8000, None, 1 << 20)
    args = build_parser().parse_args(["serve", "--api-key", "k", "--max-tokens-limit", "9", "--max-queued-requests", "3"])
    assert (args.model, args.api_key, args.max_tokens_limit, args.max_queued_requests) == (None, "k", 9, 3)


def test_every_config_field_is_a_cli_option():
    import dataclasses

    from asyncllm.cli import build_parser
    from asyncllm.config import Config
    fields = {f.name for f in dataclasses.fields(Config) if f.init} - {"model"}
    serve = build_parser().parse_args(["serve", "some/model"])
    assert fields <= set(vars(serve)) and set(serve.config_fields) == fields
    worker = build_parser().parse_args(["tp-worker", "--model", "m"])
    assert set(worker.config_fields) == fields - {"tensor_parallel_size", "max_queued_requests"}
    args = build_parser().parse_args(["serve", "m", "--cuda-graph-max-tokens", "64", "--no-prefix-caching",
                                      "--no-overlap-scheduling", "--enforce-eager", "--dtype", "float16"])
    assert (args.cuda_graph_max_tokens, args.enable_prefix_caching, args.overlap_scheduling, args.enforce_eager,
            args.dtype, args.max_num_seqs) == (64, False, False, True, "float16", None)
