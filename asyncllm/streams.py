"""One request's way out of the engine thread: RequestChannel (the engine thread's side), the
RequestStream a consumer iterates, and the items and results it yields.

The engine thread appends a step's token ids under a small lock and, if the consumer is waiting,
schedules a wake-up on the event loop of the read that waits (never blocking on it). A consumer
that reads slowly finds several steps' tokens merged in one read; it never holds the engine back.
Detokenization and stop strings run here, in the consumer's read.
"""
from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncllm.detokenizer import TextAssembler, decode_logprobs
from asyncllm.outputs import FinishReason, TokenLogprob
from asyncllm.reasoning import ReasoningDetokenizer


# the longest the event loop waits for one launch of a step (LaunchGate): a launch takes well under a
# millisecond of host time, but one that compiles a kernel takes seconds, and the event loop must not
# stall behind it
LAUNCH_GATE_WAIT_S = 0.002


class LaunchGate:
    """Closed by the engine thread while it launches a step; a stream's read that finds it closed
    waits for it to open, LAUNCH_GATE_WAIT_S at most per closing, for all readers together (after
    one wait has run out, reads pass until the engine closes it again)."""

    __slots__ = ("_open", "_expired")

    def __init__(self):
        self._open = threading.Event()
        self._open.set()
        self._expired = False

    # engine thread
    def close(self) -> None:
        self._expired = False
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    # consumers
    def wait(self) -> None:
        if not self._expired and not self._open.is_set() and not self._open.wait(LAUNCH_GATE_WAIT_S):
            self._expired = True


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() at submission
    queue_time: float | None = None  # submission -> first scheduled
    time_to_first_token: float | None = None
    # gaps between engine steps' tokens, of every sequence (n > 1: each sequence's own gaps, as vLLM's children)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latency: float | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0


@dataclass(slots=True)
class StreamOutput:
    """One item of a stream: what is new since the previous item of the same sequence (index)."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None  # None until the sequence's last item (a str: "stop", "length", "abort")
    index: int = 0  # which of the request's n sequences
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (EOS: None)
    # prompt_logprobs: with the first item of index 0, one entry per prompt token (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # with a reasoning parser (Config.reasoning_parser): the reasoning's new text, apart from text
    # (the answer's); None without one
    reasoning: str | None = None


@dataclass
class RequestResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    metrics: RequestMetrics
    prompt_token_ids: list[int] = field(default_factory=list)
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked: one per prompt token (None for the first)
    reasoning: str | None = None  # with a reasoning parser: the reasoning (text is the answer); None without


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence of a request has new since the consumer's last read."""
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: object = None  # an embedding request's vector (a float32 numpy array), with its end


def _current_loop_waiter() -> tuple[Callable[[Callable[[], None]], None], object]:
    """For a read about to wait: the current event loop's thread-safe, non-blocking 'run this soon',
    and a new waiter of that loop's library: an asyncio future (cheaper than an asyncio.Event, and
    this is paid per token), or a trio.Event."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return loop.call_soon_threadsafe, loop.create_future()
    try:
        import trio
        return trio.lowlevel.current_trio_token().run_sync_soon, trio.Event()
    except (ImportError, RuntimeError):
        raise RuntimeError("asyncllm streams must be used from an asyncio or trio event loop") from None


def _release(waiter) -> None:
    """On the waiter's event loop: let the read that waits on it go on."""
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():  # a read cancelled meanwhile has cancelled its future
            waiter.set_result(None)
    else:
        waiter.set()


def wake(waiters_by_loop: dict[Callable, list]) -> None:
    """Release the waiting consumers: one callback per event loop, however many consumers."""
    for waker, waiters in waiters_by_loop.items():
        def release_all(waiters=waiters) -> None:
            for waiter in waiters:
                _release(waiter)
        try:
            waker(release_all)
        except RuntimeError:
            pass  # that event loop is gone; nobody is left to wake


