"""AsyncLLMEngine: token streaming into asyncio and trio apps.

The public face: lifecycle (start, shutdown, wait_idle), requests (stream, generate, chat, encode,
abort) and stats. One dedicated thread owns the engine core (scheduler, block manager, model runner)
and runs the step loop (engine_thread.py); a request is checked here, in the caller's thread, then
posted to that thread's inbox. Results go back through one RequestChannel per request (streams.py),
read by the consumer's RequestStream; detokenization and stop strings run there, so the engine
thread's step stays free of per-request text work.
"""
from __future__ import annotations

import anyio

from asyncllm import settings
from asyncllm.arguments import check_bool, check_request_id, check_seconds, check_str
from asyncllm.chat_template import chat_prompt_ids
from asyncllm.engine.core import EngineCore
from asyncllm.engine.options import make_config
from asyncllm.engine.step_budget import STREAMING_TARGET_STEP_MS
from asyncllm.engine_thread import AddRequest, EngineThread, FinishRequest
from asyncllm.errors import EngineDeadError, QueueFullError
from asyncllm.llm import normalize_prompts
from asyncllm.outputs import FinishReason
from asyncllm.pooling_params import PoolingParams
from asyncllm.reasoning import text_assembler
from asyncllm.sampling_params import SamplingParams
from asyncllm.startup import CONFIG, StartupTimings
from asyncllm.structured import StructuredOutput
from asyncllm.streams import LaunchGate, RequestChannel, RequestResult, RequestStream


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
        self._startup = StartupTimings()  # the engine thread's EngineCore goes on with it
        with self._startup.phase(CONFIG):
            self.config = make_config(model, config_kwargs)
        self._closed = False  # shut down: no new requests
        # With overlap: closed by the engine thread from the moment a step's results reach the host
        # until the next step is launched; streams' reads that find it closed wait for it
        # (LAUNCH_GATE_WAIT_S at most), so the launch goes first (engine_thread.py says why).
        # ASYNCLLM_LAUNCH_GATE=0: the channels get none (to compare).
        self._launch_gate = LaunchGate()
        self._use_launch_gate = settings.LAUNCH_GATE.read()
        self._engine_thread = EngineThread(self.config, self._launch_gate, self._startup)

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
        engine_thread = self._engine_thread
        engine_thread.start()
        if not engine_thread.ready.is_set():  # a cancelled wait leaves the thread starting; a later start() waits again
            await anyio.to_thread.run_sync(engine_thread.ready.wait, abandon_on_cancel=True)
        if engine_thread.core is None:  # it failed before the core existed
            await anyio.to_thread.run_sync(engine_thread.thread.join, abandon_on_cancel=True)
            raise EngineDeadError(f"the engine failed to start: {engine_thread.dead!r}") from engine_thread.dead

    async def shutdown(self, drain: bool = False) -> None:
        """Stop the engine thread. drain=True lets in-flight requests finish first; otherwise they
        end with finish_reason "abort". Idempotent. Cancelled (a timeout around it), it still stops
        the engine (a drain cut short aborts what is left), and a later shutdown() waits for the thread."""
        check_bool(drain, "drain")
        self._closed = True  # no new requests from here on
        engine_thread = self._engine_thread
        if engine_thread.thread is None:
            return
        try:
            if drain:
                await self._wait_idle(poll_interval=0.005)
        except EngineDeadError:
            pass  # nothing left to drain
        finally:
            engine_thread.stop()
        await anyio.to_thread.run_sync(engine_thread.thread.join, abandon_on_cancel=True)

    async def wait_idle(self, poll_interval: float = 0.005) -> None:
        """Wait until no request is queued or running and every command has been applied."""
        poll_interval = check_seconds(poll_interval, "poll_interval")
        self._check_alive()
        await self._wait_idle(poll_interval)

    async def _wait_idle(self, poll_interval: float) -> None:
        engine_thread = self._engine_thread
        while True:
            if engine_thread.dead is not None:
                raise EngineDeadError(f"the engine has failed: {engine_thread.dead!r}") from engine_thread.dead
            if engine_thread.is_idle():
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

    async def embed(self, prompts, *, pooling: str = "last", normalize: bool = True,
                    dimensions: int | None = None) -> list[list[float]]:
        """One embedding per prompt (a string or token ids, or a list of them), in order: the final-norm
        hidden state of the last prompt token (pooling="last", as Qwen3-Embedding) or their mean over
        the prompt ("mean"), cut to its first `dimensions` entries if given, L2-normalised unless
        normalize=False (asyncllm.pooling_params.PoolingParams). Each prompt is a request of its own,
        prefilled through the same scheduler as generation and never sampled; text is tokenized on a
        worker thread. Cancelling the call aborts the prompts not yet embedded. A batch is refused
        (QueueFullError) only when the queue is already full, as one request would be."""
        self._check_alive()
        params = PoolingParams(pooling, normalize, dimensions)
        prompts = normalize_prompts(prompts)
        core = self._core

        def checked_token_ids() -> list[list[int]]:
            token_lists = [core.encode_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
            for i, ids in enumerate(token_lists):  # all checked before any is queued
                core.check_embedding_request(ids, params, f"prompts[{i}]")
            return token_lists
        token_lists = await anyio.to_thread.run_sync(checked_token_ids)
        self._check_alive()
        limit = self.config.max_queued_requests
        if limit and self._engine_thread.num_queued() >= limit:
            raise QueueFullError(f"{limit} requests are already queued (max_queued_requests); retry later")
        # each channel wakes its reader once, when its vector (or an error) is in
        channels = [RequestChannel(core.new_request_id(), wake_on_finish_only=True) for _ in token_lists]
        for channel, ids in zip(channels, token_lists):
            self._engine_thread.post(AddRequest(channel, ids, params))
        vectors = []
        try:
            for channel in channels:
                (delta,) = await channel.get()
                if delta.embedding is None:  # ended without one: the engine shut down first
                    raise EngineDeadError("the engine was shut down before the embedding was computed")
                vectors.append(delta.embedding.tolist())
        finally:
            for channel in channels[len(vectors):]:
                if not channel.closed:
                    self._finish(channel.request_id, FinishReason.ABORT, channel)
        return vectors

    async def compile_structured_output(self, structured_output: StructuredOutput | dict) -> None:
        """Compile a constraint's grammar ahead of stream(), which then finds it compiled instead of
        compiling it in the caller's thread: here the event loop goes on meanwhile, and cancelling
        this call drops the compile if it has not started. ValueError as stream() would raise it
        (invalid, or past the compile deadline); QueueFullError when too many compiles are queued."""
        self._check_alive()
        await self._core.grammar_compiler.compile_async(StructuredOutput.coerce(structured_output))

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are free before the next step. Unknown or finished ids: no-op."""
        self._engine_thread.post(FinishRequest(check_request_id(request_id), FinishReason.ABORT))

    def _finish(self, request_id: str, reason: FinishReason, channel: RequestChannel | None = None,
                index: int | None = None) -> None:
        # a stream's: with its channel it ends only its own request, never another one that has its
        # id; index ends one of its n sequences (a stop string), None all of them
        self._engine_thread.post(FinishRequest(request_id, reason, channel, index))

    def _submit(self, prompt_token_ids: list[int], params: SamplingParams | None, request_id: str | None,
                argument: str = "prompt", incremental_text: bool = True):
        core = self._core
        request_id = core.new_request_id() if request_id is None else check_request_id(request_id)
        params = core.check_request(prompt_token_ids, SamplingParams() if params is None else params, argument)
        limit = self.config.max_queued_requests
        if limit and self._engine_thread.num_queued() >= limit:
            raise QueueFullError(f"{limit} requests are already queued (max_queued_requests); retry later")
        # without incremental text and stop strings nobody looks at the tokens before the end
        channel = RequestChannel(request_id, wake_on_finish_only=not incremental_text and not params.stop,
                                 num_sequences=params.n,
                                 launch_gate=self._launch_gate if self._use_launch_gate else None)
        assemblers = [text_assembler(core.tokenizer, core.reasoning, prompt_token_ids, params,
                                     incremental=incremental_text) for _ in range(params.n)]
        stream = RequestStream(self._finish, channel, assemblers, prompt_token_ids)
        # a timeout counts from here, not from when the engine thread takes the request in
        submitted_at = None if params.timeout is None else core.deadlines.clock()
        self._engine_thread.post(AddRequest(channel, prompt_token_ids, params, submitted_at))
        return stream

    @property
    def started(self) -> bool:
        return self._engine_thread.thread is not None

    @property
    def startup_timings(self) -> dict[str, float]:
        """Each start-up phase's wall time in seconds, in the order they ran (asyncllm/startup.py);
        complete once start() has returned."""
        return dict(self._startup.seconds)

    @property
    def tokenizer(self):
        """The model's tokenizer (None until the engine has started)."""
        core = self._engine_thread.core
        return None if core is None else core.tokenizer

    @property
    def _core(self) -> EngineCore | None:
        """The engine thread's core (None until started). Other threads call its checks (encode_prompt,
        check_request) and read its limits; only the engine thread changes it."""
        return self._engine_thread.core

    def check_alive(self) -> None:
        """Raise EngineDeadError if the engine failed or is shut down (RuntimeError if never started)."""
        self._check_alive()

    def _check_alive(self) -> None:
        dead = self._engine_thread.dead
        if dead is not None:
            raise EngineDeadError(f"the engine has failed: {dead!r}") from dead
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        self._check_started()

    def _check_started(self) -> None:
        if self._engine_thread.core is None:
            raise RuntimeError("the engine is not started: use `async with AsyncLLMEngine(...)` or await start()")

    def stats(self) -> dict:
        stats = self._engine_thread.stats()
        core = self._engine_thread.core
        if core is not None:  # compiles run beside the engine thread: their counters are live
            stats.update(core.grammar_stats())
        return stats
