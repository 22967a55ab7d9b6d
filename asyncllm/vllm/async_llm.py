"""vLLM's AsyncLLM (vllm.v1.engine.async_llm): generate() as an async generator of RequestOutput
(cumulative, delta or final only, by SamplingParams.output_kind), an awaitable abort(), and a
synchronous start and shutdown, over asyncllm's AsyncLLMEngine (which streams the tokens)."""
from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Iterable

import anyio

from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.errors import EngineDeadError
from asyncllm.vllm.inputs import EngineArgs, engine_options, prompt_parts, truncated
from asyncllm.vllm.outputs import (CompletionOutput, RequestOutput, completion_output, prompt_token_logprobs,
                                   token_logprobs)
from asyncllm.vllm.sampling_params import RequestOutputKind, SamplingParams


def _run_to_completion(async_fn) -> None:
    """Run async_fn on an event loop of its own, in a helper thread, and wait for it: AsyncLLM's start
    and shutdown are synchronous, as vLLM's, inside an event loop or outside one."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            anyio.run(async_fn)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="asyncllm-vllm-lifecycle")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


class _SequenceSoFar:
    """One sequence's output so far (CUMULATIVE)."""
    __slots__ = ("text", "token_ids", "logprobs", "cumulative_logprob")

    def __init__(self):
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict] | None = None
        self.cumulative_logprob: float | None = None


class AsyncLLM:
    """AsyncLLM(model, **engine_args), or AsyncLLM.from_engine_args(AsyncEngineArgs(model=...)):
    the engine is loaded and started when this returns. Call shutdown() when done."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = AsyncLLMEngine(model, **engine_options(kwargs))
        _run_to_completion(self.engine.start)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True, usage_context=None,
                         stat_loggers=None) -> "AsyncLLM":
        options = {name: value for name, value in vars(engine_args).items() if name != "model"}
        return cls(engine_args.model, **options)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine; requests still running end with finish_reason "abort". Idempotent."""
        _run_to_completion(self.engine.shutdown)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def errored(self) -> bool:
        try:
            self.engine.check_alive()
        except (EngineDeadError, RuntimeError):
            return True
        return False

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        return self.errored

    async def check_health(self) -> None:
        self.engine.check_alive()

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """End requests: each one's generate() gives a last output with finish_reason "abort", and
        its KV blocks are free before the engine's next step. Unknown or finished ids: nothing."""
        for one in (request_id,) if isinstance(request_id, str) else request_id:
            self.engine.abort(one)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       *, lora_request=None, trace_headers=None, priority: int = 0,
                       data_parallel_rank: int | None = None) -> AsyncGenerator[RequestOutput, None]:
        """A request's outputs as they come (only the sequences that changed in each, with n > 1);
        the last has finished=True. Leaving the loop early (break, cancel) aborts the request."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: expected asyncllm.vllm.SamplingParams, got {type(params).__name__}")
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        text, native_prompt = prompt_parts(prompt)
        native = params.to_native(priority)
        if params.truncate_prompt_tokens is not None:
            native_prompt = truncated(self.engine.encode(native_prompt), params.truncate_prompt_tokens,
                                      self.engine.max_seq_len)
        if params.output_kind is RequestOutputKind.FINAL_ONLY:
            yield await self._final_output(text, native_prompt, native, params.detokenize, request_id)
            return
        delta = params.output_kind is RequestOutputKind.DELTA
        sequences = [_SequenceSoFar() for _ in range(native.n)]
        num_finished = 0
        prompt_logprobs = None
        async with self.engine.stream(native_prompt, native, request_id=request_id) as stream:
            async for out in stream:
                seq = sequences[out.index]
                if out.logprobs is not None:
                    seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(e.logprob for e in out.logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs = prompt_token_logprobs(out.prompt_logprobs)
                num_finished += out.finish_reason is not None
                if delta:
                    completion = completion_output(out.index, out.text if params.detokenize else "", out.token_ids,
                                                   out.logprobs, out.finish_reason, out.stop_reason,
                                                   seq.cumulative_logprob)
                else:
                    seq.text += out.text
                    seq.token_ids += out.token_ids
                    if out.logprobs is not None:
                        if seq.logprobs is None:
                            seq.logprobs = []
                        seq.logprobs.extend(token_logprobs(out.logprobs))
                    completion = CompletionOutput(out.index, seq.text if params.detokenize else "",
                                                  list(seq.token_ids), seq.cumulative_logprob,
                                                  None if seq.logprobs is None else list(seq.logprobs),
                                                  out.finish_reason, out.stop_reason)
                metrics = stream.metrics
                yield RequestOutput(stream.request_id, text, stream.prompt_token_ids, prompt_logprobs, [completion],
                                    num_finished == native.n, metrics,
                                    num_cached_tokens=None if metrics is None else metrics.num_cached_tokens)
                if delta:
                    prompt_logprobs = None  # a delta's prompt log-probabilities come once, with the first

    async def _final_output(self, text, native_prompt, native, detokenize: bool, request_id) -> RequestOutput:
        results = await self.engine.generate(native_prompt, native, request_id=request_id)
        results = results if isinstance(results, list) else [results]
        first = results[0]
        return RequestOutput(
            first.request_id, text, first.prompt_token_ids, prompt_token_logprobs(first.prompt_logprobs),
            [completion_output(r.index, r.text if detokenize else "", r.token_ids, r.logprobs, r.finish_reason,
                               r.stop_reason) for r in results],
            True, first.metrics, num_cached_tokens=first.metrics.num_cached_tokens)
