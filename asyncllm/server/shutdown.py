"""Shutting the server down without losing requests silently: a drain, then an OpenAI-shaped end for
whatever still runs (connections.DrainingServer drives it from uvicorn's shutdown)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio

from asyncllm.server.errors import RETRY_AFTER_SECONDS
from asyncllm.server.protocol import APIError


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down; retry the request on another instance, or once it is back",
                    code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class Drain:
    """The requests a server has in flight, and their end when it shuts down.

    begin(): from then on a request not yet submitted to the engine gets a 503 (`refusing`); those
    submitted run on. end_in_flight(): the handlers still at work (reading a body, tokenizing,
    collecting a whole answer) are cancelled and answer a 503, and the streams are aborted in the
    engine; their SSE bodies then end with an error event and [DONE] (ended_by_shutdown)."""

    def __init__(self, abort: Callable[[str], None]):
        self._abort = abort  # engine.abort
        self.refusing = False
        self._handlers: set[anyio.CancelScope] = set()
        self._streams: set[str] = set()  # request ids submitted and not yet closed
        self._ended: set[str] = set()

    @contextmanager
    def handling(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope around a request's handler; its cancel_called says the shutdown ended it."""
        with anyio.CancelScope() as scope:
            self._handlers.add(scope)
            try:
                yield scope
            finally:
                self._handlers.discard(scope)

    def track(self, request_id: str) -> None:
        self._streams.add(request_id)

    def untrack(self, request_id: str) -> None:
        self._streams.discard(request_id)

    def begin(self) -> None:
        self.refusing = True

    def end_in_flight(self) -> None:
        """On the event loop: end every request still in flight."""
        self.refusing = True
        # handlers first: a whole answer's handler is cancelled before its stream's abort can reach it
        for scope in list(self._handlers):
            scope.cancel()
        self._ended.update(self._streams)
        for request_id in list(self._streams):
            self._abort(request_id)

    def ended_by_shutdown(self, request_id: str) -> bool:
        return request_id in self._ended
