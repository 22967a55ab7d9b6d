"""What OpenAI clients and frameworks expect of the server (issue 20, sections 3-4): unknown fields
ignored with a warning, max_tokens against the context, Retry-After, SSE keep-alive, /tokenize and
/detokenize, OpenAI error bodies everywhere, and prometheus_client metrics.

In-process tests drive the app through Starlette's TestClient; keep-alive while queued, uvicorn's own
503 and the server log need a real `asyncllm serve` subprocess on a loopback port.
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
import uuid

import pytest

from helpers import anyio_asyncio_and_trio, live_server  # noqa: F401

httpx = pytest.importorskip("httpx", reason="the server tests need the test extras (httpx)")
openai = pytest.importorskip("openai", reason="the server tests need the test extras (openai)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")
prometheus_parser = pytest.importorskip("prometheus_client.parser", reason="the server needs prometheus_client")

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
MODEL_NAME = "tiny"
SMALL_CONTEXT = 32  # max_model_len of the in-process engine: requests that fill it are quick


def assert_openai_error(response, status: int, param: str | None = ..., code: str | None = ...) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


def parse_metrics(text: str, model_name: str) -> dict[str, float]:
    """Samples parsed by prometheus_client's own parser, as {name{labels}: value}, model_name's only
    (and without that label); process and other unlabelled samples as they are."""
    samples = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if sample.name.startswith("asyncllm_") and labels.pop("model_name", None) != model_name:
                raise AssertionError(f"{sample.name} has no model_name={model_name!r} label: {sample.labels}")
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
            samples[key] = sample.value
    return samples


@contextlib.contextmanager
def in_process(model: str, engine_options: dict | None = None, **options):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine
    from asyncllm.server import create_app

    engine = AsyncLLMEngine(model, **{"num_kvcache_blocks": 16, **(engine_options or {})})
    app = create_app(engine, MODEL_NAME, **options)
    with TestClient(app) as client:  # the lifespan starts the engine and stops it
        client.engine = engine
        yield client


@pytest.fixture(scope="module")
def http(tiny_qwen3):
    with in_process(tiny_qwen3, {"max_model_len": SMALL_CONTEXT, "kvcache_block_size": 16}) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_qwen3)


# ---- unknown fields --------------------------------------------------------------------------------
def test_unknown_fields_pass_with_one_warning_per_name(http, caplog):
    names = [f"x_new_field_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="asyncllm.server"):
        for path, body in ((CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "Hi"}), (CHAT, {"messages": MESSAGES})):
            r = http.post(path, json={**body, "max_tokens": 2, names[0]: {"any": "thing"}, names[1]: 1})
            assert r.status_code == 200, r.text
    for name in names:
        warnings = [rec for rec in caplog.records if name in rec.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, caplog.text
    r = http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2, "stream": True,
                              "stream_options": {"include_usage": True, names[0]: True}})
    assert r.status_code == 200 and '"usage": {"prompt_tokens"' in r.text, r.text
    # a known field the server does not implement is still refused, naming it
    assert_openai_error(http.post(CHAT, json={"messages": MESSAGES, "echo_twice": 1, "store": True}), 400, "store")


def test_unknown_fields_of_messages_pass_with_one_warning_per_name(http, caplog):
    name = f"x_vendor_{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                 name: 1},
                {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Hi"}], name: {"a": 1}},
                {"role": "assistant", "content": None, "refusal": "no", "audio": None},
                {"role": "user", "content": "Hi again", name: None}]
    with caplog.at_level(logging.WARNING, logger="asyncllm.server"):
        for _ in range(2):
            r = http.post(CHAT, json={"messages": messages, "max_tokens": 1})
            assert r.status_code == 200, r.text
    for field in (name, "refusal", "audio"):
        warnings = [rec for rec in caplog.records if f"messages[].{field}" in rec.getMessage()]
        assert len(warnings) <= 1 and (field != name or len(warnings) == 1), caplog.text
    # the same prompt as the messages with the unknown fields left out and the parts joined
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": ""}, {"role": "user", "content": "Hi again"}]
    counts = [http.post("/tokenize", json={"model": MODEL_NAME, "messages": m}).json()["tokens"]
              for m in (messages, plain)]
    assert counts[0] == counts[1]
    # known fields of the wrong type are still refused, naming them
    for bad, param in (({"role": "user", "content": "Hi", "name": 5}, "messages[0].name"),
                       ({"role": "tool", "content": "1", "tool_call_id": ["x"]}, "messages[0].tool_call_id"),
                       ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "messages[0].content[0]"),
                       ({"role": "user", "content": {"text": "Hi"}}, "messages[0].content")):
        assert_openai_error(http.post(CHAT, json={"messages": [bad], "max_tokens": 1}), 400, param)


# ---- max_tokens against the context ----------------------------------------------------------------
@pytest.mark.parametrize("path, field", [(CHAT, "max_tokens"), (CHAT, "max_completion_tokens"),
                                         (COMPLETIONS, "max_tokens")])
def test_max_tokens_past_the_context_is_a_400(http, path, field):
    prompt = {"messages": MESSAGES} if path == CHAT else {"prompt": [5] * 10}
    room = SMALL_CONTEXT - (http.post("/tokenize", json=prompt).json()["count"] if path == CHAT else 10)
    assert 0 < room < SMALL_CONTEXT
    error = assert_openai_error(http.post(path, json={**prompt, field: room + 1, "ignore_eos": True}), 400, field,
                                "context_length_exceeded")
    assert str(room) in error["message"] and str(SMALL_CONTEXT) in error["message"], error
    r = http.post(path, json={**prompt, field: room, "ignore_eos": True})  # exactly the room: fits
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == room and r.json()["choices"][0]["finish_reason"] == "length"


def test_default_max_tokens_stays_within_the_context(http):
    # completions default to 16 tokens; a prompt that leaves 4 gets 4, not a 400
    r = http.post(COMPLETIONS, json={"prompt": [7] * (SMALL_CONTEXT - 4), "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    # a prompt that leaves no room is the engine's own error, as before
    assert_openai_error(http.post(COMPLETIONS, json={"prompt": [7] * SMALL_CONTEXT, "max_tokens": 1}), 400, "prompt",
                        "context_length_exceeded")


def test_fields_are_checked_against_the_max_tokens_sent_not_the_default():
    """min_tokens above SamplingParams' default max_tokens (64) with a max_tokens that holds it is
    valid (it was a 400 citing the default 64); one above the max_tokens sent names both figures."""
    from asyncllm.server import protocol

    params = protocol.sampling_params({"max_tokens": 200, "min_tokens": 100}, "max_tokens", 16, None, chat=False)
    assert (params.max_tokens, params.min_tokens) == (200, 100)
    with pytest.raises(protocol.APIError) as info:
        protocol.sampling_params({"max_tokens": 50, "min_tokens": 100}, "max_tokens", 16, None, chat=False)
    assert info.value.param == "min_tokens" and "50" in info.value.message and "64" not in info.value.message


# ---- /tokenize and /detokenize ---------------------------------------------------------------------
def test_tokenize_and_detokenize_match_the_tokenizer(http, tokenizer):
    text = "Hello, world! Ünïcode ✓"
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer(text)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == SMALL_CONTEXT and body["token_strs"] is None
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert plain["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])

    r = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(body["tokens"])}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_tokenize_messages_is_what_chat_completions_counts(http, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]
    tokens = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()["tokens"]
    assert tokens == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    usage = http.post(CHAT, json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(tokens)
    without = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert without == tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                                  return_dict=True)["input_ids"]
    # with tools, rendered as the chat route renders them (they were ignored: 15 tokens for chat's 149)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()["tokens"]
    assert with_tools == tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]
    assert len(with_tools) > len(tokens)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_tokenize_refusals(http, path, body, status, param):
    assert_openai_error(http.post(path, json=body), status, param)


def test_odd_values_of_tokenize_fields_are_never_a_500(http):
    odd_values = [None, -1, 0, 2 ** 64, 1e308, "", "x", [], [1, "a"], [-5], {}, {"a": 1}, True]
    statuses = {}
    for path, base, fields in (
            ("/tokenize", {"prompt": "Hi"}, ["prompt", "add_special_tokens", "return_token_strs", "model"]),
            ("/tokenize", {"messages": MESSAGES}, ["messages", "add_generation_prompt", "continue_final_message",
                                                   "chat_template_kwargs", "add_special_tokens"]),
            ("/detokenize", {"tokens": [1, 2]}, ["tokens", "model"])):
        for field in fields:
            for value in odd_values:
                status = http.post(path, json={**base, field: value}).status_code
                statuses.setdefault(status, []).append(f"{path} {field}={value!r}"[:60])
    assert set(statuses) <= {200, 400, 404}, {s: v[:5] for s, v in statuses.items()}


# ---- error bodies ----------------------------------------------------------------------------------
def test_errors_starlette_answers_itself_are_openai_shaped(http):
    assert_openai_error(http.get("/no/such/path"), 404, None, "not_found")
    r = http.get(CHAT)
    assert_openai_error(r, 405, None, "method_not_allowed")
    assert "POST" in r.headers["allow"]


def test_an_escaped_exception_is_an_openai_500(http, monkeypatch):
    server = http.app.state.server

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "generate", broken)
    error = assert_openai_error(http.post(CHAT, json={"messages": MESSAGES}), 500, None, "internal_error")
    assert error["type"] == "server_error" and "a bug" not in error["message"]  # no internals leak

    # outside any route wrapper: Starlette's own 500, through the handlers create_app installs
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from asyncllm.server.errors import exception_handlers

    async def crash(request):
        raise RuntimeError("a bug")

    with TestClient(Starlette(routes=[Route("/crash", crash)], exception_handlers=exception_handlers()),
                    raise_server_exceptions=False) as client:
        assert_openai_error(client.get("/crash"), 500, None, "internal_error")


def test_engine_death_is_openai_shaped_whole_and_streamed(tiny_qwen3):
    with in_process(tiny_qwen3) as http:
        def failing_step():
            raise RuntimeError("injected step failure")

        http.engine._core.launch_step = failing_step
        r = http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 5, "stream": True})
        assert r.status_code == 200  # the status line went out before the engine failed
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and error["type"] == "server_error", error
        assert "injected step failure" in error["message"]
        assert_openai_error(http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 5}), 503, None,
                            "engine_unavailable")
        assert_openai_error(http.get("/health"), 503, None, "engine_unavailable")
        for path, body in ((COMPLETIONS, {"prompt": [1, 2, 3]}), ("/detokenize", {"tokens": [1, 2]}),
                           ("/tokenize", {"prompt": "Hi"})):
            assert_openai_error(http.post(path, json=body), 503, None, "engine_unavailable")
        m = parse_metrics(http.get("/metrics").text, MODEL_NAME)
        assert m['asyncllm_requests_total{finish_reason="error"}'] == 1


# ---- SSE keep-alive --------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_event_stream_sends_keepalive_comments_while_the_body_waits():
    import anyio

    from asyncllm.server import EventStreamResponse

    sent: list[bytes] = []
    keepalive_seen = anyio.Event()

    async def body():
        yield "data: 1\n\n"
        await keepalive_seen.wait()  # the body waits until the response has sent a keep-alive
        yield "data: 2\n\n"

    async def send(message):
        if message["type"] == "http.response.body":
            sent.append(message["body"])
            if message["body"] == EventStreamResponse.KEEPALIVE:
                keepalive_seen.set()

    async def receive():
        await anyio.sleep_forever()  # the client never leaves

    closed = []

    async def on_close():
        closed.append(True)

    with anyio.fail_after(30):  # without keep-alives the body would wait forever
        await EventStreamResponse(body(), on_close=on_close, keepalive_interval=0.01)(
            {"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert sent[0] == b"data: 1\n\n" and sent[-2:] == [b"data: 2\n\n", b""], sent
    assert set(sent[1:-2]) == {EventStreamResponse.KEEPALIVE}, sent
    assert closed == [True]
    with pytest.raises(ValueError, match="keepalive_interval"):
        EventStreamResponse(body(), keepalive_interval=0)


@pytest.mark.anyio
async def test_event_stream_sends_no_keepalive_before_its_status_line_or_after_its_end():
    """The watcher task sends the comments beside the body: not while the status line or the end is
    in flight to a slow client (many keep-alive intervals pass in those sends)."""
    import anyio

    from asyncllm.server import EventStreamResponse

    sent: list[dict] = []

    async def body():
        yield "data: 1\n\n"
        await anyio.sleep(0.05)
        yield "data: 2\n\n"

    async def send(message):
        if message["type"] == "http.response.start" or not message.get("more_body", False):
            await anyio.sleep(0.05)  # a slow client: five intervals pass in the status line's and the end's sends
        sent.append(message)

    async def receive():
        await anyio.sleep_forever()  # the client never leaves: the response ends its watcher itself

    with anyio.fail_after(30):
        await EventStreamResponse(body(), keepalive_interval=0.01)({"type": "http"}, receive, send)
    assert sent[0]["type"] == "http.response.start", sent
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[-1] == b"" and not sent[-1]["more_body"], sent
    assert [b for b in bodies if b != EventStreamResponse.KEEPALIVE] == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert EventStreamResponse.KEEPALIVE in bodies  # sent while the body waited between its events


@pytest.mark.anyio
@pytest.mark.parametrize("error, logged", [(OSError("the client is gone"), False), (ValueError("a bug"), True)])
async def test_event_stream_with_keepalive_handles_body_errors_as_without(error, logged, caplog):
    import anyio

    from asyncllm.server import EventStreamResponse

    async def body():
        yield "data: 1\n\n"
        raise error

    async def send(message):
        pass

    async def receive():
        await anyio.sleep_forever()

    closed = []

    async def on_close():
        closed.append(True)

    with caplog.at_level(logging.ERROR, logger="asyncllm.server"), anyio.fail_after(30):
        await EventStreamResponse(body(), on_close=on_close, keepalive_interval=10)(
            {"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert closed == [True]
    assert ("error while streaming a response" in caplog.text) == logged, caplog.text
    if logged:  # the error itself, not a task group around it
        assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [ValueError], caplog.text


# ---- a real server: keep-alive while queued, Retry-After, the log, metrics, uvicorn's 503 -------------
@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with live_server(tiny_qwen3, tmp_path_factory.mktemp("conformance"), "--served-model-name", MODEL_NAME,
                     "--max-num-seqs", "1", "--max-queued-requests", "1", "--num-kvcache-blocks", "64",
                     "--sse-keepalive-interval", "0.2", "--limit-concurrency", "6",
                     "--timeout-keep-alive", "60", "--log-level", "warning") as served:
        yield served


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)
    return value


def test_official_client_with_unknown_fields_and_the_warning_logged_once(server):
    with openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        for _ in range(2):
            r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                               extra_body={"some_future_field": {"x": 1}})
            assert r.choices[0].finish_reason in ("length", "stop")
    log = wait_for(lambda: "some_future_field" in (text := open(server.log_path).read()) and text, 10, "the warning")
    assert log.count("some_future_field") == 1, log[-3000:]


def test_queued_stream_gets_keepalives_and_a_full_queue_gets_retry_after(server):
    base = server.base
    long = {"model": MODEL_NAME, "messages": MESSAGES, "stream": True, "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as streams:
        running = streams.enter_context(http.stream("POST", base + CHAT, json=long))
        lines = running.iter_lines()
        wait_for(lambda: '"content": ""' not in (line := next(lines)) and '"content"' in line, 60, "a first token")
        # one slot (--max-num-seqs 1): this one waits in the queue, sending keep-alive comments
        queued = streams.enter_context(http.stream("POST", base + COMPLETIONS, json={**long, "prompt": "Hi"}))
        assert queued.status_code == 200
        queued_lines = queued.iter_lines()
        assert next(queued_lines) == ": keep-alive"
        # the queue holds one (--max-queued-requests 1): the next gets 429 with Retry-After
        r = http.post(base + CHAT, json={**long, "stream": False, "max_tokens": 2})
        assert_openai_error(r, 429, None, "queue_full")
        assert r.headers["retry-after"] == "1"
    # the official client reads through keep-alive comments
    wait_for(lambda: parse_metrics(httpx.get(base + "/metrics").text, MODEL_NAME)["asyncllm_kv_blocks_in_use"] == 0,
             30, "the aborted streams to free their blocks")
    with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_metrics_through_prometheus_client(server):
    base = server.base
    before = parse_metrics(httpx.get(base + "/metrics").text, MODEL_NAME)
    prompt = list(range(1000, 1300))  # > one 256-token block: the second request finds it cached
    for _ in range(2):
        assert httpx.post(base + COMPLETIONS, json={"prompt": prompt, "max_tokens": 2}, timeout=60).status_code == 200
    after = parse_metrics(httpx.get(base + "/metrics").text, MODEL_NAME)
    assert after["asyncllm_prefix_cache_queries_total"] - before["asyncllm_prefix_cache_queries_total"] == 600
    assert after["asyncllm_prefix_cache_hits_total"] - before["asyncllm_prefix_cache_hits_total"] == 256
    assert after["asyncllm_request_queue_time_seconds_count"] - before["asyncllm_request_queue_time_seconds_count"] == 2
    assert after['asyncllm_request_queue_time_seconds_bucket{le="+Inf"}'] == \
        after["asyncllm_request_queue_time_seconds_count"]
    assert after["asyncllm_prompt_tokens_total"] - before["asyncllm_prompt_tokens_total"] == 600
    assert after['asyncllm_requests_total{finish_reason="length"}'] - \
        before['asyncllm_requests_total{finish_reason="length"}'] == 2
    assert after["asyncllm_kv_blocks_total"] == 64
    assert after["process_cpu_seconds_total"] > 0 and after["process_resident_memory_bytes"] > 0


def test_uvicorn_limit_concurrency_503_is_openai_shaped(server):
    # --limit-concurrency 6: five idle connections plus this request's reach it
    idle = []
    try:
        for _ in range(5):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))

        def refused():
            r = httpx.get(server.base + "/v1/models", timeout=10)
            return r if r.status_code == 503 else None

        r = wait_for(refused, 20, "uvicorn's 503")
        assert_openai_error(r, 503, None, "too_many_connections")
        assert r.headers["retry-after"] == "1"
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: httpx.get(server.base + "/health", timeout=10).status_code == 200, 20, "the server to answer")


# ---- metrics for apps that embed the engine ----------------------------------------------------------
def test_engine_collector_into_a_given_registry():
    from prometheus_client import CollectorRegistry, generate_latest

    from asyncllm.server import EngineCollector, EngineMetrics

    class FakeEngine:
        def stats(self):
            return {"num_waiting": 2, "num_running": 3, "num_free_blocks": 6, "num_total_blocks": 8, "num_inbox": 1,
                    "prefix_cache_hit_rate": 0.25, "prefix_cache_queries": 40, "prefix_cache_hits": 10,
                    "num_preemptions": 5, "grammar_compiles_queued": 4, "grammar_compiles_running": 1,
                    "grammar_compiles_detached": 2, "grammar_cache_bytes": 1000}

    registry = CollectorRegistry()
    registry.register(EngineCollector(FakeEngine(), "m"))
    m = parse_metrics(generate_latest(registry).decode(), "m")
    assert m == {"asyncllm_num_requests_waiting": 2, "asyncllm_num_pending_commands": 1,
                 "asyncllm_num_requests_running": 3, "asyncllm_kv_blocks_in_use": 2, "asyncllm_kv_blocks_total": 8,
                 "asyncllm_kv_cache_usage_ratio": 0.25, "asyncllm_prefix_cache_hit_rate": 0.25,
                 "asyncllm_num_preemptions_total": 5, "asyncllm_prefix_cache_queries_total": 40,
                 "asyncllm_prefix_cache_hits_total": 10, "asyncllm_grammar_compiles_queued": 4,
                 "asyncllm_grammar_compiles_running": 1, "asyncllm_grammar_compiles_detached": 2,
                 "asyncllm_grammar_cache_bytes": 1000}
    shared = CollectorRegistry()  # an app's registry: EngineMetrics adds no process metrics to it
    EngineMetrics(FakeEngine(), "a", registry=shared)
    assert b"process_cpu_seconds_total" not in generate_latest(shared)
    with pytest.raises(ValueError, match="Duplicated"):  # one EngineMetrics per registry
        EngineMetrics(FakeEngine(), "b", registry=shared)
    own = EngineMetrics(FakeEngine(), "c")  # its own registry, with process metrics
    text, content_type = own.render()
    assert content_type.startswith("text/plain") and b"process_cpu_seconds_total" in text
