"""A step's token bitmask for its constrained rows, filled on the host while the forward runs."""
from __future__ import annotations

from collections.abc import Callable

import torch

from asyncllm.structured.grammar import GrammarCompiler, GrammarState


class CatchUp:
    """A constrained request's tokens as the runner knows them (runner/request_table.py), for its
    matcher: token_ids (prompt, then the completion so far, the list the runner appends results to),
    and pending_row, the row of the previous step's sampled ids that holds its token in flight (-1: none)."""
    __slots__ = ("state", "token_ids", "num_prompt_tokens", "pending_row")

    def __init__(self, state: GrammarState, token_ids: list[int], num_prompt_tokens: int, pending_row: int):
        self.state, self.token_ids, self.num_prompt_tokens, self.pending_row = \
            state, token_ids, num_prompt_tokens, pending_row


class StepConstraints:
    """The sampling rows of one step whose requests have a grammar."""

    __slots__ = ("rows", "states", "catch_ups", "compiler", "drafts")

    def __init__(self, rows: list[int], states: list[GrammarState], catch_ups: list[CatchUp],
                 compiler: GrammarCompiler, drafts: list[list[int]] | None = None):
        self.rows = rows  # indices among the step's sampling rows
        self.states = states  # per row: its request's matcher
        # each request once: a speculating request's verified positions share its grammar
        # (speculative decoding, engine/speculation.py)
        self.catch_ups = catch_ups
        self.compiler = compiler
        # per row: the drafts its position takes as generated (a verified position past its request's
        # first), fed to the matcher for its mask and rolled back; None where no row has any
        self.drafts = drafts

    def catch_up(self, prev_token_ids: Callable[[], list[int]] | None) -> None:
        """Advance every request's matcher to its last token. A request whose last token the previous
        step is still sampling (overlapped steps) needs its value: prev_token_ids() gives the previous
        step's sampled ids, waiting for that step only when some row needs them."""
        prev_ids = None
        for request in self.catch_ups:
            pending_value = None
            if request.pending_row >= 0:
                if prev_ids is None:
                    prev_ids = prev_token_ids()
                pending_value = prev_ids[request.pending_row]
            request.state.catch_up(request.token_ids, request.num_prompt_tokens, pending_value)

    def fill(self, bitmask: torch.Tensor) -> None:
        """Fill bitmask (len(rows), words) after catch_up. Touches only the matchers, not the
        requests' tokens: it may run on another thread while the engine resolves the previous step
        (not with speculative positions, whose drafts it feeds to the matchers and takes back: the
        runner waits for those)."""
        self.compiler.fill_bitmask(self.states, bitmask)
        if self.drafts is not None:
            for i, drafts in enumerate(self.drafts):
                if drafts:
                    self.compiler.fill_bitmask_after(self.states[i], drafts, bitmask, i)
