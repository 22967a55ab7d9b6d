"""The synchronous API, compatible with nano-vllm's LLM.generate."""
from __future__ import annotations

import threading
import time
import weakref

from tqdm.auto import tqdm

from asyncllm.arguments import check_bool
from asyncllm.detokenizer import decode_logprobs
from asyncllm.engine.core import EngineCore
from asyncllm.engine.lifecycle import check_sleep_level, prepare_reload
from asyncllm.engine.options import make_config
from asyncllm.errors import EngineDeadError, InvalidTypeError, InvalidValueError
from asyncllm.outputs import FinishReason
from asyncllm.pooling_params import PoolingParams
from asyncllm.reasoning import text_assembler
from asyncllm.sampling_params import SamplingParams
from asyncllm.startup import CONFIG, StartupTimings


def normalize_prompts(prompts) -> list:
    # a single prompt (a string or one token-id list) is accepted as a batch of one
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidTypeError("prompts", f"expected a list of strings or token-id lists, got {type(prompts).__name__}")
    if not prompts:
        raise InvalidValueError("prompts", "the list is empty")
    return list(prompts)


def normalize_params(sampling_params, num_prompts: int, params_type: type = SamplingParams,
                     type_name: str = "SamplingParams") -> list:
    """One params_type object per prompt: None (the defaults), one for all, or a list of them."""
    if sampling_params is None:
        return [params_type()] * num_prompts
    if isinstance(sampling_params, params_type):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != num_prompts:
            raise InvalidValueError("sampling_params", f"{len(sampling_params)} given for {num_prompts} prompts")
        for i, p in enumerate(sampling_params):
            if not isinstance(p, params_type):
                raise InvalidTypeError(f"sampling_params[{i}]", f"expected {type_name}, got {type(p).__name__}")
        return list(sampling_params)
    raise InvalidTypeError("sampling_params",
                           f"expected {type_name} or a list of them, got {type(sampling_params).__name__}")


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        startup = StartupTimings()
        with startup.phase(CONFIG):
            config = make_config(model, kwargs)
        self.core = EngineCore(config, startup=startup)
        self.tokenizer = self.core.tokenizer
        # tensor-parallel workers end with the LLM, or at interpreter exit at the latest
        self._finalizer = weakref.finalize(self, self.core.close)
        # one generate() at a time drives the core: another thread's steps would take this call's
        # events, and its own loop would then wait, spinning, for tokens that never come
        self._lock = threading.Lock()

    @property
    def startup_timings(self) -> dict[str, float]:
        """Each start-up phase's wall time in seconds, in the order they ran (asyncllm/startup.py)."""
        return dict(self.core.startup.seconds)

    def close(self) -> None:
        """Release the engine: its worker processes, and every tensor (the device memory goes back)."""
        with self._lock:  # after a generate() running in another thread
            self._finalizer()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise EngineDeadError("the LLM is closed")

    # ---- lifecycle between generate() calls (engine/lifecycle.py; AsyncLLMEngine's say more) ------
    def sleep(self, level: int = 1) -> None:
        """Free the device's memory: level 1 moves the weights to host memory and drops the KV cache,
        level 2 drops the weights too; generate() raises EngineAsleepError until wake()."""
        level = check_sleep_level(level)
        with self._lock:  # after a generate() running in another thread
            self._check_open()
            self.core.sleep(level)

    def wake(self) -> None:
        """Back from sleep(), with start-up's decisions; nothing while awake."""
        with self._lock:
            self._check_open()
            self.core.wake()

    def reload(self, model, *, revision: str | None = None) -> None:
        """Serve another checkpoint of the same model structure: weights loaded in place, its tokenizer."""
        self._check_open()
        checkpoint = prepare_reload(self.core.config, model, revision)
        with self._lock:
            self._check_open()
            try:
                self.core.reload(checkpoint)
            except EngineDeadError:  # neither checkpoint's weights could be loaded: nothing left to serve
                self._finalizer()
                raise
            self.tokenizer = self.core.tokenizer

    @property
    def is_sleeping(self) -> bool:
        return self._finalizer.alive and self.core.sleep_level is not None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict | list[dict]]:
        """One dict per prompt ({"text", "token_ids", "finish_reason", "index", "stop_reason",
        "logprobs"}, and "reasoning" with a reasoning parser: then "text" is the answer); a prompt whose
        params have n > 1 gets a list of n such dicts, in index order. Thread-safe: calls from several
        threads run one after another."""
        check_bool(use_tqdm, "use_tqdm")
        with self._lock:
            self._check_open()
            self.core.check_awake()
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[dict | list[dict]]:
        prompts = normalize_prompts(prompts)
        params = normalize_params(sampling_params, len(prompts))
        token_lists = [self.core.encode_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        # all checked before any is queued; each request keeps its checked snapshot
        params = [self.core.check_request(ids, p, f"prompts[{i}]")
                  for i, (ids, p) in enumerate(zip(token_lists, params))]
        leaders = [self.core.add_checked_request(ids, p) for ids, p in zip(token_lists, params)]
        seqs = [seq for leader in leaders for seq in (leader.group or [leader])]
        # per sequence: (request id, index) -> its text assembler (stop strings, reasoning) and log-probs
        reasoning = self.core.reasoning
        assemblers = {(s.request_id, s.index): text_assembler(self.tokenizer, reasoning, s.token_ids, s.params,
                                                              incremental=bool(s.params.stop))
                      for s in seqs if s.params.stop or reasoning is not None}
        logprobs = {(s.request_id, s.index): [] for s in seqs if s.params.logprobs is not None}
        stop_reasons = {}
        pending = {s.request_id for s in leaders}
        bar = tqdm(total=len(leaders), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while pending:
                start = time.perf_counter()
                events = self.core.step()
                elapsed = time.perf_counter() - start
                for event in events:
                    seq = event.seq
                    key = (seq.request_id, seq.index)
                    assembler = assemblers.get(key)
                    finish = event.finish_reason
                    new_token_ids, event_logprobs = event.new_token_ids, event.logprobs
                    if assembler is not None:
                        _, taken = assembler.add_counted(new_token_ids)
                        if taken < len(new_token_ids):  # a stop string ended before the event's last token
                            # (several tokens a step: speculative decoding): the rest is no output
                            del seq.token_ids[len(seq.token_ids) - len(new_token_ids) + taken:]
                            event_logprobs = None if event_logprobs is None else event_logprobs[:taken]
                        if assembler.stopped and finish is None:
                            self.core.finish_request(seq.request_id, FinishReason.STOP, seq.index)
                            finish = FinishReason.STOP
                    if event_logprobs is not None:
                        logprobs[key].extend(event_logprobs)
                    if finish is not None:
                        stop_reasons[key] = event.stop_reason
                    if seq.request_finished and seq.request_id in pending:
                        pending.discard(seq.request_id)
                        bar.update(1)
                if use_tqdm and self.core.last_step is not None:
                    num_prefill, num_decode = self.core.last_step
                    rate = (num_prefill if num_prefill else num_decode) / max(elapsed, 1e-9)
                    bar.set_postfix_str(f"{'Prefill' if num_prefill else 'Decode'}: {rate:.0f} tok/s")
            self.core.drain()  # a step still in flight holds only finished requests' extra rows
        finally:
            for request_id in pending:
                self.core.finish_request(request_id)
            bar.close()
        outputs = []
        for leader in leaders:
            results = [self._output(seq, assemblers, logprobs, stop_reasons) for seq in leader.group or [leader]]
            outputs.append(results[0] if len(results) == 1 else results)
        return outputs

    def embed(self, prompts, *, pooling: str = "last", normalize: bool = True,
              dimensions: int | None = None) -> list[list[float]]:
        """One embedding per prompt (a string or token ids, or a list of them), in order: the final-norm
        hidden state of the last prompt token (pooling="last") or their mean over the prompt ("mean"),
        cut to its first `dimensions` entries if given, and L2-normalised unless normalize=False
        (asyncllm.pooling_params.PoolingParams). Thread-safe as generate() is."""
        params = PoolingParams(pooling, normalize, dimensions)
        with self._lock:
            self._check_open()
            prompts = normalize_prompts(prompts)
            token_lists = [self.core.encode_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
            for i, ids in enumerate(token_lists):  # all checked before any is queued
                self.core.check_embedding_request(ids, params, f"prompts[{i}]")
            seqs = [self.core.add_checked_request(ids, params) for ids in token_lists]
            vectors = {}
            try:
                while len(vectors) < len(seqs):
                    vectors.update((event.seq.request_id, event.embedding) for event in self.core.step()
                                   if event.embedding is not None)
                self.core.drain()
            finally:
                for seq in seqs:
                    if seq.request_id not in vectors:
                        self.core.finish_request(seq.request_id)
        return [vectors[seq.request_id].tolist() for seq in seqs]

    def _output(self, seq, assemblers: dict, logprobs: dict, stop_reasons: dict) -> dict:
        """One sequence's result: nano-vllm's text and token_ids, and what asyncllm adds."""
        key = (seq.request_id, seq.index)
        assembler = assemblers.get(key)
        finish_reason = seq.finish_reason
        stop_reason = stop_reasons.get(key)
        if assembler is not None:
            assembler.finish()
            text = assembler.text
            finish_reason = assembler.finish_reason(finish_reason)
            if assembler.stopped:
                stop_reason = assembler.stop_string
        else:
            text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        token_logprobs = logprobs.get(key)
        if token_logprobs is not None:
            decode_logprobs(self.tokenizer, token_logprobs)
        output = {"text": text, "token_ids": seq.completion_token_ids, "finish_reason": finish_reason,
                  "index": seq.index, "stop_reason": stop_reason, "logprobs": token_logprobs}
        if self.core.reasoning is not None:
            output["reasoning"] = assembler.detokenizer.text
        if seq.prompt_logprobs is not None:
            decode_logprobs(self.tokenizer, seq.prompt_logprobs[1:])
            output["prompt_logprobs"] = seq.prompt_logprobs
        return output
