"""Server-sent events: a response that aborts its engine stream when the client goes away, and the
OpenAI chunk stream of one request."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from asyncllm.errors import EngineDeadError

logger = logging.getLogger("asyncllm.server")


class EventStreamResponse(StreamingResponse):
    """A server-sent-events response that always closes its body iterator.

    The body runs beside a watcher of the client's connection, whatever the server's ASGI spec
    version; when the client goes away the body is cancelled, and in every case the async
    generator is aclose()d, so a generator that holds an engine stream in `async with` or
    try/finally aborts its request at once instead of at garbage collection.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator, status_code: int = 200, headers: dict | None = None,
                 on_close: Callable[[], Awaitable] | None = None):
        """on_close: awaited last, in every case, even when the client left before the body started
        (then the generator never ran, so its own finally never runs): pass the engine stream's aclose."""
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, status_code=status_code, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                async def run_body() -> None:
                    try:
                        await self.stream_response(send)
                    except (OSError, ClientDisconnect):  # the client is gone
                        pass
                    except Exception:  # noqa: BLE001 - the status line is sent; nothing to answer with
                        logger.exception("error while streaming a response")
                    tasks.cancel_scope.cancel()

                tasks.start_soon(run_body)
                await self.listen_for_disconnect(receive)
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self.on_close is not None:
                    await self.on_close()


def sse(data) -> str:
    """One server-sent event carrying `data` (JSON-encoded unless it is a string)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def await_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def usage(stream) -> dict:
    prompt, completion = len(stream.prompt_token_ids), len(stream.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def chunk_events(stream, close: Callable[[str | None], Awaitable[None]],
                       make_chunk: Callable[[str | None, str | None], dict], first: dict | None,
                       include_usage: bool) -> AsyncIterator[str]:
    """The SSE body of an OpenAI streamed answer: `first`, chunks built by make_chunk(text,
    finish_reason) (None: nothing to send yet), the usage chunk if asked for, then [DONE].
    close(finish_reason) runs last."""
    finish_reason = None
    try:
        if first is not None:
            yield sse(first)
        async for out in stream:
            if out.text and (chunk := make_chunk(out.text, None)) is not None:
                yield sse(chunk)
            if out.finish_reason is not None:
                finish_reason = out.finish_reason
                yield sse(make_chunk(None, out.finish_reason))
        if include_usage:
            chunk = make_chunk(None, None)
            chunk["choices"], chunk["usage"] = [], usage(stream)
            yield sse(chunk)
        yield sse("[DONE]")
    except EngineDeadError as e:
        finish_reason = "error"
        yield sse({"error": {"message": f"the engine failed: {e}", "type": "server_error", "param": None,
                             "code": "engine_unavailable"}})
        yield sse("[DONE]")
    finally:
        await close(finish_reason)  # aborts the request unless it has finished
