"""What `asyncllm serve` adds to uvicorn: every request head must arrive in time and within
MAX_HEAD_BYTES, the 503 past --limit-concurrency comes in OpenAI's shape (HeadLimits, on uvicorn's
httptools protocol where httptools is installed, else on its h11 one: http_protocol()), and a
shutdown drains the requests in flight, then ends those left in OpenAI's shape (DrainingServer)."""
from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from asyncllm.server.errors import service_unavailable
from asyncllm.server.shutdown import Drain

try:  # httptools (llhttp, C): ~3x cheaper request heads than h11's pure-Python parser (docs/BENCHMARKS.md)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # the server extra installs it; without it, h11
    HttpToolsProtocol = None

END_GRACE_S = 5.0  # after the drain: for the requests ended to send their ends before uvicorn cancels them
# h11's own bound on a request head held incomplete (h11.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE), kept on
# httptools (which has none): past it the connection gets a 400 and is closed
MAX_HEAD_BYTES = 16 * 1024


class HeadLimits:
    """A mixin for uvicorn's HTTP protocols (h11's and httptools'): closes a connection that has not
    sent a whole request head within the keep-alive timeout of opening or of its last response.

    uvicorn arms that timeout only after a response and cancels it on the next byte received, so a
    connection that sends nothing, or a head a byte at a time (on its first request or any later
    one), would otherwise hold a file descriptor, and a --limit-concurrency slot, forever.

    It also enforces --limit-concurrency itself, with the same test as uvicorn, answering past it with
    errors.service_unavailable (uvicorn's own answer is plain text, taken from a module global that
    could only be replaced process-wide)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._concurrency_limit, self.limit_concurrency = self.limit_concurrency, None  # uvicorn's test: off
        if self._concurrency_limit is not None:
            self.app = self._limited(self.app)

    def _limited(self, app):
        async def limited(scope, receive, send) -> None:
            # uvicorn tests before it adds the request's task; here that task is already in self.tasks
            over = (len(self.connections) >= self._concurrency_limit
                    or len(self.tasks) > self._concurrency_limit)
            if over:
                self.logger.warning("Exceeded concurrency limit.")
            await (service_unavailable if over else app)(scope, receive, send)
        return limited

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        # armed before uvicorn starts a pipelined request's cycle: the deadline is for the next head
        self._arm_head_deadline()
        super().on_response_complete()

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        waiting_after = self.cycle  # None on a new connection; the finished cycle after a response
        self._head_deadline = self.loop.call_later(self.timeout_keep_alive, self._close_if_no_new_request,
                                                   waiting_after)

    def _close_if_no_new_request(self, waiting_after) -> None:
        # a new head makes uvicorn start a new cycle; the same one means no head came in time
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)


class HeadTimeoutH11Protocol(HeadLimits, H11Protocol):
    """uvicorn's h11 protocol with HeadLimits (h11 bounds a head's size itself)."""


if HttpToolsProtocol is not None:
    class HeadTimeoutHttpToolsProtocol(HeadLimits, HttpToolsProtocol):
        """uvicorn's httptools protocol with HeadLimits, and h11's bound on a head held incomplete:
        llhttp has none (httptools gathers a header whole before uvicorn sees it), so the bytes
        received while a head is incomplete are counted as they arrive."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._awaiting_head, self._head_bytes = True, 0

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head:
                self._head_bytes += len(data)
            super().data_received(data)
            # still in a head after all of data: every byte counted was the head's
            if self._awaiting_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")  # h11's answer to a head too long

        def on_headers_complete(self) -> None:
            self._awaiting_head, self._head_bytes = False, 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._awaiting_head = True
            super().on_message_complete()
else:
    HeadTimeoutHttpToolsProtocol = None


def http_protocol() -> type:
    """The protocol `asyncllm serve` runs: httptools' where it is installed (as uvicorn's "auto" picks), else h11's."""
    return HeadTimeoutHttpToolsProtocol or HeadTimeoutH11Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM, SIGINT) drains: uvicorn stops accepting
    connections and closes idle ones, a request not yet submitted to the engine gets a 503, and
    those submitted run for up to drain_s seconds; then the drain ends those still running
    (Drain.end_in_flight: an error event and [DONE] for a stream, a 503 for a whole answer), and
    the engine shuts down. The wait ends as soon as nothing runs. uvicorn's own cancellation (a cut
    stream, a plain-text 500) is left for requests that have not ended END_GRACE_S after that."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_s: float):
        config.timeout_graceful_shutdown = drain_s + END_GRACE_S  # type: ignore[assignment]
        super().__init__(config)
        self.drain = drain
        self.drain_s = drain_s

    async def shutdown(self, sockets=None) -> None:
        self.drain.begin()
        ending = asyncio.get_running_loop().call_later(self.drain_s, self.drain.end_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()
