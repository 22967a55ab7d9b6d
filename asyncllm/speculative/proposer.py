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


class DraftRow(NamedTuple):
    """One decoding row to propose for: its tokens so far (prompt, then output; every one known), the
    most draft tokens it may take, and its request (a key a proposer may keep state under: the same
    object for the request's life, its tokens only ever appended to)."""
    token_ids: list[int]
    max_tokens: int
    request: object = None


class Proposer(Protocol):
    def propose(self, rows: list[DraftRow]) -> list[list[int] | None]:
        """Each row's draft tokens, at most its max_tokens ([]: none found, which the engine counts as
        a miss; None: none this step for want of resources, not counted: the row decodes one token)."""
        ...

    def release(self, request: object) -> None:
        """request has ended or was preempted: drop what was kept for it."""
        ...

    def close(self) -> None:
        """The engine closes: release what outlives garbage collection (a draft model's device memory)."""
        ...
