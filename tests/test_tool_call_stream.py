"""Streamed tool calls as OpenAI streams them (name first, then the arguments in pieces), checked
with the official openai client's own stream accumulation against the whole answer's calls."""
from __future__ import annotations

import asyncio
import json

import pytest

from asyncllm.server import tool_calls
from asyncllm.server.answers import tool_call_delta
from asyncllm.server.json_scan import OpenContainer, scan_object, value_end
from asyncllm.server.tool_call_stream import ToolCallStream

openai_chat = pytest.importorskip("openai.lib.streaming.chat", reason="needs the test extras (openai)")
from openai.types.chat import ChatCompletionChunk  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
AUTO = tool_calls.ToolRequest([WEATHER, TIME], "auto")
HERMES, LLAMA = tool_calls.FORMATS["hermes"], tool_calls.FORMATS["llama3_json"]

CASES = [  # (request, format, the model's output)
    (AUTO, HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\" {x}", '
                   '"unit": "celsius"}}\n</tool_call>'),
    (AUTO, HERMES, '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>\n<tool_call>'
                   '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}'),  # the last unclosed
    (AUTO, HERMES, '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_time"}</tool_call>'),  # name last
    (AUTO, HERMES, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    (AUTO, HERMES, "No tools needed: 2 < 3."),
    (AUTO, HERMES, '<tool_call>{"name": "unknown", "arguments": {"a": 1}}</tool_call>'),
    (AUTO, LLAMA, '{"name": "get_time", "parameters": {"city": "Lima"}}'),
    (tool_calls.ToolRequest([WEATHER, TIME], "named", "get_weather"), HERMES,
     '{"city": "Berlin", "unit": "fahrenheit"}'),
    (tool_calls.ToolRequest([WEATHER, TIME], "required"), HERMES,
     '[{"name": "get_time", "parameters": {"city": "Oslo"}}, {"name": "get_weather", "parameters": '
     '{"city": "Rome", "unit": "celsius"}}]'),
]


def stream_chunks(tools, fmt, text: str, piece: int, finish_reason: str = "stop") -> list[dict]:
    """The chat chunks the server sends for `text` arriving `piece` characters at a time."""
    calls_stream = ToolCallStream(tools, fmt)
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    pieces = [(text[i:i + piece], None) for i in range(0, len(text), piece)] + [(None, finish_reason)]
    for text_piece, finish in pieces:
        _, delta, reason = tool_call_delta(calls_stream, text_piece, finish)
        if delta is not None:
            chunks.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]})
    return chunks


def accumulate(chunks: list[dict], tools, final: bool = True):
    """The answer as the openai client's ChatCompletionStreamState accumulates it (final: its
    parsed completion, which refuses finish_reason "length"; else its snapshot)."""
    state = openai_chat.ChatCompletionStreamState(input_tools=tools.tools)
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return (state.get_final_completion() if final else state.current_completion_snapshot).choices[0]


@pytest.mark.parametrize("piece", [1, 4, 1000])
@pytest.mark.parametrize("tools, fmt, text", CASES)
def test_streamed_calls_accumulate_to_the_whole_answers_calls(tools, fmt, text, piece):
    content, calls = tool_calls.parse_output(text, tools, fmt)
    chunks = stream_chunks(tools, fmt, text, piece)
    choice = accumulate(chunks, tools)
    streamed = choice.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert all(c.id.startswith("call_") and c.type == "function" for c in streamed)
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    if calls:
        for call in calls:  # arguments are the model's raw JSON, valid
            json.loads(call["function"]["arguments"])
        if content is not None:  # the content before the first call streams as content
            assert (choice.message.content or "").strip() == content
    else:
        assert choice.message.content == text
    deltas = [d for chunk in chunks for d in chunk["choices"][0]["delta"].get("tool_calls", [])]
    for index in range(len(calls)):  # per call: the header first, with "" arguments
        own = [d for d in deltas if d["index"] == index]
        assert own[0]["function"]["name"] == calls[index]["function"]["name"]
        assert own[0]["function"]["arguments"] == "" and "id" in own[0]
        assert all("id" not in d and "name" not in d["function"] for d in own[1:])


