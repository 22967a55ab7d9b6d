"""The engine's options as LLM, AsyncLLMEngine and the CLIs take them: checked, defaulted and
resolved into a Config."""
from __future__ import annotations

import dataclasses

from asyncllm.config import Config
from asyncllm.errors import InvalidTypeError
from asyncllm.models.default_model import default_model_path
from asyncllm.models.resolve import resolve_config


def make_config(model, options: dict) -> Config:
    """A resolved Config from a model (None: the built-in default model) and keyword options."""
    known = {f.name for f in dataclasses.fields(Config) if f.init} - {"model"}
    unknown = sorted(set(options) - known)
    if unknown:
        others = f" (so are {unknown[1:]})" if len(unknown) > 1 else ""
        raise InvalidTypeError(unknown[0], f"unknown engine option{others}; known: {sorted(known)}")
    if model is None:
        model = default_model_path()
    return resolve_config(Config(model=model, **options))
