"""AsyncLLMEngine: token streaming into asyncio and trio apps.

One dedicated thread owns the engine core (scheduler, block manager, model runner) and runs the
step loop while there is work, sleeping on a condition variable when there is none. The event loop
side talks to it through a thread-safe inbox of commands (add, finish) drained at every step
boundary. Results go back through one RequestChannel per request (streams.py), read by the
consumer's RequestStream; detokenization and stop strings run there, so the engine thread's step
stays free of per-request text work.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import anyio

from asyncllm import settings
from asyncllm.arguments import check_bool, check_request_id, check_seconds, check_str
from asyncllm.chat_template import chat_prompt_ids
from asyncllm.engine.core import EngineCore
from asyncllm.engine.options import make_config
from asyncllm.engine.step_budget import STREAMING_TARGET_STEP_MS
from asyncllm.errors import EngineDeadError, QueueFullError, UnsatisfiableConstraintsError
from asyncllm.outputs import FinishReason
from asyncllm.reasoning import text_assembler
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured import StructuredOutput
from asyncllm.streams import LaunchGate, RequestChannel, RequestMetrics, RequestResult, RequestStream, wake

logger = logging.getLogger("asyncllm")


class AsyncLLMEngine:
    """Embeddable async engine. Use as `async with AsyncLLMEngine(model_dir, **config) as engine:`.

    parse_special_tokens_in_chat_content=True: special-token text in chat messages (`<|im_start|>`)
    becomes those tokens, as before; by default it is encoded as text (chat_template.py says why)."""

    def __init__(self, model: str | None = None, *, parse_special_tokens_in_chat_content: bool = False,
                 **config_kwargs):
        self._parse_special_tokens_in_chat_content = check_bool(parse_special_tokens_in_chat_content,
                                                                "parse_special_tokens_in_chat_content")
        # streams first: a bounded step time (target_step_ms=None asks for throughput first, as LLM)
        config_kwargs.setdefault("target_step_ms", STREAMING_TARGET_STEP_MS)
        self.config = make_config(model, config_kwargs)
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._channels: dict[str, RequestChannel] = {}  # engine thread's view
        self._endings: list[tuple[RequestChannel, FinishReason, int | None]] = []  # engine thread: final items not yet sent
        self._thread: threading.Thread | None = None
        self._core: EngineCore | None = None
        self._ready = threading.Event()
        self._stop_requested = False
        self._applying = False  # commands taken from the inbox, not yet reflected in _stats
        self._num_inbox_adds = 0  # requests posted, not yet taken by the engine thread
        self._num_adds_applying = 0  # requests taken from the inbox, not yet in _stats
        self._dead: BaseException | None = None
        self._closed = False
        self._stats: dict = {}
        self.tokenizer = None
        # With overlap: closed from the moment a step's results reach the host until the next step is
        # launched, and streams' reads that find it closed wait for it (LAUNCH_GATE_WAIT_S at most).
        # Torch frees the interpreter lock in every op, so without it a launch hands the lock to the
        # event loop at each op and waits for it to be given back; once more Python wants the lock
        # than there is time in a step, the device would wait on every launch. With it the launch
        # goes first, and a consumer that falls behind reads the tokens of several steps at once.
        # ASYNCLLM_LAUNCH_GATE=0 turns it off (to compare).
        self._launch_gate = LaunchGate()
        self._use_launch_gate = settings.LAUNCH_GATE.read()

    # ---- lifecycle -----------------------------------------------------------------------------
    async def __aenter__(self) -> "AsyncLLMEngine":
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.shutdown(drain=False)

    async def start(self) -> None:
        """Start the engine thread and return once it serves (every concurrent call waits for that), or
        raise EngineDeadError if it failed to start."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asyncllm-engine", daemon=True)
            self._thread.start()
        if not self._ready.is_set():  # a cancelled wait leaves the thread starting; a later start() waits again
            await anyio.to_thread.run_sync(self._ready.wait, abandon_on_cancel=True)
        if self._core is None:  # _run failed before the core existed
            await anyio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)
            raise EngineDeadError(f"the engine failed to start: {self._dead!r}") from self._dead

    async def shutdown(self, drain: bool = False) -> None:
        """Stop the engine thread. drain=True lets in-flight requests finish first; otherwise they
        end with finish_reason "abort". Idempotent. Cancelled (a timeout around it), it still stops
        the engine (a drain cut short aborts what is left), and a later shutdown() waits for the thread."""
        check_bool(drain, "drain")
        self._closed = True  # no new requests from here on
        if self._thread is None:
            return
        try:
            if drain:
                await self._wait_idle(poll_interval=0.005)
        except EngineDeadError:
            pass  # nothing left to drain
        finally:
            with self._cv:
                self._stop_requested = True
                self._cv.notify()
        await anyio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)

    async def wait_idle(self, poll_interval: float = 0.005) -> None:
        """Wait until no request is queued or running and every command has been applied."""
        poll_interval = check_seconds(poll_interval, "poll_interval")
        self._check_alive()
        await self._wait_idle(poll_interval)

    async def _wait_idle(self, poll_interval: float) -> None:
        while True:
            if self._dead is not None:
                raise EngineDeadError(f"the engine has failed: {self._dead!r}") from self._dead
            with self._cv:
                if not self._inbox and not self._applying and self._stats.get("num_waiting", 0) == 0 \
                        and self._stats.get("num_running", 0) == 0:
                    return
            await anyio.sleep(poll_interval)

    # ---- requests ------------------------------------------------------------------------------
    def stream(self, prompt, sampling_params: SamplingParams | None = None, *,
               request_id: str | None = None) -> RequestStream:
        """Submit a request (a string or token ids) and return its token stream."""
        self._check_alive()
        return self._submit(self._core.encode_prompt(prompt), sampling_params, request_id)

    def encode(self, prompt, argument: str = "prompt") -> list[int]:
        """A prompt (text or token ids) as checked token ids, as stream() takes it; text longer than
        max_prompt_chars is refused before it is tokenized. Thread-safe: a server runs it off its loop."""
        check_str(argument, "argument")
        self._check_alive()
        return self._core.encode_prompt(prompt, argument)

    @property
    def max_seq_len(self) -> int:
        """The most tokens a request can hold, prompt and output: max_model_len, or less where the
        KV cache is smaller."""
        self._check_alive()
        return self._core.max_seq_len

    @property
    def max_prompt_chars(self) -> int:
        """No text longer than this fits in max_seq_len tokens."""
        self._check_alive()
        return self._core.max_prompt_chars

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, request_id: str | None = None,
             **chat_template_kwargs) -> RequestStream:
        """Stream an answer to a conversation, formatted by the tokenizer's chat template."""
        self._check_alive()
        if request_id is not None:  # before the rendering it would waste
            check_request_id(request_id)
        return self._submit(self.apply_chat_template(messages, **chat_template_kwargs), sampling_params, request_id,
                            "messages")

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template (the server reads which tool-call format it uses)."""
        self._check_started()
        return getattr(self._core.tokenizer, "chat_template", None)

    def apply_chat_template(self, messages, **chat_template_kwargs) -> list[int]:
        """The conversation's prompt token ids; special-token text in what the caller passes is encoded
        as text unless the engine was made with parse_special_tokens_in_chat_content=True.
        Thread-safe: a server runs it off its loop."""
        self._check_started()
        return chat_prompt_ids(self._core, messages, chat_template_kwargs, self._parse_special_tokens_in_chat_content)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> RequestResult | list[RequestResult]:
        """The whole answer: a RequestResult, or with n > 1 a list of n of them, in index order."""
        self._check_alive()
        # no consumer sees the deltas: decode the text once at the end unless stop strings need it
        stream = self._submit(self._core.encode_prompt(prompt), sampling_params, request_id,
                              incremental_text=False)
        text_parts: dict[int, list[str]] = {}
        async for out in stream:
            text_parts.setdefault(out.index, []).append(out.text)
        results = [stream.result(i, "".join(text_parts.get(i, ()))) for i in range(stream.num_sequences)]
        return results[0] if len(results) == 1 else results

    async def compile_structured_output(self, structured_output: StructuredOutput | dict) -> None:
        """Compile a constraint's grammar ahead of stream(), which then finds it compiled instead of
        compiling it in the caller's thread: here the event loop goes on meanwhile, and cancelling
        this call drops the compile if it has not started. ValueError as stream() would raise it
        (invalid, or past the compile deadline); QueueFullError when too many compiles are queued."""
        self._check_alive()
        await self._core.grammar_compiler.compile_async(StructuredOutput.coerce(structured_output))

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are free before the next step. Unknown or finished ids: no-op."""
        self._post(("finish", check_request_id(request_id), FinishReason.ABORT, None, None))

    def _finish(self, request_id: str, reason: FinishReason, channel: RequestChannel | None = None,
                index: int | None = None) -> None:
        # with its channel, a stream ends only its own request, never another one that has its id;
        # index ends one of its n sequences (a stop string), None all of them
        self._post(("finish", request_id, reason, channel, index))

    def _submit(self, prompt_token_ids: list[int], params: SamplingParams | None, request_id: str | None,
                argument: str = "prompt", incremental_text: bool = True):
        request_id = self._core.new_request_id() if request_id is None else check_request_id(request_id)
        params = self._core.check_request(prompt_token_ids, SamplingParams() if params is None else params, argument)
        limit = self.config.max_queued_requests
        with self._cv:
            # queued: waiting beyond what starts running at once (sequence slots free at the last step)
            stats = self._stats
            free_slots = max(0, self.config.max_num_seqs - stats.get("num_running", 0))
            queued = self._num_inbox_adds + self._num_adds_applying + stats.get("num_waiting", 0) - free_slots
            if limit and queued >= limit:
                raise QueueFullError(f"{limit} requests are already queued (max_queued_requests); retry later")
        # without incremental text and stop strings nobody looks at the tokens before the end
        channel = RequestChannel(request_id, wake_on_finish_only=not incremental_text and not params.stop,
                                 num_sequences=params.n,
                                 launch_gate=self._launch_gate if self._use_launch_gate else None)
        assemblers = [text_assembler(self._core.tokenizer, self._core.reasoning, prompt_token_ids, params,
                                     incremental=incremental_text) for _ in range(params.n)]
        stream = RequestStream(self._finish, channel, assemblers, prompt_token_ids)
        self._post(("add", channel, prompt_token_ids, params))
        return stream

    def _post(self, command) -> None:
        with self._cv:
            if self._dead is None and not self._stop_requested:
                self._inbox.append(command)
                self._num_inbox_adds += command[0] == "add"
                self._cv.notify()
                return
        if command[0] == "add":  # the engine died or stopped since the caller checked: don't leave it waiting
            command[1].put([], None, EngineDeadError("the engine has failed or is shut down"))

    @property
    def started(self) -> bool:
        return self._thread is not None

    def check_alive(self) -> None:
        """Raise EngineDeadError if the engine failed or is shut down (RuntimeError if never started)."""
        self._check_alive()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has failed: {self._dead!r}") from self._dead
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        self._check_started()

    def _check_started(self) -> None:
        if self._core is None:
            raise RuntimeError("the engine is not started: use `async with AsyncLLMEngine(...)` or await start()")

    def stats(self) -> dict:
        with self._cv:
            stats = dict(self._stats)
            stats["num_inbox"] = len(self._inbox)
        if self._core is not None:  # compiles run beside the engine thread: their counters are live
            stats.update(self._core.grammar_stats())
        return stats

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._core = EngineCore(self.config)
            self.tokenizer = self._core.tokenizer
        except BaseException as e:  # noqa: BLE001 - reported to the starter
            self._dead = e
            self._ready.set()
            return
        self._publish_stats()
        self._ready.set()
        core = self._core
        # With overlap a step's events go out after the next step is launched, and the launch gate is
        # closed from the wait's end to the launch (docs/ARCHITECTURE.md, "The overlapped step loop");
        # without overlap events go out at once.
        undelivered = []
        gate = self._launch_gate
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._stop_requested and not core.has_unfinished() \
                            and not undelivered:
                        gate.open()  # idle: no launch to wait for
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
                self._dead = e
                # requests posted but not yet applied: their consumers must hear of it too
                pending = [command[1] for command in self._inbox if command[0] == "add"]
                self._inbox.clear()
                self._num_inbox_adds = 0
            error = EngineDeadError(f"the engine has failed: {e!r}")
            error.__cause__ = e
            self._send_endings()
            for channel in list(self._channels.values()) + pending:
                channel.put([], None, error)
            self._channels.clear()
            self._close_core()
            return
        # orderly stop: whatever is still in flight is aborted
        for request_id in list(self._channels):
            self._end(request_id, FinishReason.ABORT, force=True)
        self._publish_stats()
        self._send_endings()
        self._close_core()

    def _close_core(self) -> None:
        try:
            self._core.drain()  # the step in flight, if any, finishes on the device before we close
        except Exception:  # noqa: BLE001 - its requests are already ended; only its device work was left
            logger.exception("the step in flight failed while the engine stopped")
        try:
            self._core.close()  # tensor-parallel workers end with the engine thread
        except Exception:  # noqa: BLE001 - already shutting down; nothing more to tell anyone
            logger.exception("closing the engine core failed")

    def _apply(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, channel, prompt_token_ids, params = command
            if channel.request_id in self._channels:
                channel.put([], None, ValueError(f"request_id: {channel.request_id!r} is already in use"))
                return
            try:
                seq = self._core.add_checked_request(prompt_token_ids, params, channel.request_id)  # _submit checked
            except (ValueError, TypeError) as e:
                channel.put([], None, e)
                return
            channel.metrics = RequestMetrics(arrival_time=seq.arrival_time, num_prompt_tokens=len(prompt_token_ids))
            self._channels[channel.request_id] = channel
        elif kind == "finish":
            _, request_id, reason, channel, index = command
            if request_id in self._channels and (channel is None or channel is self._channels[request_id]):
                self._end(request_id, reason, index)

    def _end(self, request_id: str, reason: FinishReason, index: int | None = None, force: bool = False) -> None:
        """End a request (index None) or one of its n sequences."""
        seq = self._core.finish_request(request_id, reason, index)
        if seq is None and not force:
            # the core ended it in the step resolved last, whose events are not delivered yet
            # (overlap: they go out after the next launch): they end its channel, with its last
            # tokens and its own finish reason
            return
        channel = self._channels[request_id]
        if seq is None or seq.request_finished:
            del self._channels[request_id]
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
        channels, record = self._channels, self._record
        for event in events:
            seq = event.seq
            channel = channels.get(seq.request_id)
            if channel is None:
                continue
            if event.error is not None:  # the request cannot go on: its stream raises, its other sequences end
                del channels[seq.request_id]
                self._core.finish_request(seq.request_id, FinishReason.ABORT)
                channel.put([], None, UnsatisfiableConstraintsError(event.error))
                continue
            record(channel, seq, now, len(event.new_token_ids))
            if event.request_finished:
                del channels[seq.request_id]
            waiting = channel.put_quietly(event.new_token_ids, event.finish_reason, None, seq.index,
                                          event.logprobs, event.stop_reason, event.prompt_logprobs)
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
        stats = self._core.stats()
        with self._cv:
            self._stats = stats
            self._applying = False
            self._num_adds_applying = 0