@pytest.mark.parametrize("tools, fmt, text", [case for case in CASES if case[1] is HERMES and "get_" in case[2]
                                                     and '{"arguments"' not in case[2]])
def test_arguments_stream_while_the_model_writes_them(tools, fmt, text):
    """Not one delta at the end: the first call's name and part of its arguments are out before
    the output is complete (a call whose name comes after its arguments waits for the name)."""
    calls_stream = ToolCallStream(tools, fmt)
    _, calls = tool_calls.parse_output(text, tools, fmt)
    arguments = calls[0]["function"]["arguments"]
    cut = text.index(arguments) + len(arguments) // 2 + 1
    deltas = []
    for i in range(cut):
        deltas += calls_stream.feed(text[i])[1]
    assert deltas[0]["function"]["name"] == calls[0]["function"]["name"]
    sent = "".join(d["function"]["arguments"] for d in deltas if d["index"] == 0)
    if not arguments.startswith("{}"):
        assert 0 < len(sent) < len(arguments) and arguments.startswith(sent)


def test_a_call_cut_short_keeps_what_streamed_and_its_finish_reason():
    text = '<tool_call>{"name": "get_time", "arguments": {"city": "Os'
    choice = accumulate(stream_chunks(AUTO, HERMES, text, 5, finish_reason="length"), AUTO, final=False)
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls[0].function.name == "get_time"
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Os'


NAMED = tool_calls.ToolRequest([WEATHER, TIME], "named", "get_weather")
REQUIRED = tool_calls.ToolRequest([WEATHER, TIME], "required")


@pytest.mark.parametrize("tools, text, names", [
    (NAMED, '{"city": "Ber', ["get_weather"]),
    (REQUIRED, '[{"name": "get_time", "parameters": {"city": "Os', ["get_time"]),
    (REQUIRED, '[{"name": "get_ti', []),
    (REQUIRED, '[{"name": "get_time", "parameters": {"city": "Oslo"}}, {"name": "get_weather", "param',
     ["get_time", "get_weather"]),
])
def test_a_forced_call_cut_short_is_never_content(tools, text, names):
    """tool_choice required or named, output cut by max_tokens: the calls named so far with their
    arguments as far as they got, finish_reason "length", and no content (it was the raw JSON, so
    frameworks saw a text answer), whole and streamed alike."""
    content, calls = tool_calls.parse_output(text, tools, HERMES)
    assert content is None and [c["function"]["name"] for c in calls] == names
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    for piece in (1, 4, 1000):
        choice = accumulate(stream_chunks(tools, HERMES, text, piece, finish_reason="length"), tools, final=False)
        assert choice.finish_reason == "length" and not choice.message.content
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == whole


def test_a_forced_call_cut_short_by_max_tokens_over_http(http):
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER, TIME], "max_tokens": 3,
            "tool_choice": "required", "ignore_eos": True}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert message["finish_reason"] == "length" and message["message"]["content"] is None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line[6:] != "[DONE]"]
    assert not "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_parallel_tool_calls_false_keeps_the_first_call():
    single = tool_calls.ToolRequest([WEATHER, TIME], "auto", parallel=False)
    text = CASES[1][2]
    _, calls = tool_calls.parse_output(text, single, HERMES)
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    choice = accumulate(stream_chunks(single, HERMES, text, 3), single)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("get_time", '{"city": "Oslo"}')]


def test_the_object_scan_follows_growing_text():
    text = '{"name": "f", "arguments": {"s": "a}\\"b", "n": [1, {"x": 2}]}, "z": 3}'
    whole = scan_object(text, 0)
    assert whole.end == len(text) and whole.string(text, "name") == "f"
    start, end = whole.fields["arguments"]
    assert json.loads(text[start:end]) == {"s": 'a}"b', "n": [1, {"x": 2}]}
    for cut in range(len(text)):
        partial = scan_object(text[:cut], 0)
        assert partial.end is None
        for key, (s, e) in partial.fields.items():
            assert s == whole.fields[key][0] and e in (None, whole.fields[key][1])


