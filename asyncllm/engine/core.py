"""The engine core: one scheduler, one block manager, one model runner. Both the sync LLM and the
AsyncLLMEngine drive this same object; it knows nothing of threads or event loops."""
from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass

from asyncllm.config import Config
from asyncllm.engine.block_manager import BlockManager
from asyncllm.engine.scheduler import Scheduler
from asyncllm.engine.sequence import Sequence
from asyncllm.model_runner import ModelRunner
from asyncllm.models.checkpoint import check_tokenizer
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger("asyncllm")


@dataclass
class StepEvent:
    """What happened to one request in one step: a new token and/or its end."""
    seq: Sequence
    new_token_ids: list[int]
    finish_reason: str | None


def check_text(text: str, argument: str) -> None:
    """Refuse a str that is not valid Unicode text (lone surrogates, e.g. from bytes decoded with
    errors="surrogateescape"), which the tokenizer would reject with an obscure error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{argument}: not valid Unicode text (lone surrogate {text[e.start]!r} at index "
                         f"{e.start}); decode bytes with errors='replace' first") from None


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


class EngineCore:
    def __init__(self, config: Config, weights=None):
        from transformers import AutoTokenizer
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=False)
        check_tokenizer(self.tokenizer, config.hf_config, config.model)
        self.runner = ModelRunner(config, weights=weights)
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        # a sequence can never outgrow the whole cache, so that is a length limit too
        self.max_seq_len = min(config.max_model_len, self.block_manager.num_total_blocks * config.kvcache_block_size)
        self.vocab_size = config.hf_config.vocab_size
        self.eos_token_ids = self._find_eos_token_ids()
        self.requests: dict[str, Sequence] = {}
        self._request_counter = itertools.count()
        self.num_steps = 0
        self.last_step: tuple[int, int] | None = None  # (prefill tokens, decode tokens) of the last step

    def _find_eos_token_ids(self) -> set[int]:
        ids = _as_id_set(getattr(self.config.hf_config, "eos_token_id", None))
        gen_config = os.path.join(self.config.model, "generation_config.json")
        if os.path.exists(gen_config):
            with open(gen_config) as f:
                ids |= _as_id_set(json.load(f).get("eos_token_id"))
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- input --------------------------------------------------------------------------------
    def encode_prompt(self, prompt, argument: str = "prompt") -> list[int]:
        """A prompt string or token-id list, checked, as token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{argument}: the prompt is empty")
            check_text(prompt, argument)
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:
                raise ValueError(f"{argument}: the prompt encodes to no tokens")
            return token_ids
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError(f"{argument}: the token-id list is empty")
            for i, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise TypeError(f"{argument}[{i}]: token ids must be ints, got {type(t).__name__}")
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"{argument}[{i}]: token id {t} is outside the vocabulary [0, {self.vocab_size})")
            return list(prompt)
        raise TypeError(f"{argument}: expected a string or a list of token ids, got {type(prompt).__name__}")

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, argument: str = "prompt") -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        # checked again: fields set after construction would otherwise fail inside a step, killing the
        # engine for every request
        params.__post_init__()
        if len(prompt_token_ids) >= self.max_seq_len:
            what = "max_model_len" if self.max_seq_len == self.config.max_model_len else "the KV cache's capacity"
            raise ValueError(f"{argument}: {len(prompt_token_ids)} tokens leave no room to generate within "
                             f"{what} ({self.max_seq_len} tokens)")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        self.check_request(prompt_token_ids, params)
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        seq = Sequence(request_id, prompt_token_ids, params, self.config.kvcache_block_size)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def finish_request(self, request_id: str, reason: str = "abort") -> Sequence | None:
        """End a request now (abort, or a stop string found by the caller); its blocks are freed at once.
        Unknown or finished ids are ignored."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, reason)
        return seq

    # ---- the step -----------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[StepEvent]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        token_ids = self.runner.execute(sched)
        self.scheduler.commit(sched)
        self.num_steps += 1
        num_decode = sum(1 for item in sched.scheduled if item.num_tokens == 1 and item.samples)
        self.last_step = (sched.num_batched_tokens - num_decode, num_decode)
        events = []
        sampled = iter(token_ids)
        for item in sched.scheduled:
            if not item.samples:
                continue
            seq, token_id = item.seq, next(sampled)
            seq.token_ids.append(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self.requests.pop(seq.request_id, None)
                self.scheduler.finish(seq, reason)
            events.append(StepEvent(seq, [token_id], reason))
        return events

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if (not params.ignore_eos and token_id in self.eos_token_ids) or token_id in params.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or len(seq) >= self.max_seq_len:
            return "length"
        return None

    def close(self) -> None:
        """Release what outlives Python's garbage collection: tensor-parallel worker processes."""
        self.runner.close()

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_total_blocks,
            "block_size": bm.block_size,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
        }
