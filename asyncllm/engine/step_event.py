"""StepEvent: what the engine core reports for one request after a step, the message the sync LLM
and the engine thread turn into outputs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncllm.engine.sequence import Sequence
from asyncllm.outputs import FinishReason, TokenLogprob


@dataclass(slots=True)
class StepEvent:
    """What happened to one request in one step: a new token and/or its end."""
    seq: Sequence  # seq.index tells which of an n > 1 request's sequences
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked
    stop_reason: int | None = None  # the stop token id that ended it (EOS: None, as vLLM)
    request_finished: bool = False  # every sequence of the request has finished (n == 1: finish_reason set)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, when the request asked
    # ended with no token, why: its grammar refused the one sampled (GrammarState.error; finish_reason
    # ABORT), or its deadline passed before its first token (TIMEOUT)
    error: str | None = None
    embedding: np.ndarray | None = None  # an embedding request's vector (float32), with its end
