"""One step's sampling settings as device tensors (SamplingTensors), gathered from the runner's
request table (runner/request_table.py) by the step's sampling rows.

Everything a request may ask beyond plain sampling (penalties, biases, banned or allowed tokens,
log-probabilities) is gathered in one pass over the step's rows that ask for it; a step where no
row asks builds nothing more than before. Penalties keep each request's token counts on the device
(TokenCounts) from its first sampling step until it finishes: the slot is its table entry's, and
the engine's end of the request calls release().
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.layers.logits_adjustments import LogitsAdjustments, TokenCounts
from asyncllm.layers.sampler import SamplingTensors, noise_key
from asyncllm.runner.host_upload import upload_arrays
from asyncllm.runner.request_table import (ADJUSTS, GRAMMAR, LOGPROBS, MIN_P, RANDOM, SEEDED, TOP_K, TOP_P,
                                           RequestTable, banned_token_ids, speculative_positions)
from asyncllm.step_plan import StepPlan


@dataclass
class SamplingPlan:
    """A step's sampling settings as host arrays, by name: SamplingTensors.host_arrays' fields, then
    logprob_rows and the LogitsAdjustments fields that some row uses."""
    arrays: dict[str, np.ndarray]
    seeded_rows: list[tuple[int, int]]  # (row, noise key) of the rows with a seed
    adjusts: bool = False  # some row adjusts its logits
    logprob_ks: list[int] | None = None  # per row: the top-k it asked for, -1 none; None: no row asked
    rows: np.ndarray | None = None  # each sampling row's table row (RequestTable)
    flags: np.ndarray | None = None  # and its flags (request_table's constants), and their OR
    any_flags: int = 0


class SamplingInputs:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = device
        self.key_source = np.random.default_rng(seed)  # unseeded rows' noise keys
        self.token_counts = TokenCounts(vocab_size, device)
        self.table = RequestTable(vocab_size)  # the requests' settings, tokens and penalty slots
        self._temporary_slots: list[int] = []  # the last plan's (released by the next: its step is queued by then)

    def release_token_counts(self) -> None:
        """Every sequence has ended (a sleeping engine): the table empties, the penalties' slots and
        their memory go; the next sequences that ask make new ones."""
        self.table.clear()
        self.token_counts = TokenCounts(self.vocab_size, self.device)
        self._temporary_slots = []

    def plan(self, plan: StepPlan) -> SamplingPlan:
        """The step's sampling settings as host arrays (the runner sends them in the step's one copy),
        gathered from the table's columns by its sampling rows' table rows."""
        self._release_temporary_slots()
        table = self.table
        rows = table.rows(plan.sampling_ids)
        flags = table.flags[rows]
        # (a one-row reduce costs more than the rest of a batch-1 step's plan)
        any_flags = int(flags[0]) if len(flags) == 1 else int(np.bitwise_or.reduce(flags))
        out = SamplingPlan({}, [], rows=rows, flags=flags, any_flags=any_flags)
        positions = None
        if any_flags & (SEEDED | ADJUSTS | GRAMMAR) and plan.rows_per_request is not None:
            positions = speculative_positions(plan.rows_per_request)
        if any_flags & RANDOM:
            # unseeded rows: consecutive keys from a fresh random base each step
            base = int(self.key_source.integers(-(1 << 63), (1 << 63) - len(rows)))
            keys = base + np.arange(len(rows), dtype=np.int64)
            if any_flags & SEEDED:
                for row in np.flatnonzero(flags & SEEDED).tolist():
                    table_row = int(rows[row])
                    entry = table.entries[plan.sampling_ids[row]]
                    num_generated = table.num_generated(table_row, entry) + (0 if positions is None else positions[row])
                    keys[row] = key = noise_key(entry.settings.seed, int(num_generated))
                    out.seeded_rows.append((row, key))
            out.arrays = arrays = {"temperatures": table.temperature[rows], "keys": keys}
            for name, flag, column in (("top_ks", TOP_K, table.top_k), ("top_ps", TOP_P, table.top_p),
                                       ("min_ps", MIN_P, table.min_p)):
                if any_flags & flag:
                    arrays[name] = column[rows]
        if not any_flags & (ADJUSTS | LOGPROBS):
            return out
        # everything else the rows ask for, by field name (only the groups some row uses)
        if any_flags & ADJUSTS:
            out.adjusts = True
            self._adjustment_arrays(plan, rows, np.flatnonzero(flags & ADJUSTS).tolist(), positions, out.arrays)
        if any_flags & LOGPROBS:
            out.logprob_ks = table.logprobs[rows].tolist()
            out.arrays["logprob_rows"] = np.flatnonzero(flags & LOGPROBS).astype(np.int64)
        return out

    def tensors(self, plan: SamplingPlan, uploaded: list[torch.Tensor],
                prev_sampled: torch.Tensor | None = None) -> SamplingTensors:
        """The step's SamplingTensors from plan's arrays on the device (uploaded: in plan.arrays' order).
        prev_sampled: the ids (on the device) of the step in flight, which samples the rows' tokens
        in flight (overlap)."""
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

    def build(self, plan: StepPlan, prev_sampled: torch.Tensor | None = None
              ) -> tuple[SamplingTensors, list[int] | None]:
        """plan() and tensors() with a copy of their own: the step's SamplingTensors, and for each row
        the top-k it asked for (None: no row asked for log-probabilities; -1: this row did not)."""
        sampling_plan = self.plan(plan)
        return self.tensors(sampling_plan, upload_arrays(list(sampling_plan.arrays.values()), self.device),
                            prev_sampled), sampling_plan.logprob_ks

    def _adjustment_arrays(self, plan: StepPlan, rows: np.ndarray, adjusting: list[int],
                           positions: np.ndarray | None, arrays: dict[str, np.ndarray]) -> None:
        """The host arrays of the step's LogitsAdjustments, by field name (only the groups some row
        uses), from the table's entries of the rows that adjust (adjusting: their step rows)."""
        penalty_rows, slots, presence, frequency, repetition, count_slots = [], [], [], [], [], []
        bias_rows, bias_tokens, bias_values = [], [], []
        ban_rows, ban_tokens = [], []
        pending_rows, pending_tokens, pending_sample_rows, pending_values = [], [], [], []
        allow_rows, allow_pair_rows, allow_pair_tokens = [], [], []
        table, counts = self.table, self.token_counts
        for row in adjusting:
            table_row, entry = int(rows[row]), table.entries[plan.sampling_ids[row]]
            p = entry.settings
            # a speculative position j > 0 takes its request's first j drafts as generated
            j = 0 if positions is None else int(positions[row])
            drafts = plan.draft_token_ids[row - j:row] if j else []
            if p.uses_penalties:
                if not j:
                    slot = entry.penalty_slot
                    if slot < 0:
                        ids = entry.token_ids
                        slot = entry.penalty_slot = counts.acquire(ids[:p.num_prompt_tokens],
                                                                   ids[p.num_prompt_tokens:])
                    count_slots.append(slot)
                else:  # its request's counts (its first position, before it, has the slot) and the drafts before it
                    count_slots.append(entry.penalty_slot)
                    slot = counts.acquire_copy(entry.penalty_slot, drafts)
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
            if p.early_stop_ids or p.bad_word_ids:  # nothing else bans a token
                banned, if_pending_is = banned_token_ids(table, table_row, entry, drafts)
                if banned:
                    ban_rows.extend([row] * len(banned))
                    ban_tokens.extend(banned)
                for pending_value, token in if_pending_is:  # its row in prev_sampled: the table's pending_row
                    pending_rows.append(row)
                    pending_tokens.append(token)
                    pending_sample_rows.append(int(table.pending_row[table_row]))
                    pending_values.append(pending_value)
            if p.allowed_token_ids is not None:
                allow_pair_tokens.append(p.allowed_token_ids)
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

    def release(self, request: int) -> None:
        """The request has ended: its table row goes, and its token-count slot, if any, back to the pool."""
        entry = self.table.remove(request)
        if entry is not None and entry.penalty_slot >= 0:
            self.token_counts.release(entry.penalty_slot)
        if not len(self.table):  # no next plan may come to release the last one's: they go with the last request's
            self._release_temporary_slots()

    def _release_temporary_slots(self) -> None:
        """The last plan's step-only slots back to the pool: the step that reads them is queued by now
        (as the slot of a request that ends), so a reuse's writes come after it."""
        for slot in self._temporary_slots:
            self.token_counts.release(slot)
        self._temporary_slots = []
