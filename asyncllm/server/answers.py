"""Chat and completions answers of a Generation: its choices streamed as OpenAI chunks or whole,
with tool calls (chat), echo (completions: each choice begins with its prompt) and usage."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.responses import JSONResponse

from asyncllm.sampling_params import SamplingParams
from asyncllm.server import tool_calls
from asyncllm.server.choices import ChoiceShaper, prompt_logprobs_field
from asyncllm.server.sse import TEXT_SLOT, EventStreamResponse, TextChunks, chunk_events, usage
from asyncllm.server.stream_group import StreamGroup
from asyncllm.server.tool_call_stream import ToolCallStream


@dataclass
class Generation:
    """A submitted request: its id, sampling, one engine stream per prompt, its tools (and their
    call format) if it may call them, and whether the client asked for prompt_logprobs (echo with
    logprobs computes them too)."""
    request_id: str
    params: SamplingParams
    streams: StreamGroup
    tools: tuple[tool_calls.ToolRequest, tool_calls.ToolCallFormat] | None = None
    prompt_logprobs_asked: bool = False


@dataclass
class Echo:
    """Completions' echo: each prompt's text (prompt p's choices begin with texts[p]) and, for
    echo with logprobs, each prompt's first token as text (it has no logprob)."""
    texts: list[str]
    first_tokens: list[str] = field(default_factory=list)


def _base(gen: Generation, chat: bool, model_name: str) -> dict:
    return {"id": gen.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model_name}


def stream_response(server, gen: Generation, *, chat: bool, include_usage: bool, continuous_usage: bool,
                    echo: Echo | None = None) -> EventStreamResponse:
    """The answer as server-sent chunks (server: the OpenAIServer, for its closer, drain and keep-alive)."""
    streams, tools = gen.streams, gen.tools
    base = _base(gen, chat, server.model_name)
    shaper = ChoiceShaper(chat, gen.params.logprobs is not None)
    calls_stream = ToolCallStream(*tools) if tools is not None else None
    held_logprobs = []  # a tool-calling answer's: of tokens whose text is held back, sent with the next chunk

    def chunk(text: str | None, finish_reason: str | None, out=None, delta: dict | None = None,
              index: int = 0) -> dict | None:
        if out is not None:
            index = out.index
        logprobs = None if out is None or finish_reason else out.logprobs
        reasoning = None if out is None or finish_reason else out.reasoning  # tool calls are in the answer
        if calls_stream is not None and delta is None:
            text, delta, finish_reason = tool_call_delta(calls_stream, text, finish_reason)
            held_logprobs.extend(logprobs or ())
            if delta is None and finish_reason is None and not reasoning:
                return None  # held back: it may be part of a tool call
            logprobs = list(held_logprobs) or None
            held_logprobs.clear()
        choice = shaper.chunk_choice(index, text, finish_reason, delta=delta, logprobs=logprobs,
                                     stop_reason=None if out is None else out.stop_reason, reasoning=reasoning)
        kind = {"object": "chat.completion.chunk"} if chat else {}
        usage_field = {"usage": usage(streams) if continuous_usage else None} if include_usage else {}
        return {**base, **kind, "choices": [choice], **usage_field}

    if chat:
        first = [chunk(None, None, delta={"role": "assistant", "content": ""}, index=i)
                 for i in range(streams.num_choices)]
    elif echo is not None:
        first = [chunk(echo.texts[i // gen.params.n], None, delta={}, index=i) for i in range(streams.num_choices)]
    else:
        first = []
    close = server.closer(streams)
    # chunks of text alone differ only in their text unless tool calls are parsed from it, logprobs
    # come with it or each chunk carries the usage so far
    plain = calls_stream is None and not shaper.wants_logprobs and not continuous_usage
    text_chunks = TextChunks(lambda index: chunk(TEXT_SLOT, None, index=index)) if plain else None
    events = chunk_events(streams, close, chunk, first, include_usage, server.drain.ended_by_shutdown, text_chunks)
    return EventStreamResponse(events, on_close=close, keepalive_interval=server.sse_keepalive_interval)


async def whole_response(server, request, gen: Generation, *, chat: bool, echo: Echo | None = None) -> JSONResponse:
    """The whole answer, once every choice has finished."""
    results = await server.collect(request, gen.streams)
    shaper = ChoiceShaper(chat, gen.params.logprobs is not None)
    n = gen.params.n
    choices = []
    for r in results:
        text, logprobs = r.text, r.logprobs
        if echo is not None:
            text = echo.texts[r.index // n] + text
            if logprobs is not None:  # the prompt's tokens first, the first one without a logprob (OpenAI's shape)
                logprobs = (r.prompt_logprobs or []) + logprobs
        choice = shaper.choice(r.index, text, r.finish_reason, r.stop_reason, logprobs, r.reasoning,
                               first_token=echo.first_tokens[r.index // n] if echo and echo.first_tokens else None)
        choices.append(choice)
    if gen.tools is not None:  # n == 1
        content, calls = tool_calls.parse_output(results[0].text, *gen.tools)
        message = choices[0]["message"]
        if calls or gen.tools[0].forced:  # a forced call's output is never content, even cut short
            message.update(content=content, tool_calls=calls or None)  # beside reasoning_content
        if calls and choices[0]["finish_reason"] == "stop":
            choices[0]["finish_reason"] = "tool_calls"
    extra = {}
    if gen.prompt_logprobs_asked:  # vLLM's field (completions: also in each choice, as vLLM has it)
        if len(gen.streams.streams) == 1:
            extra["prompt_logprobs"] = prompt_logprobs_field(results[0].prompt_logprobs)
        if not chat:
            for r, choice in zip(results, choices):
                choice["prompt_logprobs"] = prompt_logprobs_field(r.prompt_logprobs)
    return JSONResponse({**_base(gen, chat, server.model_name), "choices": choices, "usage": usage(gen.streams),
                         **extra})


def tool_call_delta(calls_stream: ToolCallStream, text: str | None,
                    finish_reason: str | None) -> tuple[str | None, dict | None, str | None]:
    """(text, delta, finish_reason) of a chunk of an answer that may call tools: content until a
    call begins, then each call's name and its arguments in pieces; finish_reason tool_calls."""
    if finish_reason is None:
        content, calls = calls_stream.feed(text or "")
        called = False
    else:
        content, calls, called = calls_stream.finish()
        finish_reason = "tool_calls" if called and finish_reason == "stop" else finish_reason
    delta = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = calls
    return None, (delta if delta or finish_reason is not None else None), finish_reason
