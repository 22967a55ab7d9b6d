"""A step's token bitmask for its constrained rows, filled on the host while the forward runs."""
from __future__ import annotations

from collections.abc import Callable

import torch

from asyncllm.step_plan import PENDING_TOKEN, StepPlan
from asyncllm.structured.grammar import GrammarCompiler


class StepConstraints:
    """The sampling rows of one step whose requests have a grammar."""

    __slots__ = ("rows", "seqs", "states", "compiler", "drafts")

    def __init__(self, rows: list[int], seqs: list, compiler: GrammarCompiler):
        self.rows = rows  # indices among the step's sampling rows
        # their requests (each with a GrammarState in .grammar), each once: a speculating request's
        # verified positions share its grammar (speculative decoding, engine/speculation.py)
        self.seqs = [seq for seq in seqs if getattr(seq, "draft_of", None) is None]
        self.states = [seq.grammar for seq in seqs]  # per row
        self.compiler = compiler
        # per row: the drafts its position takes as generated (a verified position past its request's
        # first), fed to the matcher for its mask and rolled back; None where no row has any
        self.drafts = None
        if len(self.seqs) < len(seqs):
            self.drafts = [seq.token_ids[len(seq.draft_of.token_ids):] if getattr(seq, "draft_of", None) is not None
                           else [] for seq in seqs]

    @classmethod
    def of(cls, plan: StepPlan, compiler: GrammarCompiler) -> "StepConstraints | None":
        """None when no sampling row is constrained (the sampler then builds no mask)."""
        rows = [row for row, seq in enumerate(plan.sampling_requests) if seq.grammar is not None]
        return cls(rows, [plan.sampling_requests[row] for row in rows], compiler) if rows else None

    def catch_up(self, prev_token_ids: Callable[[], list[int]] | None) -> None:
        """Advance every row's matcher to its sequence's last token. A sequence whose last token the
        previous step is still sampling (overlapped steps) needs its value: prev_token_ids() gives
        the previous step's sampled ids, waiting for that step only when some row needs them."""
        prev_ids = None
        for seq in self.seqs:
            pending_value = None
            if seq.token_ids[-1] == PENDING_TOKEN:
                if prev_ids is None:
                    prev_ids = prev_token_ids()
                pending_value = prev_ids[seq.sample_row]
            seq.grammar.catch_up(seq, pending_value)

    def fill(self, bitmask: torch.Tensor) -> None:
        """Fill bitmask (len(rows), words) after catch_up. Touches only the matchers, not the
        sequences: it may run on another thread while the engine resolves the previous step (not
        with speculative positions, whose drafts it feeds to the matchers and takes back: the runner
        waits for those)."""
        self.compiler.fill_bitmask(self.states, bitmask)
        if self.drafts is not None:
            for i, drafts in enumerate(self.drafts):
                if drafts:
                    self.compiler.fill_bitmask_after(self.states[i], drafts, bitmask, i)