class RequestChannel:
    """Hands one request's tokens from the engine thread to its consumer.

    The wake-up goes to the event loop of the read that waits, not the one that created the
    stream: a stream made in one loop (or thread) and read in another must still be woken.
    """

    def __init__(self, request_id: str, wake_on_finish_only: bool = False, num_sequences: int = 1,
                 launch_gate: LaunchGate | None = None):
        self.request_id = request_id
        self.launch_gate = launch_gate  # the engine's: closed while it launches a step
        # a consumer that only wants the whole answer (generate() without stop strings) is woken
        # once, at the end, not once per step: with hundreds of such requests the per-step wake-ups
        # cost the event loop more than the engine thread's own work
        self.wake_on_finish_only = wake_on_finish_only
        self._lock = threading.Lock()
        self._deltas: dict[int, SequenceDelta] = {}  # by sequence index, not yet read
        self._open = [True] * num_sequences  # sequences that may still get tokens
        self._num_open = num_sequences
        self._error: BaseException | None = None
        self._waiter = None  # the waiting read's event
        self._waiter_waker: Callable | None = None  # the waiting read's event loop
        self.closed = False  # the engine will send nothing more
        self.metrics: RequestMetrics | None = None
        # engine thread's bookkeeping for inter-token gaps: each sequence's last delivery (n > 1: each its own)
        self.last_token_times: list[float | None] = [None] * num_sequences

    # engine thread
    def put(self, token_ids: list[int], finish_reason: FinishReason | None, error: BaseException | None = None,
            index: int | None = None, logprobs: list[TokenLogprob] | None = None, stop_reason: int | None = None,
            prompt_logprobs: list | None = None) -> None:
        waiting = self.put_quietly(token_ids, finish_reason, error, index, logprobs, stop_reason, prompt_logprobs)
        if waiting is not None:
            waker, waiter = waiting
            wake({waker: [waiter]})

    def put_quietly(self, token_ids: list[int], finish_reason: FinishReason | None, error: BaseException | None = None,
                    index: int | None = None, logprobs: list[TokenLogprob] | None = None,
                    stop_reason: int | None = None, prompt_logprobs: list | None = None,
                    embedding=None) -> tuple[Callable, object] | None:
        """Hand over one sequence's tokens (index None: an ending for every sequence still open);
        returns (its loop's waker, waiter) if the consumer is waiting (the caller wakes it).
        Called per token of every stream: kept to a few dictionary and list operations."""
        with self._lock:
            if self.closed:
                return None
            if error is not None:
                self._error = error
                self.closed = True
            else:
                for i in range(len(self._open)) if index is None else (index,):
                    if not self._open[i]:
                        continue
                    delta = self._deltas.get(i)
                    if delta is None:
                        delta = self._deltas[i] = SequenceDelta(i, list(token_ids))
                    else:
                        delta.token_ids.extend(token_ids)
                    if logprobs is not None:
                        if delta.logprobs is None:
                            delta.logprobs = []
                        delta.logprobs.extend(logprobs)  # a consumer behind by many steps: no quadratic copying
                    if prompt_logprobs is not None:
                        delta.prompt_logprobs = prompt_logprobs
                    if embedding is not None:
                        delta.embedding = embedding
                    if finish_reason is not None:
                        delta.finish_reason, delta.stop_reason = finish_reason, stop_reason
                        self._open[i] = False
                        self._num_open -= 1
                if self._num_open == 0:
                    self.closed = True
                elif self.wake_on_finish_only:
                    return None
            waiter = self._waiter
            if waiter is None:
                return None
            self._waiter = None
        return self._waiter_waker, waiter

    # consumer
    async def get(self) -> list[SequenceDelta]:
        """What is new, by sequence index; [] once the channel is closed and everything was read."""
        while True:
            with self._lock:
                if self._error is not None:
                    raise self._error
                if self._deltas or self.closed:
                    deltas, self._deltas = self._deltas, {}
                    return list(deltas.values()) if len(deltas) < 2 else [deltas[i] for i in sorted(deltas)]
                self._waiter_waker, waiter = _current_loop_waiter()
                self._waiter = waiter
            await (waiter if isinstance(waiter, asyncio.Future) else waiter.wait())


class _SequenceState:
    """The consumer's side of one of a request's sequences."""
    __slots__ = ("assembler", "token_ids", "logprobs", "finish_reason", "stop_reason", "reasoning")

    def __init__(self, assembler: TextAssembler):
        self.assembler = assembler
        detokenizer = assembler.detokenizer  # with a reasoning parser, it keeps the reasoning apart
        self.reasoning = detokenizer if isinstance(detokenizer, ReasoningDetokenizer) else None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None


