"""Attention backends: the one place where the CPU and GPU paths differ.

A backend owns the paged KV cache views, turns a step's ForwardBatch into whatever metadata its
kernels want (prepare_metadata), and, for CUDA graphs, owns the static metadata buffers that a
captured decode step reads (prepare_for_capture / prepare_for_replay). The runner never looks
inside.
"""
from asyncllm.attention.base import AttentionBackend, ForwardBatch, create_attention_backend

__all__ = ["AttentionBackend", "ForwardBatch", "create_attention_backend"]
