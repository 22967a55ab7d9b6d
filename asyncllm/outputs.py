"""What generation hands back per token beside its id (imports nothing of the package: the engine
makes these, the API layers pass them on)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprob:
    """One generated (or prompt) token's log-probability under the model's raw distribution (before
    penalties, biases and temperature), its rank there, and the top alternatives asked for."""
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token id, log-prob), most likely first; as many as were asked for
    # decoded text of token_id and of each top token, filled in where text is made (streams, LLM)
    token: str | None = None
    top_tokens: list[str] | None = None
