"""Per-request embedding settings: how a prompt's hidden states become one vector."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """pooling: "last" takes the final-norm hidden state of the prompt's last token (decoder
    embedding models such as Qwen3-Embedding are trained for it); "mean" averages it over every
    prompt token. dimensions: keep the vector's first `dimensions` entries (Matryoshka
    representation learning, as Qwen3-Embedding and OpenAI's text-embedding-3 shorten vectors;
    meaningful only for models trained for it), before normalize. normalize: scale the vector to
    unit L2 norm. Frozen: a request keeps the object it was checked with."""
    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self):
        if not isinstance(self.pooling, str) or self.pooling not in POOLING_METHODS:
            shown = repr(self.pooling)[:80]
            raise ValueError(f"pooling: expected one of {', '.join(map(repr, POOLING_METHODS))}, got {shown}")
        if not isinstance(self.normalize, bool):
            raise TypeError(f"normalize: expected a bool, got {type(self.normalize).__name__}")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
                raise TypeError(f"dimensions: expected an int or None, got {type(self.dimensions).__name__}")
            if self.dimensions < 1:
                raise ValueError(f"dimensions: expected an int >= 1, got {shown_int(self.dimensions)}")


def shown_int(value: int) -> str:
    """An int for a message: whole unless it is too long to print (10**400)."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"
