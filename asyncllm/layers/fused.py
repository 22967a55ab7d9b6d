"""Which Triton kernels the layers may use: on CUDA tensors when Triton is installed.
The plain PyTorch code in each layer (forward_native, F.linear) is the reference and the CPU path.

The kernel modules are imported on the first CUDA tensor, not with the package: CPU users never
import Triton, and tests can still choose Triton's interpreter before it is loaded.
"""
from __future__ import annotations

import importlib

import torch

_modules: dict[str, object] = {}  # kernel module name -> the module, or None without Triton


def kernel_module(name: str):
    """asyncllm.kernels.<name>, or None where Triton is not installed. Imported once."""
    if name not in _modules:
        try:
            _modules[name] = importlib.import_module(f"asyncllm.kernels.{name}")
        except ImportError:  # no Triton: every layer keeps its PyTorch path
            _modules[name] = None
    return _modules[name]


def fused_ops_for(x: torch.Tensor):
    """The fused-kernels module if x can use it, else None."""
    return kernel_module("fused_ops") if x.is_cuda else None
