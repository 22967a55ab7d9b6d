"""A front-end process's engine (`asyncllm serve --api-server-count N`): EngineClient has the part of
AsyncLLMEngine's interface that create_app's routes use, so the routes are the same code in both
modes. Prompts are encoded and requests checked here, by the engine's own RequestIntake on this
process's tokenizer (the 400s come from here); generation, detokenization and stop strings run in
the engine process, whose outputs come back over the link (engine_link.py) into RemoteStreams.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable

from asyncllm.chat_template import chat_prompt_ids
from asyncllm.detokenizer import decode_logprobs
from asyncllm.errors import EngineDeadError
from asyncllm.outputs import FinishReason
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.engine_link import error_in, frame, logprobs_in, params_out, read_message
from asyncllm.streams import RequestMetrics, RequestResult, StreamBase, StreamOutput
from asyncllm.structured import StructuredOutput

logger = logging.getLogger("asyncllm.server")


class _Sequence:
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_reason", "reasoning")

    def __init__(self):
        self.token_ids: list[int] = []
        self.logprobs = None
        self.finish_reason = None
        self.stop_reason = None
        self.reasoning: list[str] | None = None


class RemoteStream(StreamBase):
    """What RequestStream is to the routes, for a request that runs in the engine process: its
    items as the engine's stream yielded them. Ending it early (aclose, a cancelled read, dropping
    it) aborts the request there."""

    def __init__(self, client: "EngineClient", request_id: str, prompt_token_ids: list[int], n: int):
        self._client = client
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._sequences = [_Sequence() for _ in range(n)]
        self._num_open = n
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.finish_reason: FinishReason | None = None
        self.prompt_logprobs = None
        self.metrics: RequestMetrics | None = None

    # the link's reader
    def deliver(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # the route's reader
    @property
    def token_ids(self) -> list[int]:
        return self._sequences[0].token_ids

    def result(self, index: int, text: str) -> RequestResult:
        seq = self._sequences[index]
        return RequestResult(self.request_id, text, seq.token_ids, seq.finish_reason, self.metrics,
                             self.prompt_token_ids, index, seq.logprobs, seq.stop_reason, self.prompt_logprobs,
                             None if seq.reasoning is None else "".join(seq.reasoning))

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self) -> StreamOutput:
        while not self._items:
            if self.finish_reason is not None:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except BaseException:
                self._abort()
                raise
            finally:
                self._waiter = None
        item = self._items.popleft()
        if len(item) == 4:  # text and tokens only (engine_link's short item)
            _, text, token_ids, index = item
            self._sequences[index].token_ids.extend(token_ids)
            return StreamOutput(self.request_id, text, token_ids, None, index)
        _, error, text, token_ids, finish_reason, index, logprobs, stop_reason, prompt_logprobs, reasoning, \
            metrics = item
        if error is not None:
            self._end(FinishReason.ABORT)
            raise error
        seq = self._sequences[index]
        seq.token_ids.extend(token_ids)
        logprobs = logprobs_in(logprobs)
        if logprobs is not None:
            decode_logprobs(self._client.tokenizer, logprobs)
            seq.logprobs = (seq.logprobs or []) + logprobs
        if prompt_logprobs is not None:
            self.prompt_logprobs = logprobs_in(prompt_logprobs)
            decode_logprobs(self._client.tokenizer, self.prompt_logprobs[1:])
        if reasoning is not None:
            seq.reasoning = [*(seq.reasoning or ()), reasoning]
        if finish_reason is not None:
            finish_reason = seq.finish_reason = FinishReason(finish_reason)
            seq.stop_reason = stop_reason
            if metrics is not None:
                self.metrics = RequestMetrics(*metrics)
            self._num_open -= 1
            if self._num_open == 0:
                self._end(finish_reason)
        return StreamOutput(self.request_id, text, token_ids, finish_reason, index, logprobs, stop_reason,
                            self.prompt_logprobs if prompt_logprobs is not None else None, reasoning)

    def _end(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self._client._streams.pop(self.request_id, None)

    def _abort(self) -> None:
        if self.finish_reason is None:
            self._end(FinishReason.ABORT)
            self._client.abort(self.request_id)

    def __del__(self) -> None:
        if self.finish_reason is None:
            self._abort()


class RemoteLifecycle:
    """The engine process's LifecycleGate (lifecycle_routes.py) as a front-end's routes use it: its
    state as the engine last sent it, its calls forwarded over the link."""

    def __init__(self, client: "EngineClient"):
        self._client = client
        self.closed_reason: str | None = None
        self.is_sleeping = False

    def update(self, closed_reason: str | None, is_sleeping: bool) -> None:
        self.closed_reason, self.is_sleeping = closed_reason, is_sleeping

    async def sleep(self, level: int) -> None:
        await self._client.call("lifecycle", "sleep", level)

    async def wake(self) -> None:
        await self._client.call("lifecycle", "wake", None)

    async def reload(self) -> None:
        await self._client.call("lifecycle", "reload", None)


class EngineClient:
    """The engine of a front-end process: make_intake(max_seq_len) makes the engine's RequestIntake
    on this process's tokenizer, once the engine is ready and says its max_seq_len; path: the
    engine's socket. on_lost is called if the engine process closes the link (it has died or is
    stopping)."""

    def __init__(self, path: str, make_intake: Callable[[int], object],
                 parse_special_tokens_in_chat_content: bool = False, on_lost: Callable[[], None] | None = None):
        self._path = path
        self._make_intake = make_intake
        self._intake = None
        self._parse_special = parse_special_tokens_in_chat_content
        self.on_lost = on_lost
        self._streams: dict[str, RemoteStream] = {}
        self._calls: dict[str, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._stats: dict = {}
        self._dead: str | None = None
        self._closed = False
        self.startup_phase: str | None = None  # the engine's, as it sends it while it starts
        self._ready: asyncio.Future | None = None
        self.lifecycle = RemoteLifecycle(self)

    # ---- lifecycle (the app's lifespan) ----
    @property
    def started(self) -> bool:
        return self._writer is not None

    async def start(self) -> None:
        """Connect, and return once the engine is ready (the lifespan runs it in the background:
        /health reads startup_phase meanwhile); EngineDeadError if the link closes first."""
        reader, self._writer = await asyncio.open_unix_connection(self._path)
        self._ready = asyncio.get_running_loop().create_future()
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))
        await self._ready

    async def shutdown(self, drain: bool = False) -> None:
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            await self._dispatch(reader)
        except Exception as e:  # noqa: BLE001 - a message it cannot read: the link is unusable
            self._lost(f"the link to the engine process failed: {e!r}")
        else:
            self._lost("the link to the engine process was closed")

    async def _dispatch(self, reader: asyncio.StreamReader) -> None:
        while (message := await read_message(reader)) is not None:
            kind = message[0]
            if kind == "out":
                streams = self._streams
                for item in message[1]:
                    stream = streams.get(item[0])
                    if stream is not None:
                        if len(item) > 4 and item[1] is not None:
                            item[1] = error_in(item[1])
                        stream.deliver(item)
            elif kind == "stats":
                self._stats = message[1]
            elif kind == "starting":
                self.startup_phase = message[1]
            elif kind == "ready":
                self._intake = self._make_intake(message[1])
                self._stats, self.startup_phase = message[2], None
                if not self._ready.done():  # (a start() cancelled by a shutdown)
                    self._ready.set_result(None)
            elif kind == "reply":
                future = self._calls.pop(message[1], None)
                if future is not None and not future.done():
                    value, error = message[2:]
                    future.set_result((value, None if error is None else error_in(error)))
            elif kind == "lifecycle":
                self.lifecycle.update(*message[1:])
            elif kind == "dead":
                self._dead = message[1]

    def _lost(self, reason: str) -> None:
        self._dead = self._dead or reason
        error = EngineDeadError(f"the engine is not available: {self._dead}")
        for stream in list(self._streams.values()):
            stream.deliver((stream.request_id, error) + (None,) * 9)
        for future in self._calls.values():
            if not future.done():
                future.set_result((None, error))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        if not self._closed and self.on_lost is not None:
            logger.error("asyncllm front-end: %s; stopping", self._dead)
            self.on_lost()

    def _send(self, message: tuple) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame(message))

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has failed: {self._dead}")
        if self._intake is None:
            raise RuntimeError("the engine client is not started")

    def stats(self) -> dict:
        """The engine's stats as it last sent them (every engine_host.STATS_INTERVAL_S)."""
        return dict(self._stats)

    # ---- requests: checked here, run there ----
    @property
    def tokenizer(self):
        return self._intake.tokenizer

    @property
    def max_seq_len(self) -> int:
        return self._intake.max_seq_len

    @property
    def max_prompt_chars(self) -> int:
        return self._intake.max_prompt_chars

    @property
    def chat_template(self) -> str | None:
        return getattr(self._intake.tokenizer, "chat_template", None)

    def encode(self, prompt, argument: str = "prompt") -> list[int]:
        self.check_alive()
        return self._intake.encode_prompt(prompt, argument)

    def apply_chat_template(self, messages, **chat_template_kwargs) -> list[int]:
        return chat_prompt_ids(self._intake, messages, chat_template_kwargs, self._parse_special)

    async def compile_structured_output(self, structured_output) -> None:
        """Compiled here, for the 400 of a grammar that does not compile; the engine compiles its own."""
        self.check_alive()
        await self._intake.grammar_compiler.compile_async(StructuredOutput.coerce(structured_output))

    def stream(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None, *,
               request_id: str) -> RemoteStream:
        self.check_alive()  # the engine's checks of stream(), here: the 400s come from the front-end
        prompt_token_ids = self._intake.encode_prompt(prompt_token_ids)
        sampling_params = sampling_params or SamplingParams()
        # the checked snapshot keeps this process's compiled grammar: the caller's params go (the
        # engine checks and compiles its own)
        n = self._intake.check_request(prompt_token_ids, sampling_params).n
        stream = self._streams[request_id] = RemoteStream(self, request_id, prompt_token_ids, n)
        self._send(("submit", request_id, prompt_token_ids, params_out(sampling_params)))
        return stream

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def embed(self, prompts, **options) -> list[list[float]]:
        self.check_alive()
        return await self.call("embed", prompts, options)

    async def call(self, kind: str, *arguments):
        """The engine process's reply to [kind, call_id, *arguments] (its error raised here); a call
        given up is cancelled there."""
        call_id = f"{kind}-{next(self._call_ids)}"
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send((kind, call_id, *arguments))
        try:
            value, error = await future
        except BaseException:
            self._calls.pop(call_id, None)
            self._send(("cancel", call_id))
            raise
        if error is not None:
            raise error
        return value