@pytest.fixture(scope="module")
def http(tiny_qwen3):
    pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine
    from asyncllm.server import create_app

    engine = AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=64, max_model_len=1024)
    with TestClient(create_app(engine, "tiny")) as client:
        client.engine = engine
        yield client


@pytest.mark.parametrize("extra, stop", [
    ({"parallel_tool_calls": False}, ["</tool_call>"]),  # the first call's end ends the answer
    ({"parallel_tool_calls": False, "stop": ["zz"]}, ["zz", "</tool_call>"]),
    ({}, []),
    ({"parallel_tool_calls": False, "tool_choice": "required"}, []),  # the grammar allows one call already
])
def test_parallel_tool_calls_false_stops_generating_after_the_first_call(http, monkeypatch, extra, stop):
    submitted = []
    stream = http.engine.stream

    def recording_stream(prompt_ids, params, **kw):
        submitted.append(params)
        return stream(prompt_ids, params, **kw)

    monkeypatch.setattr(http.engine, "stream", recording_stream)
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER, TIME],
            "max_tokens": 2, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert submitted[0].stop == stop


@pytest.mark.parametrize("piece", [1, 2, 5])
def test_an_open_container_read_piece_by_piece_ends_where_the_whole_text_says(piece):
    value = '{"s": "a}\\\\", "t": "\\"]", "n": [1, {"x": [2]}]}'
    text = value + ', "rest": 1}'
    container = OpenContainer(0)
    ends = [container.advance(text[:cut]) for cut in range(piece, len(text) + piece, piece)]
    assert ends[-1] == len(value) == value_end(text, 0)
    assert all(end is None for end, cut in zip(ends, range(piece, len(text) + piece, piece)) if cut < len(value))
    json.loads(value)


def test_a_streamed_tool_call_carries_every_tokens_logprobs(http):
    """A tool-calling answer's text is held back while it may be part of a call: the logprobs of the
    held tokens go out with the next chunk that is sent, so the stream carries one entry per token, as
    the whole answer does."""
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], "max_tokens": 24, "seed": 3,
            "temperature": 1.0, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "logprobs": True}
    whole = http.post("/v1/chat/completions", json=body).json()
    assert len(whole["choices"][0]["logprobs"]["content"]) == whole["usage"]["completion_tokens"]
    events = []
    with http.stream("POST", "/v1/chat/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line[6:] != "[DONE]":
                events.append(json.loads(line[6:]))
    streamed = [entry for e in events if e["choices"] and e["choices"][0]["logprobs"]
                for entry in e["choices"][0]["logprobs"]["content"]]
    assert any(e["choices"] and e["choices"][0]["delta"].get("tool_calls") for e in events)
    assert [entry["token"] for entry in streamed] == [entry["token"] for entry in whole["choices"][0]["logprobs"]["content"]]
    assert len(streamed) == events[-1]["usage"]["completion_tokens"]


def test_a_constrained_request_is_submitted_off_the_event_loop(http, monkeypatch):
    """A grammar compiles at submission (seconds for a large schema or choice list): a constrained
    request is submitted on a worker thread, so the server's event loop serves every other stream
    meanwhile; an unconstrained one is submitted on the loop (no thread hop)."""
    on_loop = []
    stream = http.engine.stream

    def recording_stream(prompt_ids, params, **kw):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return stream(prompt_ids, params, **kw)

    monkeypatch.setattr(http.engine, "stream", recording_stream)
    for extra in ({"guided_regex": "[ab]{3}"}, {}):
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    **extra})
        assert r.status_code == 200, r.text
    assert on_loop == [False, True]


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(http):
    events = []
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line[6:] != "[DONE]":
                events.append(json.loads(line[6:]))
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] < 5
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] for e in events)
