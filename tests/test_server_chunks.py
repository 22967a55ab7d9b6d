"""The server's per-token path (issue 45): text chunks rendered from a template are the bytes that
building and JSON-encoding each chunk gave; a client that falls behind gets its pending tokens in
one event whose text, logprobs and usage are those of the whole answer; the inter-token latency
histogram fed in bulk exposes what prometheus_client's own Histogram does."""
from __future__ import annotations

import json

import anyio
import pytest

pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
prometheus_client = pytest.importorskip("prometheus_client", reason="the server needs prometheus_client")

from asyncllm.server.choices import ChoiceShaper  # noqa: E402
from asyncllm.server.metrics import ITL_BUCKETS, BulkHistogram  # noqa: E402
from asyncllm.server.sse import TEXT_SLOT, TextChunks, sse  # noqa: E402

# JSON's escapes (quote, backslash, control characters), non-ASCII, a character past the BMP, the
# line separators JavaScript once refused, and a lone surrogate (a token that splits a character)
TEXTS = ["plain", 'a "quoted" \\ back\\slash', "line\nbreak\ttab\r\x00\x1f", "héllo wörld", "😀 emoji",
         "\u2028\u2029", "\ud83d", "", " " * 3]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("usage_field", [True, False])
def test_text_chunk_events_are_the_bytes_of_the_encoded_chunk(chat, usage_field):
    shaper = ChoiceShaper(chat, wants_logprobs=False)

    def chunk(text: str, index: int) -> dict:
        base = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
                "model": "m", "choices": [shaper.chunk_choice(index, text, None)]}
        return {**base, "usage": None} if usage_field else base

    chunks = TextChunks(lambda index: chunk(TEXT_SLOT, index))
    for index in (0, 3):
        for text in TEXTS:
            event = chunks.event(index, text)
            assert event == sse(chunk(text, index))
            assert event.startswith("data: ") and event.endswith("\n\n")
            choice = json.loads(event[len("data: "):])["choices"][0]  # the stdlib decoder gets the text back
            assert choice["index"] == index and (choice["delta"]["content"] if chat else choice["text"]) == text
    assert set(chunks.templates) == {0, 3}  # one template per choice, made once


def test_a_chunk_that_holds_the_slot_other_than_once_is_refused():
    with pytest.raises(AssertionError, match="TEXT_SLOT"):
        TextChunks(lambda index: {"a": TEXT_SLOT, "b": TEXT_SLOT}).event(0, "x")
    with pytest.raises(AssertionError, match="TEXT_SLOT"):
        TextChunks(lambda index: {"a": "no slot"}).event(0, "x")


def test_bulk_histogram_exposes_what_prometheus_histogram_does():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    values = [0.0, 0.001, 0.0010001, 0.0025, 0.004, 0.03, 0.3, 1.0, 4.9, 5.0, 7.5, 100.0] + [i / 997 for i in range(300)]
    reference_registry, bulk_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("itl_seconds", "gaps", ["model_name"], registry=reference_registry,
                          buckets=ITL_BUCKETS).labels("m")
    for value in values:
        reference.observe(value)
    bulk = BulkHistogram("itl_seconds", "gaps", "m", ITL_BUCKETS, bulk_registry)
    bulk.observe_all(values[:7])
    bulk.observe_all([])
    bulk.observe_all(values[7:])

    def samples(registry) -> dict:
        text = generate_latest(registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples
                if not s.name.endswith("_created")}  # prometheus_client's creation time: not kept here
    expected, got = samples(reference_registry), samples(bulk_registry)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key  # the sum: the same values in another order


# ---- a client that falls behind ---------------------------------------------------------------------
async def post_with_a_slow_client(app, engine, path: str, body: dict) -> list:
    """POST body to the ASGI app; the client reads nothing until the engine has finished the request
    (its response start is held until the engine is idle), so every token waits in the stream's
    channel and the answer comes as one read. Returns the data of each event, in order."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80)}
    received = False
    done = anyio.Event()
    messages = []

    async def receive() -> dict:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()  # the client stays connected until the response has ended
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message
            with anyio.fail_after(120):
                await engine.wait_idle(poll_interval=0.01)  # the whole answer is in the channel, unread
        messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    with anyio.fail_after(300):
        await app(scope, receive, send)
    text = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body").decode()
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.anyio
async def test_a_client_behind_gets_its_pending_tokens_in_one_event(tiny_qwen3):
    from asyncllm import AsyncLLMEngine, SamplingParams
    from asyncllm.server import create_app

    max_tokens = 12
    async with AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=16) as engine:
        app = create_app(engine, "tiny", manage_engine=False)
        common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "seed": 3}
        # completions with logprobs: built per chunk (no template); the answer as one event
        body = {"prompt": "Once upon a time", "logprobs": 2, **common}
        streamed = await post_with_a_slow_client(app, engine, "/v1/completions", {
            **body, "stream": True, "stream_options": {"include_usage": True}})
        text_events = [e for e in streamed if e["choices"] and e["choices"][0]["text"]]
        assert len(text_events) == 1, streamed  # every token in one event
        logprobs = text_events[0]["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == max_tokens
        assert "".join(logprobs["tokens"]) == text_events[0]["choices"][0]["text"]
        assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(max_tokens)]
        finishes = [e["choices"][0]["finish_reason"] for e in streamed if e["choices"] and e["choices"][0]["finish_reason"]]
        assert finishes == ["length"]
        assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["completion_tokens"] == max_tokens
        # the engine's own whole answer to the same request: the same text and logprobs
        reference = await engine.generate("Once upon a time", SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                              ignore_eos=True, seed=3, logprobs=2))
        assert text_events[0]["choices"][0]["text"] == reference.text
        assert logprobs["tokens"] == [e.token for e in reference.logprobs]
        assert logprobs["token_logprobs"] == pytest.approx([e.logprob for e in reference.logprobs], abs=1e-5)

        # chat without logprobs: the template's path; n=2, each choice's pending text in one event
        chat = await post_with_a_slow_client(app, engine, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Say hello."}], "n": 2, "stream": True, **common})
        contents = {0: [], 1: []}
        for event in chat:
            for choice in event["choices"]:
                if choice["delta"].get("content"):
                    contents[choice["index"]].append(choice["delta"]["content"])
        assert [len(parts) for parts in contents.values()] == [1, 1], chat
        reference = await engine.generate(engine.apply_chat_template([{"role": "user", "content": "Say hello."}]),
                                          SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, seed=3))
        assert contents[0] == contents[1] == [reference.text]  # greedy: both choices alike
        await engine.wait_idle()
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]  # every block free again
