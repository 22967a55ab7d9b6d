"""Checks of the plain arguments of AsyncLLMEngine's and LLM's public methods, made at the call: each
refusal is an InvalidTypeError (a TypeError: wrong type) or InvalidValueError (a ValueError: wrong
value) naming the argument, so that nothing a caller passes reaches the engine thread unchecked. A
request's prompt and sampling fields are checked where they always were (EngineCore.encode_prompt /
check_request, SamplingParams); chat messages in chat_template.py."""
from __future__ import annotations

import math

from asyncllm.errors import InvalidTypeError, InvalidValueError


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidTypeError(name, f"expected a bool, got {type(value).__name__}")
    return value


def check_str(value, name: str) -> str:
    if not isinstance(value, str):
        raise InvalidTypeError(name, f"expected a string, got {type(value).__name__}")
    return value


def check_request_id(request_id, name: str = "request_id") -> str:
    if not isinstance(request_id, str):
        raise InvalidTypeError(name, f"expected a non-empty string, got {type(request_id).__name__}")
    if not request_id:
        raise InvalidValueError(name, "expected a non-empty string, got ''")
    # an exact str: the engine thread keys its dicts by it, and a subclass's own __hash__ or __eq__
    # would run there (str.__str__ of a subclass returns a plain copy)
    return str.__str__(request_id)


def check_seconds(value, name: str) -> float:
    """A finite number of seconds > 0 (a wait's polling interval)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(name, f"expected a number of seconds, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not (0 < seconds < math.inf):
        raise InvalidValueError(name, f"expected a finite number of seconds > 0, got {seconds!r}")
    return seconds
