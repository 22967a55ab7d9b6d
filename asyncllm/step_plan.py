"""The step contract between the engine and the runner (issue 49), below both: the engine turns its
scheduler's output into a StepPlan, the runner runs it and hands back a StepResult.

A plan is host data the runner only reads: token spans, positions, block-table rows, which rows
sample, and the tokens still in flight. The sampling rows' settings travel as the requests
themselves, read through SamplingRequest (never written: what the runner keeps per request, such
as penalty slots, it keeps in tables of its own); docs/ARCHITECTURE.md says what the rest of the
contract (those settings as plain per-row values) needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from asyncllm.sampling_params import SamplingParams

# stands for a token that a step still in flight on the device is sampling: the next step takes its
# value on the device (the host learns it once that step's results are read)
PENDING_TOKEN = -1


class SamplingRequest(Protocol):
    """What the runner reads of a sampling row's request (the engine's Sequence), and nothing else. A
    speculative position past its request's first (engine/speculation.py DraftPosition) reads as the
    request with those drafts in token_ids, and has draft_of: that request (a request itself has none)."""
    params: SamplingParams
    token_ids: list[int]  # prompt then completion; the last may be PENDING_TOKEN
    num_prompt_tokens: int
    sample_row: int  # its row among the sampled ids of the step that samples its PENDING_TOKEN
    adjusts_logits: bool  # penalties, biases, bans or allowed ids
    needs_sampling_extras: bool  # adjusts_logits, or asks for log-probabilities
    early_stop_ids: list[int]
    bad_word_ids: list[list[int]]
    allowed_token_ids: np.ndarray | None
    grammar: object  # structured.grammar.GrammarState, or None

    @property
    def completion_token_ids(self) -> list[int]: ...

    def banned_token_ids(self, num_generated: int) -> tuple[list[int], list[tuple[int, int]]]: ...


@dataclass(slots=True)
class PromptLogprobsPlan:
    """The prompt positions of one step whose logits give prompt log-probabilities: position p's
    logits score prompt token p + 1."""
    token_rows: np.ndarray  # (R,) int64: their rows among the step's tokens
    targets: list[int]  # (R,) the prompt tokens they score
    spans: list[tuple[object, int, int]]  # (the engine's request, rows, top-k asked), in row order
    num_top: int


@dataclass(slots=True)
class StepPlan:
    """One step as the runner needs it, row by row in the scheduler's order (the runner derives
    positions, slot mapping and padded block tables from these with numpy)."""
    input_ids: list[int]  # (T,) the step's tokens, PENDING_TOKEN where the step in flight samples one
    starts: list[int]  # (B,) each row's first position (its tokens already in the KV cache)
    query_lens: list[int]  # (B,) tokens each row computes
    block_rows: list[list[int]]  # (B,) each row's block table
    logits_indices: list[int]  # (S,) the token (index in the step) whose logits each sampling row samples from
    pending_at: list[int]  # token indices that are PENDING_TOKEN
    pending_rows: list[int]  # for each: its row among the sampled ids of the step in flight
    # (S,) the sampling rows' requests. A speculating row (speculative decoding) samples at each of its
    # 1 + k positions: each is a sampling row here, its request as of that position (its first j drafts
    # taken as generated: engine/speculation.py DraftPosition)
    sampling_requests: list[SamplingRequest]
    prompt_logprobs: PromptLogprobsPlan | None = None  # prompt positions scored in this step
    # speculative decoding, None in a step where no row speculates: (S,) the draft token each sampling
    # row verifies (-1: none, a row's last position), and (R,) each request's count of sampling rows
    draft_token_ids: list[int] | None = None
    rows_per_request: list[int] | None = None
    # the drafts drawn from a distribution q (a draft model's, for a sampled request): (the request's
    # first sampling row, (k, V) float32 device tensor: q at each of its k drafts); () when none
    draft_probs: list[tuple[int, object]] | tuple = ()
    # the engine's own record of the step (its SchedulerOutput), handed back with the launched step
    # so the engine resolves it; the runner never reads it
    engine_step: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class StepResult:
    """A resolved step, on the host. token_ids holds each sampling request's tokens, one after the
    other: one each, or (speculative decoding) its accepted drafts and the token sampled after them."""
    token_ids: list[int]
    logprob_ks: list[int] | None  # per token: the top-k its request asked for, -1 none; None: none asked
    logprobs: tuple | None  # (chosen, ranks, top ids, top log-probs) of the tokens that asked, in order
    prompt_logprobs: tuple | None  # the same for the plan's prompt positions (PromptLogprobsPlan)
    num_per_row: list[int] | None = None  # per request: its tokens (accepted drafts + 1); None: one each
    pooled_sums: np.ndarray | None = None  # the embedding rows' hidden-state sums, (rows, hidden) float32
