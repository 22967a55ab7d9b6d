"""The step contract between the engine and the runner (issue 49), below both: the engine turns its
scheduler's output into a StepPlan, the runner runs it and hands back a StepResult.

A plan is host data the runner only reads: token spans, positions, block-table rows, which rows
sample, and which of those rows end with a token still in flight (overlapped steps: its value is
the runner's alone, on the device, until the step in flight is read; the engine knows only that
it is there). A request's sampling settings travel once, as plain values
(RequestSampling, in the plan of its first sampling step): the runner keeps them in a table of its
own, with the request's tokens as its steps' results come back, and each step's sampling rows name
their requests by key.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

@dataclass(slots=True)
class RequestSampling:
    """A request's sampling settings as plain values, sent to the runner once, in the plan of its
    first sampling step (StepPlan.new_requests): the runner keeps them in its request table
    (runner/request_table.py) for the request's life, with its tokens as the runner learns them."""
    request: int  # the engine's key for it (unique for the engine's life): the plans' sampling_ids name it
    # prompt then the completion so far (known values only), where its sampling reads them
    # (request_table.HISTORY), else []: a copy the runner's table takes as its own, appending the
    # results it reads
    token_ids: list[int]
    num_prompt_tokens: int
    temperature: float
    top_k: int  # 0 or less: no limit
    top_p: float
    min_p: float
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    uses_penalties: bool
    logit_bias: dict[int, float] | None
    allowed_token_ids: np.ndarray | None  # int64, made once by the engine
    early_stop_ids: list[int]  # EOS and stop ids, banned while under min_tokens
    min_tokens: int
    bad_word_ids: list[list[int]]  # each bad word's token ids
    logprobs: int | None  # top-k log-probabilities asked for each sampled token
    adjusts_logits: bool  # penalties, biases, bans or allowed ids
    grammar: object = None  # structured.grammar.GrammarState of a constrained request (its matcher)


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
    # (T,) the step's tokens; a row whose last token is in flight (in_flight_rows) holds 0 there,
    # which the runner replaces with the id the step in flight samples
    input_ids: list[int]
    starts: list[int]  # (B,) each row's first position (its tokens already in the KV cache)
    query_lens: list[int]  # (B,) tokens each row computes
    block_rows: list[list[int]]  # (B,) each row's block table
    logits_indices: list[int]  # (S,) the token (index in the step) whose logits each sampling row samples from
    # the sampling rows (indices into sampling_ids) whose last token is in flight: sampled by the
    # step in flight for the same request, never a speculating row
    in_flight_rows: list[int]
    # (S,) the sampling rows' requests (RequestSampling.request). A speculating row (speculative
    # decoding) samples at each of its 1 + k positions: each is a sampling row here, of the same
    # request, position j taking the row's first j drafts as generated
    sampling_ids: list[int]
    prompt_logprobs: PromptLogprobsPlan | None = None  # prompt positions scored in this step
    # speculative decoding, None in a step where no row speculates: (S,) the draft token each sampling
    # row verifies (-1: none, a row's last position), and (R,) each request's count of sampling rows
    draft_token_ids: list[int] | None = None
    rows_per_request: list[int] | None = None
    # the drafts drawn from a distribution q (a draft model's, for a sampled request): (the request's
    # first sampling row, (k, V) float32 device tensor: q at each of its k drafts); () when none
    draft_probs: list[tuple[int, object]] | tuple = ()
    # the requests that sample for the first time in this step: the runner adds them to its table
    # before the step (a request leaves it when the engine ends it: ModelRunner.release_request)
    new_requests: list[RequestSampling] = field(default_factory=list)
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
