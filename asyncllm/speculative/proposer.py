"""What proposes draft tokens for speculative decoding: a Proposer guesses, for each decoding row, the
next few tokens; the target model then verifies them all in one step (engine/speculation.py drafts,
runner/ verifies). A proposer only guesses: a bad guess costs speed, never correctness.

A proposer of another kind plugs in here. The n-gram one (ngram.py) needs nothing but the tokens. A
draft model (draft_model.py) runs its own ModelRunner over the draft checkpoint, with its own paged
KV cache per request, caught up on the accepted tokens at each proposal and released when the
request ends or is preempted; EAGLE heads and MTP layers need the target's hidden states of the
verified positions as well (a StepResult field), docs/ARCHITECTURE.md "Speculative decoding" says more.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from asyncllm.sampling_params import SamplingParams


class DraftRow(NamedTuple):
    """One decoding row to propose for: its tokens so far (prompt, then output; every one known), the
    most draft tokens it may take, its request (a key a proposer may keep state under: the same
    object for the request's life, its tokens only ever appended to), and the request's sampling
    settings and prompt length (a proposer that samples its drafts draws them as the request would:
    None or temperature 0, greedily)."""
    token_ids: list[int]
    max_tokens: int
    request: object = None
    params: SamplingParams | None = None
    num_prompt_tokens: int = 0


class SampledDrafts(list):
    """Draft tokens drawn from the proposer's own distribution q (a draft model's, for a sampled
    request), with probs (len, V) float32 on the device: q at each draft's position, which the
    verification needs whole (accept with min(1, p/q), else draw from norm(max(p - q, 0))). A plain
    list of drafts is a point proposal (q a point mass at each draft)."""

    def __init__(self, token_ids: list[int], probs: torch.Tensor):
        super().__init__(token_ids)
        self.probs = probs


class Proposer(Protocol):
    # whether a rejected draft costs a forward (a draft model's; an n-gram lookup's costs ~nothing):
    # then a request's first speculation is a probe of few drafts (engine/speculation.py), so a draft
    # that never pays costs one cheap step before the request pauses
    drafts_cost_forwards: bool

    def propose(self, rows: list[DraftRow]) -> list[list[int] | None]:
        """Each row's draft tokens, at most its max_tokens ([]: none found, which the engine counts as
        a miss; None: none this step for want of resources, not counted: the row decodes one token);
        SampledDrafts where they were drawn from a distribution rather than chosen."""
        ...

    def release(self, request: object) -> None:
        """request has ended or was preempted: drop what was kept for it."""
        ...

    def close(self) -> None:
        """The engine closes: release what outlives garbage collection (a draft model's device memory)."""
        ...
