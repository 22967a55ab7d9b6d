"""What generation hands back beside the token ids: each token's log-probability, each sequence's
finish reason (imports nothing of the package: the engine makes these, the API layers pass them on)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a sequence ended. A str (StrEnum: str(), f-strings and JSON give the value), so that
    `out.finish_reason == "stop"`, JSON encoding and the server's OpenAI fields see the plain value."""
    STOP = "stop"  # an EOS or stop token, a stop string, or a grammar that allows nothing more
    LENGTH = "length"  # max_tokens, or the engine's length limit
    ABORT = "abort"  # aborted (a caller, a dropped stream, shutdown), or no token its constraints allow
    TIMEOUT = "timeout"  # its SamplingParams.timeout passed while it generated: the tokens so far


class TokenLogprob:
    """One generated (or prompt) token's log-probability under the model's raw distribution (before
    penalties, biases and temperature), its rank there, and the top alternatives asked for.

    One object per token and nothing more: the alternatives stay in the step's arrays (top_ids and
    top_logprobs may be rows of them) and `top` / `top_tokens` are made when read. A request with
    logprobs=5 would otherwise leave eight tracked objects per token, and the garbage collector's
    passes over them cost more than the rest of the step's host work."""
    __slots__ = ("token_id", "logprob", "rank", "top_ids", "top_logprobs", "_texts")

    def __init__(self, token_id: int, logprob: float, rank: int, top_ids: Sequence[int] = (),
                 top_logprobs: Sequence[float] = ()):
        self.token_id = token_id
        self.logprob = logprob
        self.rank = rank  # 1 = the most likely token
        self.top_ids = top_ids  # most likely first; as many as were asked for
        self.top_logprobs = top_logprobs
        self._texts: Mapping[int, str] | None = None

    @property
    def token(self) -> str | None:
        """The decoded text of token_id (None until the texts are set, where text is made: streams, LLM)."""
        return None if self._texts is None else self._texts[self.token_id]

    @property
    def token_bytes(self) -> bytes | None:
        """token_id's own bytes: a token that holds part of a UTF-8 character gives that part, where
        its text shows U+FFFD (None until the texts are set)."""
        return None if self._texts is None else _bytes_of(self._texts, self.token_id)

    @property
    def top_token_bytes(self) -> list[bytes] | None:
        """The same for each top alternative (None until the texts are set)."""
        return None if self._texts is None else [_bytes_of(self._texts, i) for i in self.top_token_ids]

    @property
    def top(self) -> list[tuple[int, float]]:
        """(token id, log-prob) of each top alternative, most likely first."""
        return list(zip(self.top_token_ids, _as_list(self.top_logprobs)))

    @property
    def top_token_ids(self) -> list[int]:
        """The top alternatives' token ids, most likely first."""
        return _as_list(self.top_ids)

    @property
    def top_tokens(self) -> list[str] | None:
        """The decoded text of each top alternative (None until the texts are set)."""
        return None if self._texts is None else [self._texts[token_id] for token_id in self.top_token_ids]

    def set_texts(self, texts: Mapping[int, str]) -> None:
        """Decoded texts by token id (detokenizer.TokenTexts: each decoded on first lookup)."""
        self._texts = texts

    def __eq__(self, other) -> bool:
        if not isinstance(other, TokenLogprob):
            return NotImplemented
        return (self.token_id, self.logprob, self.rank, self.top, self.token) == \
            (other.token_id, other.logprob, other.rank, other.top, other.token)

    __hash__ = None  # mutable (its texts are set later), as the dataclass it replaced

    def __repr__(self) -> str:
        return (f"TokenLogprob(token_id={self.token_id}, logprob={self.logprob}, rank={self.rank}, top={self.top}, "
                f"token={self.token!r})")


def _bytes_of(texts: Mapping[int, str], token_id: int) -> bytes:
    bytes_of = getattr(texts, "bytes_of", None)  # detokenizer.TokenTexts; a plain mapping has texts only
    return texts[token_id].encode("utf-8") if bytes_of is None else bytes_of(token_id)


def _as_list(values: Sequence) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)
