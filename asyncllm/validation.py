"""What every validator of a class's fields shares (SamplingParams, Config, StructuredOutput, vLLM's
SamplingParams): a refusal that carries the field it is about (errors.InvalidValueError), the checks
several of them make in the same words, and the value tests and reprs their messages use. Imports
nothing of the package but errors.py, nor torch."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NoReturn

from asyncllm.errors import InvalidValueError


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_finite_float(value) -> float | None:
    """value as a float, or None when it is not a finite number (an int too large for a float too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def short_repr(value, limit: int = 80) -> str:
    """repr for error messages: a 10,000-digit int or a huge list must not flood the log."""
    try:
        text = repr(value)
    except ValueError:  # int too large for str() (Python's digit limit)
        return f"an int of about {value.bit_length() * 30103 // 100000} digits"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


class FieldChecks:
    """The refusals of one class's fields: fail(field, reason) raises InvalidValueError naming the
    owner and the field ("SamplingParams.top_p: must be in (0, 1], got 0.0"; owner None: the
    field alone). show: how a refused
    value is quoted in the messages of the checks below."""

    def __init__(self, owner: str | None, show: Callable[[object], str] = repr):
        self.owner = owner
        self.show = show

    def error(self, field: str, reason: str) -> InvalidValueError:
        return InvalidValueError(field, reason, self.owner)

    def __call__(self, field: str, reason: str) -> NoReturn:
        raise self.error(field, reason)

    def expect_bool(self, field: str, value) -> None:
        if not isinstance(value, bool):
            self(field, f"expected a bool, got {self.show(value)}")

    def expect_int(self, field: str, value) -> None:
        if not is_int(value):
            self(field, f"expected an int, got {self.show(value)}")

    def one_of(self, field: str, value, choices: tuple) -> None:
        if not any(value is choice or (type(value) is type(choice) and value == choice) for choice in choices):
            self(field, f"must be one of {choices}, got {self.show(value)}")

    def finite_float(self, field: str, value) -> float:
        """value as a float; refused unless a finite number."""
        number = as_finite_float(value)
        if number is None:
            self(field, f"expected a finite number, got {self.show(value)}")
        return number

    def positive_seconds(self, field: str, value) -> float:
        """value, a duration that is set (None is the caller's to allow), as a float; refused unless a
        finite number of seconds > 0."""
        seconds = as_finite_float(value)
        if seconds is None or seconds <= 0:
            self(field, f"expected None or a finite number of seconds > 0, got {self.show(value)}")
        return seconds
