"""Server-sent events: a response that aborts its engine stream when the client goes away, and the
OpenAI chunk stream of one request."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from json.encoder import encode_basestring as encode_json_string  # json's own, for ensure_ascii=False
from typing import TypeVar

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from asyncllm.errors import (EngineAsleepError, EngineDeadError, InvalidValueError, QueueFullError,
                             RequestTimeoutError, UnsatisfiableConstraintsError)
from asyncllm.server.errors import asleep_error, queue_full_error
from asyncllm.server.limits import request_timeout_error
from asyncllm.server.protocol import APIError
from asyncllm.server.shutdown import shutting_down_error

logger = logging.getLogger("asyncllm.server")

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
JSON = json.JSONEncoder(ensure_ascii=False)  # json.dumps(data, ensure_ascii=False) makes one per call
# where a text chunk's text goes in its template (TextChunks); JSON writes it "\u0000text\u0000"
TEXT_SLOT = "\x00text\x00"
ENCODED_TEXT_SLOT = JSON.encode(TEXT_SLOT)


class EventStreamResponse(StreamingResponse):
    """A server-sent-events response that always closes its body iterator.

    The body runs beside a watcher of the client's connection, whatever the server's ASGI spec
    version; when the client goes away the body is cancelled, and in every case the async
    generator is aclose()d, so a generator that holds an engine stream in `async with` or
    try/finally aborts its request at once instead of at garbage collection.
    """

    media_type = "text/event-stream"
    KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it

    def __init__(self, content: AsyncIterator, status_code: int = 200, headers: dict | None = None,
                 on_close: Callable[[], Awaitable] | None = None, keepalive_interval: float | None = None):
        """on_close: awaited last, in every case, even when the client left before the body started
        (then the generator never ran, so its own finally never runs): pass the engine stream's aclose.
        keepalive_interval: after this many seconds without an event, a comment line (KEEPALIVE)
        is sent, so that proxies and clients with read timeouts do not drop a stream that waits
        in the queue or behind a long prefill; None: never."""
        if keepalive_interval is not None and not keepalive_interval > 0:
            raise InvalidValueError("keepalive_interval", f"expected a positive number of seconds or None, "
                                                        f"got {keepalive_interval!r}")
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, status_code=status_code, headers=headers)
        self.on_close = on_close
        self.keepalive_interval = keepalive_interval

    async def __call__(self, scope, receive, send) -> None:
        # One task group and one task beside the body: the watcher waits for the client to leave and
        # sends the keep-alive comments. Per request a task group, a task and a cancel (anyio builds
        # the cancelling task's repr) are tens of microseconds of the event loop's time, and the body
        # runs in this task, so its sends need no task of their own.
        self._last_sent = time.monotonic()
        self._body_sending = True  # until the status line has gone: no comment before it
        self._keepalive_sent: anyio.Event | None = None  # set when the comment in flight has gone
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._watch, receive, send, tasks.cancel_scope)
                try:
                    await self._send_body(send)
                except (OSError, ClientDisconnect):  # the client is gone
                    pass
                except Exception:  # noqa: BLE001 - the status line is sent; nothing to answer with
                    logger.exception("error while streaming a response")
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self.on_close is not None:
                    await self.on_close()

    async def _watch(self, receive, send, scope: anyio.CancelScope) -> None:
        """Until the client goes away (then the response is cancelled): with keepalive_interval, a
        KEEPALIVE comment after each keepalive_interval without an event. The body and this task
        run on one event loop, so plain flags keep their sends apart: no lock, whose acquire would
        yield to the loop once per chunk of every stream. Times are time.monotonic(), read per
        chunk: anyio's current_time() asks which async library runs first (sniffio), about a sixth
        of the event loop's time per chunk under load."""
        interval = self.keepalive_interval
        try:
            while True:
                if interval is None:
                    await await_disconnect(receive)
                    break
                remaining = self._last_sent + interval - time.monotonic()
                if remaining > 0 or self._body_sending:  # a send held up by a slow client counts as activity
                    with anyio.move_on_after(remaining if remaining > 0 else interval):
                        await await_disconnect(receive)
                        break
                    continue
                self._keepalive_sent = anyio.Event()
                try:
                    await send({"type": "http.response.body", "body": self.KEEPALIVE, "more_body": True})
                    self._last_sent = time.monotonic()
                finally:
                    self._keepalive_sent.set()
                    self._keepalive_sent = None
        except (OSError, ClientDisconnect):  # the client is gone
            pass
        except Exception:  # noqa: BLE001 - as the body's errors: the status line is sent
            logger.exception("error while streaming a response")
        scope.cancel()

    async def _send_body(self, send) -> None:
        """StreamingResponse.stream_response, the body's chunks sent inline (per chunk of every
        stream: no call of its own), none while a keep-alive comment is in flight."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._body_sending = False
        self._last_sent = time.monotonic()
        charset = self.charset
        async for chunk in self.body_iterator:
            message = {"type": "http.response.body", "more_body": True,
                       "body": chunk if isinstance(chunk, (bytes, memoryview)) else chunk.encode(charset)}
            while self._keepalive_sent is not None:
                await self._keepalive_sent.wait()
            self._body_sending = True
            await send(message)
            self._body_sending = False
            self._last_sent = time.monotonic()
        while self._keepalive_sent is not None:
            await self._keepalive_sent.wait()
        self._body_sending = True  # from here on no comment: nothing may follow the body's end
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def sse(data, event: str | None = None) -> str:
    """One server-sent event carrying `data` (JSON-encoded unless it is a string); event: its type
    line (the Responses API names each event; chat and completions send data lines only)."""
    line = f"data: {data if isinstance(data, str) else JSON.encode(data)}\n\n"
    return line if event is None else f"event: {event}\n{line}"


async def await_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """(True, what work() returned), or (False, None) when the client disconnected first: work is
    then cancelled (an engine stream it reads is aborted, a compile it waits for given up). An
    exception work raises is raised here as it is (not in an exception group)."""
    done, result, error = False, None, None
    async with anyio.create_task_group() as tasks:
        async def watch() -> None:
            await await_disconnect(receive)
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        try:
            result, done = await work(), True
        except Exception as e:  # noqa: BLE001 - raised below, outside the task group
            error = e
        tasks.cancel_scope.cancel()
    if error is not None:
        raise error
    return done, result


def usage(streams) -> dict:
    """OpenAI's usage of a request's streams (a StreamGroup: every prompt's, every choice's tokens)."""
    prompt, completion = streams.num_prompt_tokens, streams.num_completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def answer_events(stream, close: Callable[[str | None], Awaitable[None]],
                        item_events: Callable[..., list[str]], end_events: Callable[[], list[str]],
                        error_events: Callable[[APIError], list[str]], first: list[str] = (),
                        ended_by_shutdown: Callable[[str], bool] = lambda request_id: False) -> AsyncIterator[str]:
    """The SSE body of a streamed answer, in any API's shape: `first`, item_events(out) for each
    stream item, then end_events() once every choice has finished. An engine that dies, constraints
    that leave no token, or a server shutdown that ends the request (ended_by_shutdown(request_id))
    send error_events(the APIError) instead of what is left, and so does a timeout that passed before
    the first token (a 408's body; one that passed later is an item with finish_reason "timeout").
    close(finish_reason) runs last."""
    finish_reason = None
    try:
        for event in first:
            yield event
        async for out in stream:
            if out.finish_reason == "abort" and ended_by_shutdown(out.request_id):
                for event in error_events(shutting_down_error()):
                    yield event
                return
            if out.finish_reason is not None:
                finish_reason = out.finish_reason
            for event in item_events(out):
                yield event
        for event in end_events():
            yield event
    except EngineDeadError as e:
        finish_reason = "error"
        for event in error_events(APIError(503, f"the engine failed: {e}", code="engine_unavailable")):
            yield event
    except RequestTimeoutError as e:
        finish_reason = "timeout"
        for event in error_events(request_timeout_error(e)):
            yield event
    except QueueFullError as e:  # with front-end processes the engine admits a request after its first event
        for event in error_events(queue_full_error(e)):
            yield event
    except EngineAsleepError as e:  # (the same) submitted as the engine went to sleep
        for event in error_events(asleep_error(e)):
            yield event
    except UnsatisfiableConstraintsError as e:  # the request's own constraints: it ends here (an abort)
        for event in error_events(APIError(400, e.message_without_owner, code="unsatisfiable_constraints")):
            yield event
    finally:
        await close(finish_reason)  # aborts the request unless it has finished


class TextChunks:
    """The events of chunks that bring a choice's new text and nothing else, the most of a stream:
    each choice's chunk is built and JSON-encoded once, with TEXT_SLOT for its text, and an event is
    that template with the text's JSON string in the slot, byte for byte what sse() of the chunk
    gives, without building and encoding the chunk per token. text_chunk(index): choice index's
    chunk with TEXT_SLOT as its text."""

    def __init__(self, text_chunk: Callable[[int], dict]):
        self.text_chunk = text_chunk
        self.templates: dict[int, tuple[str, str]] = {}  # by choice index: the event before and after the text

    def event(self, index: int, text: str) -> str:
        template = self.templates.get(index)
        if template is None:
            before, slot, after = sse(self.text_chunk(index)).partition(ENCODED_TEXT_SLOT)
            if not slot or ENCODED_TEXT_SLOT in after:
                raise AssertionError(f"the text chunk of choice {index} holds TEXT_SLOT other than once")
            template = self.templates[index] = (before, after)
        return template[0] + encode_json_string(text) + template[1]


def chunk_events(stream, close: Callable[[str | None], Awaitable[None]], make_chunk: Callable[..., dict],
                 first: list[dict], include_usage: bool,
                 ended_by_shutdown: Callable[[str], bool] = lambda request_id: False,
                 text_chunks: TextChunks | None = None) -> AsyncIterator[str]:
    """The SSE body of a chat or completions answer: the `first` chunks, chunks built by
    make_chunk(text, finish_reason, stream item) (a choice's new text, reasoning and its tokens'
    logprobs, then its finish; None: nothing to send yet), the usage chunk if asked for, then [DONE];
    an error as an OpenAI error body, then [DONE]. text_chunks: where an answer's chunks of text
    alone are the same but for their text (no logprobs, tool calls or running usage), their events
    (an item with reasoning still goes through make_chunk)."""
    def item_events(out) -> list[str]:
        events = []
        if text_chunks is not None and out.text and not out.reasoning and out.logprobs is None:
            events.append(text_chunks.event(out.index, out.text))
        elif (out.text or out.logprobs or out.reasoning) and (chunk := make_chunk(out.text, None, out)) is not None:
            events.append(sse(chunk))
        if out.finish_reason is not None:
            events.append(sse(make_chunk(None, out.finish_reason, out)))
        return events

    def end_events() -> list[str]:
        if not include_usage:
            return [DONE]
        chunk = make_chunk(None, None, delta={})  # a delta: never held back
        chunk["choices"], chunk["usage"] = [], usage(stream)
        return [sse(chunk), DONE]

    def error_events(error: APIError) -> list[str]:
        return [sse(error.body()), DONE]
    return answer_events(stream, close, item_events, end_events, error_events, [sse(c) for c in first],
                         ended_by_shutdown)
