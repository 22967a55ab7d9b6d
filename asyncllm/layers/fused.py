"""Which Triton kernels the layers may use: on CUDA tensors when Triton is installed.
The plain PyTorch code in each layer (forward_native) is the reference and the CPU path.

A kernels module is imported on its first use, not with the package: CPU users never import
Triton, and tests can still choose Triton's interpreter before it is loaded.
"""
from __future__ import annotations

import importlib

import torch

_modules: dict[str, object] = {}  # name -> asyncllm.kernels.<name>, or None without Triton


def kernel_module(name: str):
    """asyncllm.kernels.<name>, imported once; None where Triton is not installed."""
    if name not in _modules:
        try:
            _modules[name] = importlib.import_module(f"asyncllm.kernels.{name}")
        except ImportError:  # no Triton: every layer keeps its PyTorch path
            _modules[name] = None
    return _modules[name]


def fused_ops_for(x: torch.Tensor):
    """The fused-kernels module (kernels/fused_ops.py) if x can use it, else None."""
    return kernel_module("fused_ops") if x.is_cuda else None


def logits_ops_for(logits: torch.Tensor):
    """The in-place logits kernels (kernels/logits_ops.py) if logits can use them, else None."""
    return kernel_module("logits_ops") if logits.is_cuda else None


def fused_moe_for(x: torch.Tensor):
    """The grouped-GEMM experts kernel (kernels/fused_moe.py) if x can use it, else None."""
    return kernel_module("fused_moe") if x.is_cuda else None


def skinny_moe_for(x: torch.Tensor):
    """The experts kernel for 1..16 tokens (kernels/skinny_moe.py) if x can use it, else None."""
    return kernel_module("skinny_moe") if x.is_cuda else None


def moe_router_for(x: torch.Tensor, num_experts: int):
    """The router's softmax and top-k in one kernel (kernels/moe_router.py) if x can use it with
    num_experts experts, else None."""
    module = kernel_module("moe_router") if x.is_cuda else None
    return module if module is not None and num_experts <= module.MAX_EXPERTS else None
