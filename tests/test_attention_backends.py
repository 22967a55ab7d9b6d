"""Every attention backend takes what the runner gives a backend. The CPU suite builds only the torch
backend; a keyword that the runner passes and a CUDA backend does not take fails only on a GPU (the
FP8 cache's rotate_qk did: every CUDA engine failed at start-up), so each backend's signature is held
here to the keywords a CPU engine's start-up passed."""
from __future__ import annotations

import inspect

import pytest

from asyncllm import LLM
from asyncllm.attention import base
from asyncllm.attention.flash_attn_backend import FA2AttentionBackend, FA4AttentionBackend
from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.attention.triton_backend import TritonAttentionBackend
from asyncllm.runner import model_runner


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
