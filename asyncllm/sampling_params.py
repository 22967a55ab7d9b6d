"""Per-request generation settings."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        def fail(name: str, message: str) -> None:
            raise ValueError(f"SamplingParams.{name}: {message}")

        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_number(value) or math.isnan(value) or math.isinf(value):
                fail(name, f"expected a finite number, got {value!r}")
        if self.temperature < 0:
            fail("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature != 0 and self.temperature < 1e-5:
            fail("temperature", f"must be 0 (greedy) or >= 1e-5, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("top_k", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                fail(name, f"expected an int, got {value!r}")
        if self.top_k == 0 or self.top_k < -1:
            fail("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.top_k >= 1 << 63:  # the sampler's int64 tensor; any top_k >= the vocabulary means all tokens
            fail("top_k", f"must be < 2**63, got {self.top_k}")
        if self.max_tokens < 1:
            fail("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", f"expected a bool, got {self.ignore_eos!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            fail("include_stop_str_in_output", f"expected a bool, got {self.include_stop_str_in_output!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            fail("seed", f"expected an int or None, got {self.seed!r}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:  # torch.Generator's range
            fail("seed", f"must be in [-2**63, 2**64), got {self.seed}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            fail("seed", f"must be in [-2**63, 2**64), got {self.seed}")
        if isinstance(self.stop_token_ids, int) and not isinstance(self.stop_token_ids, bool):
            self.stop_token_ids = [self.stop_token_ids]
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", f"expected a list of non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            fail("stop", f"expected a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            fail("stop", "stop strings must not be empty")
        self.stop = list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
