"""One step's sampling settings as device tensors (SamplingTensors), from its sampling rows' requests
(step_plan.SamplingRequest: read, never written).

Everything a request may ask beyond plain sampling (penalties, biases, banned or allowed tokens,
log-probabilities) is gathered in one pass over the step's rows that ask for it; a step where no
row asks builds nothing more than before. Penalties keep each sequence's token counts on the device
(TokenCounts) from its first sampling step until it finishes: the slot is this module's, by request,
and the engine calls release().
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.layers.logits_adjustments import LogitsAdjustments, TokenCounts
from asyncllm.layers.sampler import SamplingTensors, noise_key
from asyncllm.runner.host_upload import upload_arrays
from asyncllm.step_plan import PENDING_TOKEN, SamplingRequest


@dataclass
class SamplingPlan:
    """A step's sampling settings as host arrays, by name: SamplingTensors.host_arrays' fields, then
    logprob_rows and the LogitsAdjustments fields that some row uses."""
    arrays: dict[str, np.ndarray]
    seeded_rows: list[tuple[int, int]]  # (row, noise key) of the rows with a seed
    adjusts: bool = False  # some row adjusts its logits
    logprob_ks: list[int] | None = None  # per row: the top-k it asked for, -1 none; None: no row asked


class SamplingInputs:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = device
        self.key_source = np.random.default_rng(seed)  # unseeded rows' noise keys
        self.token_counts = TokenCounts(vocab_size, device)
        self.penalty_slots: dict[SamplingRequest, int] = {}  # the token-count slot of each request that uses penalties
        self._temporary_slots: list[int] = []  # the last plan's (released by the next: its step is queued by then)

    def release_token_counts(self) -> None:
        """Every sequence has ended (a sleeping engine): the penalties' slots and their memory go;
        the next sequences that ask make new ones."""
        self.token_counts = TokenCounts(self.vocab_size, self.device)
        self.penalty_slots = {}
        self._temporary_slots = []

    def plan(self, seqs: list[SamplingRequest]) -> SamplingPlan:
        """The step's sampling settings as host arrays (the runner sends them in the step's one copy)."""
        if self._temporary_slots:  # the step that read them is queued: a reuse's writes come after it
            for slot in self._temporary_slots:
                self.token_counts.release(slot)
            self._temporary_slots = []
        params = [seq.params for seq in seqs]
        keys, seeded_rows = None, []
        if any(p.temperature > 0 for p in params):
            # unseeded rows: consecutive keys from a fresh random base each step
            base = int(self.key_source.integers(-(1 << 63), (1 << 63) - len(seqs)))
            keys = base + np.arange(len(seqs), dtype=np.int64)
            for row, seq in enumerate(seqs):
                if seq.params.seed is not None and seq.params.temperature > 0:
                    # the token sampled now is the completion's token number len(seq) - num_prompt_tokens
                    keys[row] = key = noise_key(seq.params.seed, len(seq.token_ids) - seq.num_prompt_tokens)
                    seeded_rows.append((row, key))
        plan = SamplingPlan(SamplingTensors.host_arrays(params, self.vocab_size, keys), seeded_rows)
        if not any(seq.needs_sampling_extras for seq in seqs):
            return plan
        # everything else the rows ask for, by field name (only the groups some row uses)
        plan.adjusts = any(seq.adjusts_logits for seq in seqs)
        if plan.adjusts:
            self._adjustment_arrays(seqs, plan.arrays)
        if any(p.logprobs is not None for p in params):
            plan.logprob_ks = ks = [-1 if p.logprobs is None else p.logprobs for p in params]
            plan.arrays["logprob_rows"] = np.array([row for row, k in enumerate(ks) if k >= 0], dtype=np.int64)
        return plan

    def tensors(self, plan: SamplingPlan, uploaded: list[torch.Tensor],
                prev_sampled: torch.Tensor | None = None) -> SamplingTensors:
        """The step's SamplingTensors from plan's arrays on the device (uploaded: in plan.arrays' order).
        prev_sampled: the ids (on the device) of the step in flight, which samples the rows'
        PENDING_TOKENs (overlap)."""
        # what is left once the sampling fields and logprob rows are taken: the adjustments' arrays
        adjustments = dict(zip(plan.arrays, uploaded))
        tensors = SamplingTensors.from_device({name: adjustments.pop(name) for name in SamplingTensors.HOST_ARRAYS
                                               if name in adjustments}, plan.seeded_rows)
        logprob_rows = adjustments.pop("logprob_rows", None)
        if logprob_rows is not None:
            tensors.logprob_rows = logprob_rows
            tensors.num_top_logprobs = max(plan.logprob_ks)
        if plan.adjusts:
            tensors.adjustments = self._adjustments(adjustments, prev_sampled)
        return tensors

    def build(self, seqs: list[SamplingRequest], prev_sampled: torch.Tensor | None = None
              ) -> tuple[SamplingTensors, list[int] | None]:
        """plan() and tensors() with a copy of their own: the step's SamplingTensors, and for each row
        the top-k it asked for (None: no row asked for log-probabilities; -1: this row did not)."""
        plan = self.plan(seqs)
        return self.tensors(plan, upload_arrays(list(plan.arrays.values()), self.device), prev_sampled), \
            plan.logprob_ks

    def _adjustment_arrays(self, seqs: list[SamplingRequest], arrays: dict[str, np.ndarray]) -> None:
        """The host arrays of the step's LogitsAdjustments, by field name (only the groups some row uses)."""
        penalty_rows, slots, presence, frequency, repetition, count_slots = [], [], [], [], [], []
        bias_rows, bias_tokens, bias_values = [], [], []
        ban_rows, ban_tokens = [], []
        pending_rows, pending_tokens, pending_sample_rows, pending_values = [], [], [], []
        allow_rows, allow_pair_rows, allow_pair_tokens = [], [], []
        for row, seq in enumerate(seqs):
            if not seq.adjusts_logits:
                continue
            p = seq.params
            if p.uses_penalties:
                request = getattr(seq, "draft_of", None)  # a speculative position: the request it is of
                if request is None:
                    slot = self.penalty_slots.get(seq)
                    if slot is None:
                        outputs = [t for t in seq.completion_token_ids if t != PENDING_TOKEN]
                        slot = self.penalty_slots[seq] = self.token_counts.acquire(
                            seq.token_ids[:seq.num_prompt_tokens], outputs)
                    count_slots.append(slot)
                else:  # its request's counts (its first position, before it, has the slot) and the drafts before it
                    count_slots.append(self.penalty_slots[request])
                    slot = self.token_counts.acquire_copy(count_slots[-1], seq.token_ids[len(request.token_ids):])
                    self._temporary_slots.append(slot)
                penalty_rows.append(row)
                slots.append(slot)
                presence.append(p.presence_penalty)
                frequency.append(p.frequency_penalty)
                repetition.append(p.repetition_penalty)
            if p.logit_bias:
                bias_rows.extend([row] * len(p.logit_bias))
                bias_tokens.extend(p.logit_bias)
                bias_values.extend(p.logit_bias.values())
            if seq.early_stop_ids or seq.bad_word_ids:  # nothing else bans a token
                # the token sampled now is the completion's token number len(seq) - num_prompt_tokens
                banned, if_pending_is = seq.banned_token_ids(len(seq.token_ids) - seq.num_prompt_tokens)
                if banned:
                    ban_rows.extend([row] * len(banned))
                    ban_tokens.extend(banned)
                for pending_value, token in if_pending_is:  # seq.sample_row: its row in prev_sampled
                    pending_rows.append(row)
                    pending_tokens.append(token)
                    pending_sample_rows.append(seq.sample_row)
                    pending_values.append(pending_value)
            if seq.allowed_token_ids is not None:
                allow_pair_tokens.append(seq.allowed_token_ids)
                allow_rows.append(row)
        int64, float32 = np.int64, np.float32
        if allow_rows:  # arrays made once per request: a step's cost is a copy, however long they are
            allow_pair_rows = np.repeat(np.arange(len(allow_rows)), [len(ids) for ids in allow_pair_tokens])
            allow_pair_tokens = np.concatenate(allow_pair_tokens)
        groups = (
            (penalty_rows, dict(penalty_rows=(penalty_rows, int64), penalty_slots=(slots, int64),
                                presence=(presence, float32), frequency=(frequency, float32),
                                repetition=(repetition, float32),
                                **(dict(count_slots=(count_slots, int64)) if count_slots != slots else {}))),
            (bias_rows, dict(bias_rows=(bias_rows, int64), bias_tokens=(bias_tokens, int64),
                             bias_values=(bias_values, float32))),
            (ban_rows, dict(ban_rows=(ban_rows, int64), ban_tokens=(ban_tokens, int64))),
            (pending_rows, dict(pending_ban_rows=(pending_rows, int64), pending_ban_tokens=(pending_tokens, int64),
                                pending_sample_rows=(pending_sample_rows, int64),
                                pending_ban_if=(pending_values, int64))),
            (allow_rows, dict(allow_rows=(allow_rows, int64), allow_pair_rows=(allow_pair_rows, int64),
                              allow_pair_tokens=(allow_pair_tokens, int64))))
        for used, fields in groups:
            if used:
                arrays.update((name, np.array(values, dtype=dtype)) for name, (values, dtype) in fields.items())

    def _adjustments(self, on_device: dict[str, torch.Tensor], prev_sampled: torch.Tensor | None
                     ) -> LogitsAdjustments:
        """The step's LogitsAdjustments from its uploaded arrays (_adjustment_arrays' names)."""
        pending_sample_rows = on_device.pop("pending_sample_rows", None)
        out = LogitsAdjustments(**on_device)
        if out.penalty_rows is not None:
            out.token_counts = self.token_counts
        if pending_sample_rows is not None:
            assert prev_sampled is not None, "a ban that hangs on a pending token without the step that samples it"
            out.pending_ban_values = prev_sampled[pending_sample_rows]
        return out

    def release(self, seq: SamplingRequest) -> None:
        """seq has finished: its token-count slot, if any, goes back to the pool."""
        slot = self.penalty_slots.pop(seq, None)
        if slot is not None:
            self.token_counts.release(slot)
