"""Per-request generation settings."""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

from asyncllm.structured.spec import StructuredOutput

# bounds that keep stop-string matching cheap for everyone sharing the engine thread's loop
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_finite_float(value) -> float | None:
    """value as a float, or None when it is not a finite number (an int too large for a float too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


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
    # scheduling order, as vLLM's: lower values are admitted first and preempted last; ties go
    # first come first served
    priority: int = 0
    # constrained decoding: the output must match a JSON schema, any JSON object, a regex, a choice
    # or a grammar (a StructuredOutput, or a dict of its fields)
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        def fail(name: str, message: str) -> None:
            raise ValueError(f"SamplingParams.{name}: {message}")

        for name in ("temperature", "top_p", "min_p"):
            value = _as_finite_float(getattr(self, name))
            if value is None:
                fail(name, f"expected a finite number, got {_short_repr(getattr(self, name))}")
            setattr(self, name, value)
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
            if not _is_int(value):
                fail(name, f"expected an int, got {_short_repr(value)}")
        if self.top_k == 0 or self.top_k < -1:
            fail("top_k", f"must be -1 (disabled) or >= 1, got {_short_repr(self.top_k)}")
        if self.top_k >= 1 << 63:  # the sampler's int64 tensor; any top_k >= the vocabulary means all tokens
            fail("top_k", f"must be < 2**63, got {_short_repr(self.top_k)}")
        if self.max_tokens < 1:
            fail("max_tokens", f"must be >= 1, got {_short_repr(self.max_tokens)}")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", f"expected a bool, got {_short_repr(self.ignore_eos)}")
        if not isinstance(self.include_stop_str_in_output, bool):
            fail("include_stop_str_in_output", f"expected a bool, got {_short_repr(self.include_stop_str_in_output)}")
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", f"expected an int or None, got {_short_repr(self.seed)}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:  # torch.Generator's range
            fail("seed", f"must be in [-2**63, 2**64), got {_short_repr(self.seed)}")
        if not _is_int(self.priority):
            fail("priority", f"expected an int (lower is scheduled first), got {_short_repr(self.priority)}")
        if _is_int(self.stop_token_ids):
            self.stop_token_ids = [self.stop_token_ids]
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", f"expected a list of non-negative ints, got {_short_repr(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            fail("stop", f"expected a string or a list of strings, got {_short_repr(self.stop)}")
        if any(s == "" for s in self.stop):
            fail("stop", "stop strings must not be empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            fail("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
        self.stop = list(self.stop)
        if isinstance(self.structured_output, dict):
            try:
                self.structured_output = StructuredOutput.coerce(self.structured_output)
            except (TypeError, ValueError) as e:
                fail("structured_output", str(e))
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            fail("structured_output", f"expected a StructuredOutput, a dict of its fields or None, got "
                                      f"{_short_repr(self.structured_output)}")

    def snapshot(self) -> "SamplingParams":
        """A validated copy that owns its lists: what a request keeps, so that changing these
        params after submission cannot reach the engine thread."""
        # the schema dict too: the caller may change it after submission
        return dataclasses.replace(self, structured_output=copy.deepcopy(self.structured_output))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _short_repr(value, limit: int = 80) -> str:
    """repr for error messages: a 10,000-digit int or a huge list must not flood the log."""
    try:
        text = repr(value)
    except ValueError:  # int too large for str() (Python's digit limit)
        return f"an int of about {value.bit_length() * 30103 // 100000} digits"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
