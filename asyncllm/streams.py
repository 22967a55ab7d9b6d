"""One request's way out of the engine thread: RequestChannel (the engine thread's side), the
RequestStream a consumer iterates, and the items and results it yields.

The engine thread appends a step's token ids under a small lock and, if the consumer is waiting,
schedules a wake-up on the event loop of the read that waits (never blocking on it). A consumer
that reads slowly finds several steps' tokens merged in one read; it never holds the engine back.
Detokenization and stop strings run here, in the consumer's read.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncllm.detokenizer import TextAssembler


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() at submission
    queue_time: float | None = None  # submission -> first scheduled
    time_to_first_token: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)  # gaps between engine steps' tokens
    e2e_latency: float | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0


@dataclass
class StreamOutput:
    """One item of a stream: what is new since the previous item."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None until the last item: "stop", "length" or "abort"


@dataclass
class RequestResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    prompt_token_ids: list[int] = field(default_factory=list)


def _current_loop_waiter() -> tuple[Callable[[Callable[[], None]], None], object]:
    """For a read about to wait: the current event loop's thread-safe, non-blocking 'run this soon',
    and a new event of that loop's library (its own event: anyio.Event looks the library up on every
    creation, a cost paid per token here)."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe, asyncio.Event()
    except RuntimeError:
        pass
    try:
        import trio
        return trio.lowlevel.current_trio_token().run_sync_soon, trio.Event()
    except (ImportError, RuntimeError):
        raise RuntimeError("asyncllm streams must be used from an asyncio or trio event loop") from None


def wake(waiters_by_loop: dict[Callable, list]) -> None:
    """Set the waiting consumers' events: one callback per event loop, however many consumers."""
    for waker, waiters in waiters_by_loop.items():
        def set_all(waiters=waiters) -> None:
            for waiter in waiters:
                waiter.set()
        try:
            waker(set_all)
        except RuntimeError:
            pass  # that event loop is gone; nobody is left to wake


class RequestChannel:
    """Hands one request's tokens from the engine thread to its consumer.

    The wake-up goes to the event loop of the read that waits, not the one that created the
    stream: a stream made in one loop (or thread) and read in another must still be woken.
    """

    def __init__(self, request_id: str, wake_on_finish_only: bool = False):
        self.request_id = request_id
        # a consumer that only wants the whole answer (generate() without stop strings) is woken
        # once, at the end, not once per step: with hundreds of such requests the per-step wake-ups
        # cost the event loop more than the engine thread's own work
        self.wake_on_finish_only = wake_on_finish_only
        self._lock = threading.Lock()
        self._token_ids: list[int] = []
        self._finish_reason: str | None = None
        self._error: BaseException | None = None
        self._waiter = None  # the waiting read's event
        self._waiter_waker: Callable | None = None  # the waiting read's event loop
        self.closed = False  # the engine will send nothing more
        self.metrics: RequestMetrics | None = None
        self.last_token_time: float | None = None  # engine thread's bookkeeping for inter-token gaps

    # engine thread
    def put(self, token_ids: list[int], finish_reason: str | None, error: BaseException | None = None) -> None:
        waiting = self.put_quietly(token_ids, finish_reason, error)
        if waiting is not None:
            waker, waiter = waiting
            wake({waker: [waiter]})

    def put_quietly(self, token_ids: list[int], finish_reason: str | None,
                    error: BaseException | None = None) -> tuple[Callable, object] | None:
        """Hand over tokens; returns (its loop's waker, waiter) if the consumer is waiting (the caller
        wakes it)."""
        with self._lock:
            if self.closed:
                return None
            self._token_ids.extend(token_ids)
            if finish_reason is not None or error is not None:
                self._finish_reason = finish_reason
                self._error = error
                self.closed = True
            elif self.wake_on_finish_only:
                return None
            waiter, self._waiter = self._waiter, None
        return None if waiter is None else (self._waiter_waker, waiter)

    # consumer
    async def get(self) -> tuple[list[int], str | None]:
        while True:
            with self._lock:
                if self._error is not None:
                    raise self._error
                if self._token_ids or self.closed:
                    token_ids, self._token_ids = self._token_ids, []
                    return token_ids, self._finish_reason
                self._waiter_waker, waiter = _current_loop_waiter()
                self._waiter = waiter
            await waiter.wait()


class RequestStream:
    """The async iterator returned by AsyncLLMEngine.stream().

    Ending it early in any way (cancelling the task that reads it, a timeout, break, aclose(), or
    dropping it) aborts the request, and the engine frees its KV blocks before its next step.
    """

    def __init__(self, finish: Callable[[str, str, RequestChannel], None], channel: RequestChannel,
                 assembler: TextAssembler, prompt_token_ids: list[int]):
        self._finish = finish  # the engine's: end the request (reason "stop" or "abort")
        self._channel = channel
        self._assembler = assembler
        self.request_id = channel.request_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        return self._assembler.text[:self._assembler.num_released]

    @property
    def metrics(self) -> RequestMetrics | None:
        return self._channel.metrics

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamOutput:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        try:
            token_ids, finish_reason = await self._channel.get()
        except BaseException:
            self._abort()
            raise
        self.token_ids.extend(token_ids)
        text = self._assembler.add(token_ids)
        if self._assembler.stopped and finish_reason is None:
            self._finish(self.request_id, "stop", self._channel)
            finish_reason = "stop"
        if finish_reason is not None:
            text += self._assembler.finish()
            # a stop string found in the last token (or in the final flush) still says "stop"
            self.finish_reason = self._assembler.finish_reason(finish_reason)
            finish_reason = self.finish_reason
        return StreamOutput(self.request_id, text, token_ids, finish_reason)

    def _abort(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self._finish(self.request_id, "abort", self._channel)

    async def aclose(self) -> None:
        self._abort()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self._abort()

    def __del__(self) -> None:
        # a `break` out of `async for` drops the last reference here: abort at once, not at GC time
        if self.finish_reason is None and not self._channel.closed:
            self._finish(self.request_id, "abort", self._channel)
