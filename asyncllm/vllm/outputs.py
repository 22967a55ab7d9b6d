"""vLLM's output objects (vllm.outputs): RequestOutput, CompletionOutput and Logprob, made from what
the native API hands back (LLM.generate's dicts, AsyncLLMEngine's StreamOutput / RequestResult), and
EmbeddingRequestOutput / EmbeddingOutput (LLM.embed's vectors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncllm.outputs import TokenLogprob


@dataclass
class Logprob:
    """One token's log-probability, its rank (1 = most likely) and its text, as vLLM's."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's n sequences."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # with logprobs asked for: the sum of the sampled tokens' log-probabilities
    logprobs: list[dict[int, Logprob]] | None  # per token: the sampled token and the top alternatives
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (EOS: None)
    lora_request: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's output: every sequence (or, while streaming, the ones that changed)."""
    request_id: str
    prompt: str | None  # None for a prompt given as token ids
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None  # asyncllm's RequestMetrics (vLLM's are RequestStateStats)
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    kv_transfer_params: Any = field(default=None, repr=False)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding."""
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's output, as vLLM's (LLM.embed)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def token_logprobs(entries: list[TokenLogprob] | None) -> list[dict[int, Logprob]] | None:
    """asyncllm's per-token log-probabilities as vLLM's: {token id: Logprob}, the sampled token first."""
    if entries is None:
        return None
    return [_logprob_dict(entry) for entry in entries]


def prompt_token_logprobs(entries: list[TokenLogprob | None] | None) -> list[dict[int, Logprob] | None] | None:
    """The same for the prompt's tokens (None for the first, which nothing predicts)."""
    if entries is None:
        return None
    return [None if entry is None else _logprob_dict(entry) for entry in entries]


def _logprob_dict(entry: TokenLogprob) -> dict[int, Logprob]:
    found = {entry.token_id: Logprob(entry.logprob, entry.rank, entry.token)}
    texts = entry.top_tokens
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        if token_id not in found:
            found[token_id] = Logprob(logprob, rank, None if texts is None else texts[rank - 1])
    return found


def completion_output(index: int, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None,
                      finish_reason: str | None, stop_reason, cumulative_logprob: float | None = None
                      ) -> CompletionOutput:
    """A CompletionOutput of a sequence's tokens (cumulative_logprob: given where the tokens are a
    delta, else summed from logprobs)."""
    if cumulative_logprob is None and logprobs is not None:
        cumulative_logprob = sum(entry.logprob for entry in logprobs)
    return CompletionOutput(index, text, list(token_ids), cumulative_logprob, token_logprobs(logprobs),
                            finish_reason, stop_reason)
