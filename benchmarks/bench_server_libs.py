"""What the server's hand-written parts cost against the maintained libraries that could replace
them (issue 51): request validation (server/protocol.py vs pydantic models), the partial-JSON scan
of streamed tool calls (server/json_scan.py vs partial-json-parser) and the SSE response
(server/sse.py's EventStreamResponse vs sse-starlette's EventSourceResponse). No model, no socket.

    python benchmarks/bench_server_libs.py [--repeat 2000] [--events 5000] [--responses 5000]

A library that is not installed is reported as such (pip install pydantic partial-json-parser
sse-starlette to compare all three). Figures are CPU microseconds per request / token / event on
this process's event loop (the server's one loop serves every stream).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Literal

from asyncllm.server import protocol
from asyncllm.server.sse import EventStreamResponse, sse
from asyncllm.server.tool_call_stream import ToolCallStream
from asyncllm.server.tool_calls import FORMATS, ToolRequest

CHAT_BODY = {"model": "m", "messages": [{"role": "system", "content": "You are terse."},
                                        {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
                                        {"role": "assistant", "content": "Hello."},
                                        {"role": "user", "content": "Again, in French."}],
             "temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "stop": ["\n\n"], "seed": 1,
             "presence_penalty": 0.1, "stream": True, "stream_options": {"include_usage": True}}
ARGUMENTS = json.dumps({"city": "Paris", "days": list(range(40)), "notes": "a long note " * 60,
                        "nested": {"a": [1, 2, {"b": "c"}], "d": "e" * 200}})
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGUMENTS + '}\n</tool_call>'
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def cpu_us(fn, repeat: int) -> float:
    fn()
    start = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - start) / repeat * 1e6


def validation(repeat: int) -> dict:
    """One chat request's fields checked and made into SamplingParams."""
    def hand_written():
        protocol.check_fields(CHAT_BODY, protocol.CHAT_FIELDS, protocol.NEUTRAL_CHAT)
        protocol.messages(CHAT_BODY)
        protocol.stream_options(CHAT_BODY)
        protocol.sampling_params(CHAT_BODY, "max_completion_tokens", 1000, None)
    row = {"protocol.py": round(cpu_us(hand_written, repeat), 1)}
    try:
        import pydantic
    except ImportError:
        return {**row, "pydantic": "not installed"}

    class TextPart(pydantic.BaseModel):
        type: Literal["text"]
        text: str

    class Message(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="allow")
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: str | list[TextPart] | None = None
        name: str | None = None

    class StreamOptions(pydantic.BaseModel):
        include_usage: bool | None = None
        continuous_usage_stats: bool | None = None

    class ChatRequest(pydantic.BaseModel):  # the types only: SamplingParams still checks the values
        model_config = pydantic.ConfigDict(extra="allow")
        model: str | None = None
        messages: list[Message]
        temperature: float | None = None
        top_p: float | None = None
        max_tokens: int | None = None
        max_completion_tokens: int | None = None
        stop: str | list[str] | None = None
        seed: int | None = None
        presence_penalty: float | None = None
        frequency_penalty: float | None = None
        n: int | None = None
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        logprobs: bool | None = None
        top_logprobs: int | None = None
        logit_bias: dict[str, float] | None = None

    from asyncllm.sampling_params import SamplingParams

    def with_pydantic():
        request = ChatRequest.model_validate(CHAT_BODY)
        SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                       stop=request.stop, seed=request.seed, presence_penalty=request.presence_penalty)
    return {**row, "pydantic": round(cpu_us(with_pydantic, repeat), 1), "pydantic_version": pydantic.VERSION}


def partial_json(piece: int) -> dict:
    """A streamed tool call's text fed `piece` characters at a time (about a token): the cost per
    piece of finding what to send."""
    pieces = [CALL_TEXT[i:i + piece] for i in range(0, len(CALL_TEXT), piece)]

    def with_scan():
        calls = ToolCallStream(ToolRequest([TOOL], "auto"), FORMATS["hermes"])
        for p in pieces:
            calls.feed(p)
        calls.finish()
    row = {"call_chars": len(CALL_TEXT), "pieces": len(pieces),
           "json_scan": round(cpu_us(with_scan, 20) / len(pieces), 2)}
    try:
        import partial_json_parser
    except ImportError:
        return {**row, "partial_json_parser": "not installed"}
    start = CALL_TEXT.index("{")

    def with_parser():  # vLLM's way: parse the whole call so far at each token, then diff the re-serialized arguments
        text, sent = "", ""
        for p in pieces:
            text += p
            try:
                value = partial_json_parser.loads(text[start:].removesuffix("\n</tool_call>"))
            except Exception:  # noqa: BLE001 - nothing parseable yet
                continue
            if isinstance(value, dict) and "arguments" in value:
                sent = json.dumps(value["arguments"], ensure_ascii=False)
    row["partial_json_parser"] = round(cpu_us(with_parser, 5) / len(pieces), 2)
    return row


async def _drive(response, num_events: int) -> float:
    done = asyncio.Event()
    sent = [0]

    async def receive():
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            sent[0] += 1
            if not message.get("more_body", False):
                done.set()
    scope = {"type": "http", "method": "POST", "headers": []}
    start = time.process_time()
    await response(scope, receive, send)
    return (time.process_time() - start) / num_events * 1e6


def event_stream(num_events: int) -> dict:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}]}

    async def events():
        for _ in range(num_events):
            yield sse(chunk)
            await asyncio.sleep(0)  # the engine's next token

    async def closed():
        pass
    row = {"events": num_events,
           "sse.py": round(asyncio.run(_drive(EventStreamResponse(events(), on_close=closed, keepalive_interval=10),
                                              num_events)), 2)}
    try:
        import sse_starlette
    except ImportError:
        return {**row, "sse_starlette": "not installed"}

    async def data():
        for _ in range(num_events):
            yield {"data": json.dumps(chunk, ensure_ascii=False)}
            await asyncio.sleep(0)
    row["sse_starlette"] = round(asyncio.run(_drive(sse_starlette.EventSourceResponse(data(), ping=10), num_events)), 2)
    return row


def event_stream_responses(num_responses: int) -> dict:
    """A streamed answer's fixed cost: whole responses of one event each through EventStreamResponse
    (its task group, the disconnect watcher and keep-alive, the close), CPU per response."""
    async def run() -> float:
        async def closed():
            pass

        async def one_event():
            yield "data: {}\n\n"
        start = time.process_time()
        for _ in range(num_responses):
            done = asyncio.Event()

            async def receive():
                await done.wait()
                return {"type": "http.disconnect"}

            async def send(message):
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    done.set()
            await EventStreamResponse(one_event(), on_close=closed, keepalive_interval=10)(
                {"type": "http", "method": "POST", "headers": []}, receive, send)
        return (time.process_time() - start) / num_responses * 1e6
    return {"responses": num_responses, "sse.py": round(asyncio.run(run()), 2)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000, help="requests validated per variant")
    parser.add_argument("--events", type=int, default=5000, help="events streamed per variant")
    parser.add_argument("--responses", type=int, default=5000, help="one-event responses streamed")
    args = parser.parse_args(argv)
    results = {"validation_us_per_request": validation(args.repeat),
               "tool_call_us_per_piece": [partial_json(piece) for piece in (4, 16)],
               "sse_us_per_event": event_stream(args.events),
               "sse_us_per_response": event_stream_responses(args.responses)}
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
