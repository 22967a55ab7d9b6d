"""A launched step: its forward and sampling queued on the device, its results read back later.

The sampled ids stay on the device for the next step's inputs; a copy to pinned host memory is
queued beside them, with one event, so the engine thread reads them (and the log-probabilities
of the rows that asked) only when it resolves the step, never blocking a launch.
"""
from __future__ import annotations

import numpy as np
import torch

from asyncllm.layers.sampler import LogprobsTensors, SamplerOutput
from asyncllm.runner.pooling import StepPooling
from asyncllm.runner.request_table import RequestTable
from asyncllm.step_plan import StepPlan, StepResult


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued without waiting (pinned memory) on CUDA."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _logprobs_to_host(lp: LogprobsTensors) -> LogprobsTensors:
    return LogprobsTensors(*map(_to_host, (lp.chosen, lp.ranks, lp.top_ids, lp.top_logprobs)))


class LaunchedStep:
    """A step whose forward and sampling are queued on the device: its sampled ids stay on the
    device for the next step to read, and are copied to the host without blocking it (with the
    log-probabilities of the rows that asked).

    A step with constrained rows may leave its sampling pending (its bitmask is being filled on a
    worker thread): queue_sampling() queues it, before anything reads the sampled ids or queues
    later work on the device."""

    def __init__(self, plan: StepPlan, output: SamplerOutput | None = None, logprob_ks: list[int] | None = None,
                 prompt_logprobs: LogprobsTensors | None = None, sample=None, stream=None,
                 pooling: StepPooling | None = None, table: RequestTable | None = None, launched_rows=None):
        self.plan = plan
        # the runner's request table, which learns the step's tokens when result() reads them (once)
        self._table, self._launched_rows = table, launched_rows  # RequestTable.launched's
        self._stream = stream  # the one the step is queued on (None: the current one, looked up)
        self.logprob_ks = logprob_ks  # per sampling row: the top-k it asked for, -1 none; None: no row asked
        self._host_prompt_logprobs = None if prompt_logprobs is None else _logprobs_to_host(prompt_logprobs)
        self._sample = sample  # () -> the SamplerOutput; None once it is queued
        # embedding rows: their plan (engine/pooling.py) and hidden-state sums, copied before the
        # event that _queued records
        self.pooling_plan = None if pooling is None else pooling.plan
        self._host_pooled_sums = None if pooling is None else _to_host(pooling.sums)
        if output is not None:
            self._queued(output)

    def _queued(self, output: SamplerOutput) -> None:
        self.sampled = output.token_ids  # (S,) int64, on the device
        self._host = _to_host(self.sampled)
        self._host_accepted = None if output.accepted is None else _to_host(output.accepted)
        self._host_logprobs = None if output.logprobs is None else _logprobs_to_host(output.logprobs)
        self._copied = None
        if self.sampled.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)

    def queue_sampling(self) -> None:
        """Queue the step's sampling if it is still pending (idempotent)."""
        if self._sample is not None:
            sample, self._sample = self._sample, None
            self._queued(sample())

    def _on_host(self) -> None:
        """Wait until the step's copies to the host have landed (queuing its sampling first)."""
        self.queue_sampling()
        if self._copied is not None:
            self._copied.synchronize()

    def wait(self) -> None:
        """Block until the step's results are on the host (the interpreter lock is free meanwhile)."""
        self._on_host()

    def result(self) -> StepResult:
        """The step's results on the host (waits for the device to finish the step)."""
        result = StepResult(self.token_ids(), self.logprob_ks, self.logprobs(), self.prompt_logprobs(),
                            pooled_sums=self.pooled_sums())
        if self.plan.rows_per_request is not None:
            keep_accepted(result, self.plan.rows_per_request, self._host_accepted.tolist())
        if self._table is not None:
            self._table.recorded(self._launched_rows, self.plan, result.token_ids, result.num_per_row)
            self._table = None
        return result

    def token_ids(self) -> list[int]:
        """The sampled ids on the host (waits for the device to finish the step)."""
        self._on_host()
        return self._host.tolist()

    def logprobs(self) -> tuple[list[float], list[int], np.ndarray, np.ndarray] | None:
        """(chosen log-prob, rank, top ids, top log-probs) of each row that asked, in row order."""
        self.queue_sampling()  # it makes _host_logprobs
        return self._as_lists(self._host_logprobs)

    def prompt_logprobs(self) -> tuple[list[float], list[int], np.ndarray, np.ndarray] | None:
        """The same for the prompt positions of the plan's prompt_logprobs, in its row order."""
        return self._as_lists(self._host_prompt_logprobs)

    def pooled_sums(self) -> np.ndarray | None:
        """The pooling rows' hidden-state sums on the host, (rows, hidden) float32, in plan order."""
        if self._host_pooled_sums is None:
            return None
        self._on_host()
        return self._host_pooled_sums.numpy()

    def _as_lists(self, lp: LogprobsTensors | None):
        if lp is None:
            return None
        self._on_host()
        # the top alternatives stay arrays (copied: the pinned buffers go back to their pool), whose
        # rows the TokenLogprobs keep: no Python objects per alternative
        return (lp.chosen.tolist(), lp.ranks.tolist(), lp.top_ids.numpy().copy(), lp.top_logprobs.numpy().copy())


def keep_accepted(result: StepResult, rows_per_request: list[int], accepted: list[bool]) -> None:
    """A speculative step's result, in place, from one token per sampling row to each request's kept
    tokens: its drafts up to the first one rejected, then the token sampled at that row (the target's
    own there, or the bonus token after the last draft); their log-probabilities likewise."""
    keep, counts, row = [], [], 0
    for num_rows in rows_per_request:
        num_accepted = 0
        while num_accepted < num_rows - 1 and accepted[row + num_accepted]:
            num_accepted += 1
        keep.extend(range(row, row + num_accepted + 1))
        counts.append(num_accepted + 1)
        row += num_rows
    token_ids = result.token_ids
    result.token_ids = [token_ids[i] for i in keep]
    result.num_per_row = counts
    if result.logprob_ks is not None:
        ks = result.logprob_ks
        # the rows that asked hold consecutive entries of the log-probability arrays, in row order
        entry = np.cumsum([k >= 0 for k in ks]) - 1
        kept_entries = [int(entry[i]) for i in keep if ks[i] >= 0]
        chosen, ranks, top_ids, top_logprobs = result.logprobs
        result.logprobs = ([chosen[j] for j in kept_entries], [ranks[j] for j in kept_entries],
                           top_ids[kept_entries], top_logprobs[kept_entries])
        result.logprob_ks = [ks[i] for i in keep]
