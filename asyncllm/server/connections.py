"""Connection limits uvicorn lacks: a connection must send its first request head in time."""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


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