class StreamBase:
    """What a request's streams share (RequestStream here, the API front-ends' RemoteStream): the
    counts over its sequences (self._sequences, each with its token_ids), and the request ended
    (self._abort()) when the stream is left early: aclose() or an `async with` block's end.
    __del__ (a dropped stream) is each subclass's own."""

    _sequences: list

    def _abort(self) -> None:
        raise NotImplementedError

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated so far, all sequences together."""
        return sum(len(seq.token_ids) for seq in self._sequences)

    async def aclose(self) -> None:
        self._abort()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        self._abort()


class RequestStream(StreamBase):
    """The async iterator returned by AsyncLLMEngine.stream().

    Ending it early in any way (cancelling the task that reads it, a timeout, break, aclose(), or
    dropping it) aborts the request (all of its n sequences), and the engine frees its KV blocks
    before its next step. With n > 1 the items of the sequences interleave, each tagged with its index.
    A stream has one reader at a time: a read while another task's read waits raises RuntimeError
    (the stream goes on for the first reader).
    """

    def __init__(self, finish: Callable[..., None], channel: RequestChannel,
                 assemblers: list[TextAssembler], prompt_token_ids: list[int]):
        self._finish = finish  # the engine's: end the request or one sequence (FinishReason.STOP or ABORT)
        self._channel = channel
        self._sequences = [_SequenceState(assembler) for assembler in assemblers]
        self._num_open = len(assemblers)
        self._ready: collections.deque[StreamOutput] = collections.deque()
        self.request_id = channel.request_id
        self.prompt_token_ids = prompt_token_ids
        self.finish_reason: FinishReason | None = None  # set once every sequence has finished
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._reading = False  # a read waits for the channel (it has one waiter's slot)

    @property
    def token_ids(self) -> list[int]:
        """The first sequence's tokens so far (the only one unless n > 1)."""
        return self._sequences[0].token_ids

    @property
    def text(self) -> str:
        assembler = self._sequences[0].assembler
        return assembler.text[:assembler.num_released]

    def result(self, index: int, text: str) -> RequestResult:
        """Sequence index's result, once it has finished (text: its whole text)."""
        seq = self._sequences[index]
        return RequestResult(self.request_id, text, seq.token_ids, seq.finish_reason, self.metrics,
                             self.prompt_token_ids, index, seq.logprobs, seq.stop_reason, self.prompt_logprobs,
                             None if seq.reasoning is None else seq.reasoning.text)

    @property
    def metrics(self) -> RequestMetrics | None:
        return self._channel.metrics

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamOutput:
        while not self._ready:
            if self.finish_reason is not None:
                raise StopAsyncIteration
            if self._reading:
                raise RuntimeError(f"stream {self.request_id!r} is already being read by another task; a stream "
                                   "has one reader (share its items from that task instead)")
            self._reading = True
            try:
                deltas = await self._channel.get()
            except BaseException:
                self._abort()
                raise
            finally:
                self._reading = False
            gate = self._channel.launch_gate
            if gate is not None:
                gate.wait()  # if the engine is launching a step, it goes first
            if not deltas:  # closed with nothing left: cannot happen while a sequence is open
                self.finish_reason = self.finish_reason or FinishReason.ABORT
            for delta in deltas:
                out = self._take(delta)
                if out is not None:
                    self._ready.append(out)
        return self._ready.popleft()

    def _take(self, delta: SequenceDelta) -> StreamOutput | None:
        seq = self._sequences[delta.index]
        if seq.finish_reason is not None:
            return None  # after a stop string the consumer found: the engine's late tokens and its ending
        token_ids, finish_reason, assembler, logprobs = delta.token_ids, delta.finish_reason, seq.assembler, \
            delta.logprobs
        text, taken = assembler.add_counted(token_ids)
        if taken < len(token_ids):  # a stop string ended before the last: the rest is not output, nor counted
            token_ids = token_ids[:taken]
            logprobs = None if logprobs is None else logprobs[:taken]
        seq.token_ids.extend(token_ids)
        if logprobs is not None:
            decode_logprobs(assembler.tokenizer, logprobs)
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.extend(logprobs)
        if delta.prompt_logprobs is not None:
            decode_logprobs(assembler.tokenizer, delta.prompt_logprobs[1:])
            self.prompt_logprobs = delta.prompt_logprobs
        if assembler.stopped and finish_reason is None:
            self._finish(self.request_id, FinishReason.STOP, self._channel, delta.index)
            finish_reason = FinishReason.STOP
        if finish_reason is not None:
            text += assembler.finish()
            # a stop string found in the last token (or in the final flush) still says "stop"
            seq.finish_reason = assembler.finish_reason(finish_reason)
            seq.stop_reason = assembler.stop_string if assembler.stopped else delta.stop_reason
            finish_reason = seq.finish_reason
            self._num_open -= 1
            if self._num_open == 0:
                self.finish_reason = finish_reason
        reasoning = None if seq.reasoning is None else seq.reasoning.take()  # after the finish's flush
        return StreamOutput(self.request_id, text, token_ids, finish_reason, delta.index, logprobs,
                            seq.stop_reason, delta.prompt_logprobs, reasoning)

    def _abort(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = FinishReason.ABORT
            self._finish(self.request_id, FinishReason.ABORT, self._channel)

    def __del__(self) -> None:
        # a `break` out of `async for` drops the last reference here: abort at once, not at GC time
        if self.finish_reason is None and not self._channel.closed:
            self._finish(self.request_id, FinishReason.ABORT, self._channel)
