"""Every attention backend takes what the runner gives a backend. The CPU suite builds only the torch
backend; a keyword that the runner passes and a CUDA backend does not take fails only on a GPU (the
FP8 cache's rotate_qk did: every CUDA engine failed at start-up), so each backend's signature is held
here to the keywords a CPU engine's start-up passed."""
from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    # before this file's import of the Triton backend (the first `import triton` of a CPU run, which
    # collects it first): the kernel tests that follow run Triton's interpreter, fixed at that import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from asyncllm import LLM  # noqa: E402
from asyncllm.attention import base  # noqa: E402
from asyncllm.attention.flash_attn_backend import FA2AttentionBackend, FA4AttentionBackend  # noqa: E402
from asyncllm.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from asyncllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from asyncllm.runner import model_runner  # noqa: E402


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_every_backend_takes_the_runners_keywords(tiny_qwen3, monkeypatch, kv_cache_dtype):
    given = []
    real = model_runner.create_attention_backend

    def recording(name, device, **kwargs):
        given.append(kwargs)
        return real(name, device, **kwargs)
    monkeypatch.setattr(model_runner, "create_attention_backend", recording)
    llm = LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=64,
              kv_cache_dtype=kv_cache_dtype)
    llm.close()
    assert given and any(kwargs.get("rotate_qk") for kwargs in given) == (kv_cache_dtype == "fp8")
    for backend in (TorchAttentionBackend, TritonAttentionBackend, FA4AttentionBackend, FA2AttentionBackend):
        assert issubclass(backend, base.AttentionBackend)
        for kwargs in given:
            inspect.signature(backend).bind(**kwargs)  # a TypeError names the keyword the backend lacks
