"""Attention backends: the one place where the CPU and GPU paths differ.

A backend owns the paged KV cache views, turns a step's ForwardBatch into whatever metadata its
kernels want (prepare_metadata), and, for CUDA graphs, owns the static metadata buffers that a
captured step reads (prepare_for_capture / prepare_for_replay), or uses the decode graphs' ones
the runner gives it (init_cuda_graph_state's decode_buffers: the runner stages a decode step's
inputs and metadata in one copy). The runner never looks inside.

This module is the registry. The GPU backends are imported when asked for: they import Triton
or FlashAttention, which CPU users need not have.
"""
from __future__ import annotations

import torch

from asyncllm.attention.base import AttentionBackend, ForwardBatch
from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.config import config_error

__all__ = ["AttentionBackend", "ForwardBatch", "create_attention_backend"]


def create_attention_backend(name: str, device: torch.device, **kwargs) -> AttentionBackend:
    if name == "auto":
        name = _auto_backend(device)
    if name == "torch":
        return TorchAttentionBackend(**kwargs)
    if device.type != "cuda":
        raise config_error("attention_backend", f"{name!r} needs a CUDA device; use 'torch' or 'auto' on CPU")
    if name == "triton":
        from asyncllm.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(**kwargs)
    if name == "fa4":
        from asyncllm.attention.flash_attn_backend import FA4AttentionBackend
        return FA4AttentionBackend(**kwargs)
    if name == "fa2":
        from asyncllm.attention.flash_attn_backend import FA2AttentionBackend
        return FA2AttentionBackend(**kwargs)
    raise config_error("attention_backend", f"unknown backend {name!r}")


def _auto_backend(device: torch.device) -> str:
    # triton even where FA4 is installed: it serves faster end to end, because its mixed steps replay
    # CUDA graphs while FA4's prefill runs eagerly, which makes FA4's time to first token host-bound
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
        return "triton"
    except ImportError:
        return "torch"
