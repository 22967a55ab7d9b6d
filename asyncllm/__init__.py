"""asyncllm: an LLM inference engine to embed in Python applications.

The names below are imported on first use (PEP 562), so that `import asyncllm.config` or the
`asyncllm` command's --help does not import torch; `from asyncllm import LLM` works as before.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "AsyncLLMEngine": "asyncllm.async_engine", "StreamOutput": "asyncllm.streams", "RequestResult": "asyncllm.streams",
    "LLM": "asyncllm.llm", "Config": "asyncllm.config", "SamplingParams": "asyncllm.sampling_params",
    "StructuredOutput": "asyncllm.structured", "EngineDeadError": "asyncllm.errors",
    "PromptTooLongError": "asyncllm.errors", "QueueFullError": "asyncllm.errors", "FinishReason": "asyncllm.outputs",
    "RequestTimeoutError": "asyncllm.errors",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports them
    from asyncllm.async_engine import AsyncLLMEngine
    from asyncllm.config import Config
    from asyncllm.errors import EngineDeadError, PromptTooLongError, QueueFullError, RequestTimeoutError
    from asyncllm.llm import LLM
    from asyncllm.outputs import FinishReason
    from asyncllm.sampling_params import SamplingParams
    from asyncllm.streams import RequestResult, StreamOutput
    from asyncllm.structured import StructuredOutput


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
