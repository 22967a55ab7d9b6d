"""Connection limits uvicorn lacks: a connection must send its first request head in time; and the
503 uvicorn answers past its own limit, in OpenAI's shape."""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

from asyncllm.server.errors import service_unavailable


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head within
    the keep-alive timeout. uvicorn arms that timeout only after a response, so a connection that
    sends nothing, or its headers a byte at a time, would otherwise hold a file descriptor forever."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline = self.loop.call_later(self.timeout_keep_alive, self._close_if_no_request)

    def _close_if_no_request(self) -> None:
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.cancel()
        super().connection_lost(exc)


def answer_over_limit_in_openai_shape() -> None:
    """Make uvicorn's h11 protocol answer its --limit-concurrency 503 with an OpenAI error body.
    uvicorn takes that ASGI app from a module global of h11_impl, so it is swapped there; only
    `asyncllm serve` calls this, for the process it owns."""
    h11_impl.service_unavailable = service_unavailable
