"""The engine thread behind an AsyncLLMEngine: the one thread that owns its EngineCore.

It runs the step loop while there is work and sleeps on a condition variable when there is none.
The inbox of commands (AddRequest, FinishRequest), applied between steps, is the only way in; each
request's RequestChannel (streams.py) is the only way out. With overlap a step's events go out once
the next step is launched, and the launch gate is closed from the moment a step's results are on
the host until that launch (docs/ARCHITECTURE.md, "The overlapped step loop"): torch frees the
interpreter lock in every op, so without it a launch hands the lock to the event loop at each op and
waits for it back, and once the consumers' Python wants more of the interpreter than a step's
device time, the device would wait on every launch.

A new command is a slotted dataclass here, a branch of `_apply`, and where the caller posts it.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncllm.config import Config
from asyncllm.engine.core import EngineCore
from asyncllm.errors import EngineDeadError, RequestTimeoutError, UnsatisfiableConstraintsError
from asyncllm.outputs import FinishReason
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import SamplingParams
from asyncllm.startup import StartupTimings
from asyncllm.streams import LaunchGate, RequestChannel, RequestMetrics, wake

logger = logging.getLogger("asyncllm")


# ---- inbox commands ----------------------------------------------------------------------------------
@dataclass(slots=True)
class AddRequest:
    """Queue a request; its outputs go to channel (whose request_id it has)."""
    channel: RequestChannel
    prompt_token_ids: list[int]
    # what EngineCore.check_request returned for it: checked, its own snapshot (an embedding request:
    # check_embedding_request's PoolingParams)
    params: SamplingParams | PoolingParams
    submitted_at: float | None = None  # on the core's deadline clock: its timeout counts from then (None: when applied)


@dataclass(slots=True)
class FinishRequest:
    """End a request now: an abort, or a stop string its consumer found."""
    request_id: str
    reason: FinishReason
    # given, only the request of this channel ends (a stream's own), never a later one with its id
    channel: RequestChannel | None = None
    index: int | None = None  # one of its n sequences; None: all of them


InboxCommand = AddRequest | FinishRequest


class EngineThread:
    """The engine thread, its inbox, its requests' channels and its EngineCore (made on the thread).

    The caller's side (any thread): start, post, stop, is_idle, num_queued, stats. The rest runs on
    the engine thread."""

    def __init__(self, config: Config, launch_gate: LaunchGate, startup: StartupTimings):
        self.config = config
        self.startup = startup  # the core's start-up phases are timed into it
        self.launch_gate = launch_gate  # closed while the loop launches a step (with overlap)
        self.core: EngineCore | None = None  # made by the thread; None until then, or if that failed
        self.thread: threading.Thread | None = None
        self.ready = threading.Event()  # set once the core is made, or failed to be
        self.dead: BaseException | None = None  # what killed the thread (start-up or a step)
        self.channels: dict[str, RequestChannel] = {}  # the engine thread's view: requests it serves
        self._cv = threading.Condition()
        self._inbox: collections.deque[InboxCommand] = collections.deque()
        self._endings: list[tuple[RequestChannel, FinishReason, int | None]] = []  # final items not yet sent
        self._stop_requested = False
        self._applying = False  # commands taken from the inbox, not yet reflected in _stats
        self._num_inbox_adds = 0  # requests posted, not yet taken by the engine thread
        self._num_adds_applying = 0  # requests taken from the inbox, not yet in _stats
        self._stats: dict = {}

    # ---- the caller's side ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread, once; `ready` is set when it serves or has failed to start."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="asyncllm-engine", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        """Ask the thread to stop after its current step; what is still in flight is aborted."""
        with self._cv:
            self._stop_requested = True
            self._cv.notify()

    def post(self, command: InboxCommand) -> None:
        """Hand a command to the engine thread (applied before its next step)."""
        with self._cv:
            if self.dead is None and not self._stop_requested:
                self._inbox.append(command)
                self._num_inbox_adds += isinstance(command, AddRequest)
                self._cv.notify()
                return
        if isinstance(command, AddRequest):  # died or stopped since the caller checked: don't leave it waiting
            command.channel.put([], None, EngineDeadError("the engine has failed or is shut down"))

    def is_idle(self) -> bool:
        """No request queued or running, and every command applied."""
        with self._cv:
            return not self._inbox and not self._applying and self._stats.get("num_waiting", 0) == 0 \
                and self._stats.get("num_running", 0) == 0

    def num_queued(self) -> int:
        """Requests waiting beyond what starts running at once (sequence slots free at the last step)."""
        with self._cv:
            stats = self._stats
            free_slots = max(0, self.config.max_num_seqs - stats.get("num_running", 0))
            return self._num_inbox_adds + self._num_adds_applying + stats.get("num_waiting", 0) - free_slots

    def stats(self) -> dict:
        """The core's stats as of the last step, and the commands not yet taken."""
        with self._cv:
            stats = dict(self._stats)
            stats["num_inbox"] = len(self._inbox)
        return stats

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.core = EngineCore(self.config, startup=self.startup)
        except BaseException as e:  # noqa: BLE001 - reported to the starter
            self.dead = e
            self.ready.set()
            return
        self._publish_stats()
        self.ready.set()
        core = self.core
        # With overlap a step's events go out after the next step is launched, and the launch gate is
        # closed from the wait's end to the launch; without overlap events go out at once.
        undelivered = []
        gate = self.launch_gate
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._stop_requested and not core.has_unfinished() \
                            and not undelivered:
                        # idle: no launch to wait for, and no live request, so no deadline to wake
                        # for (they are checked at each launch: EngineCore.end_expired_requests)
                        gate.open()
                        self._cv.wait()
                    commands = list(self._inbox)
                    self._inbox.clear()
                    self._applying = bool(commands)
                    self._num_adds_applying, self._num_inbox_adds = self._num_inbox_adds, 0
                    stopping = self._stop_requested
                for command in commands:
                    self._apply(command)
                if commands:
                    self._publish_stats()  # so wait_idle sees the applied commands before the step ends
                    self._send_endings()
                if not stopping and core.has_unfinished():
                    core.launch_step()
                gate.open()
                if undelivered:
                    # stats first: a consumer that has just read its last item sees its blocks free
                    self._publish_stats()
                    self._deliver(undelivered)
                    undelivered = []
                if stopping:
                    break
                if core.overlap:
                    core.wait_step()
                    gate.close()
                    undelivered = core.resolve_step()
                else:
                    events = core.resolve_step()
                    self._publish_stats()
                    self._deliver(events)
        except BaseException as e:  # noqa: BLE001 - every consumer must hear of it
            gate.open()
            logger.exception("engine step failed; the engine is dead")
            with self._cv:
                self.dead = e
                # requests posted but not yet applied: their consumers must hear of it too
                pending = [command.channel for command in self._inbox if isinstance(command, AddRequest)]
                self._inbox.clear()
                self._num_inbox_adds = 0
            error = EngineDeadError(f"the engine has failed: {e!r}")
            error.__cause__ = e
            self._send_endings()
            for channel in list(self.channels.values()) + pending:
                channel.put([], None, error)
            self.channels.clear()
            self._close_core()
            return
        # orderly stop: whatever is still in flight is aborted
        for request_id in list(self.channels):
            self._end(request_id, FinishReason.ABORT, force=True)
        self._publish_stats()
        self._send_endings()
        self._close_core()

    def _close_core(self) -> None:
        try:
            self.core.drain()  # the step in flight, if any, finishes on the device before we close
        except Exception:  # noqa: BLE001 - its requests are already ended; only its device work was left
            logger.exception("the step in flight failed while the engine stopped")
        try:
            self.core.close()  # tensor-parallel workers end with the engine thread
        except Exception:  # noqa: BLE001 - already shutting down; nothing more to tell anyone
            logger.exception("closing the engine core failed")

    def _apply(self, command: InboxCommand) -> None:
        if isinstance(command, AddRequest):
            self._add(command)
        elif isinstance(command, FinishRequest):
            if command.request_id in self.channels and \
                    (command.channel is None or command.channel is self.channels[command.request_id]):
                self._end(command.request_id, command.reason, command.index)
        else:
            raise TypeError(f"unknown inbox command {command!r}")  # a bug of this module: fails loudly

    def _add(self, command: AddRequest) -> None:
        channel, prompt_token_ids = command.channel, command.prompt_token_ids
        if channel.request_id in self.channels:
            channel.put([], None, ValueError(f"request_id: {channel.request_id!r} is already in use"))
            return
        try:
            seq = self.core.add_checked_request(prompt_token_ids, command.params, channel.request_id,
                                                command.submitted_at)
        except (ValueError, TypeError) as e:
            channel.put([], None, e)
            return
        channel.metrics = RequestMetrics(arrival_time=seq.arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.channels[channel.request_id] = channel

    def _end(self, request_id: str, reason: FinishReason, index: int | None = None, force: bool = False) -> None:
        """End a request (index None) or one of its n sequences."""
        seq = self.core.finish_request(request_id, reason, index)
        if seq is None and not force:
            # the core ended it in the step resolved last, whose events are not delivered yet
            # (overlap: they go out after the next launch): they end its channel, with its last
            # tokens and its own finish reason
            return
        channel = self.channels[request_id]
        if seq is None or seq.request_finished:
            del self.channels[request_id]
        if seq is not None:
            self._record(channel, seq, time.monotonic(), 0)
        self._endings.append((channel, reason, index))  # sent once the stats show the request gone

    def _send_endings(self) -> None:
        endings, self._endings = self._endings, []
        for channel, reason, index in endings:
            channel.put([], reason, index=index)

    def _deliver(self, events) -> None:
        now = time.monotonic()
        to_wake: dict[Callable, list] = {}
        channels, record = self.channels, self._record
        for event in events:
            seq = event.seq
            channel = channels.get(seq.request_id)
            if channel is None:
                continue
            if event.error is not None:  # the request cannot go on: its stream raises, its other sequences end
                del channels[seq.request_id]
                self.core.finish_request(seq.request_id, FinishReason.ABORT)
                error = RequestTimeoutError if event.finish_reason is FinishReason.TIMEOUT else \
                    UnsatisfiableConstraintsError
                channel.put([], None, error(event.error))
                continue
            record(channel, seq, now, len(event.new_token_ids))
            if event.request_finished:
                del channels[seq.request_id]
            waiting = channel.put_quietly(event.new_token_ids, event.finish_reason, None, seq.index,
                                          event.logprobs, event.stop_reason, event.prompt_logprobs, event.embedding)
            if waiting is not None:
                waker, waiter = waiting
                waiters = to_wake.get(waker)
                if waiters is None:
                    to_wake[waker] = [waiter]
                else:
                    waiters.append(waiter)
        # one cross-thread call per event loop per step, not one per stream
        wake(to_wake)

    @staticmethod
    def _record(channel: RequestChannel, seq, now: float, num_new_tokens: int) -> None:
        metrics = channel.metrics
        if metrics.queue_time is None and seq.first_scheduled_time is not None:
            metrics.queue_time = seq.first_scheduled_time - metrics.arrival_time
            metrics.num_cached_tokens = seq.num_cached_prompt_tokens
        if num_new_tokens:
            last_times, index = channel.last_token_times, seq.index
            last = last_times[index]
            if last is not None:  # n > 1: every sequence's gaps, not only the first's
                metrics.inter_token_latencies.append(now - last)
            elif metrics.time_to_first_token is None:  # n > 1: the first token of any sequence
                metrics.time_to_first_token = now - metrics.arrival_time
            last_times[index] = now
        metrics.num_completion_tokens = seq.num_completion_tokens if seq.group is None else \
            sum(s.num_completion_tokens for s in seq.group)
        metrics.num_preemptions = seq.num_preemptions
        metrics.e2e_latency = now - metrics.arrival_time

    def _publish_stats(self) -> None:
        stats = self.core.stats()
        with self._cv:
            self._stats = stats
            self._applying = False
            self._num_adds_applying = 0
