"""Which fused Triton kernels the layers may use: on CUDA tensors when Triton is installed.
The plain PyTorch code in each layer is the reference and the CPU path."""
from __future__ import annotations

import torch

try:
    from asyncllm.kernels import fused_ops
except ImportError:  # no Triton: every layer keeps its PyTorch path
    fused_ops = None


def use_fused(x: torch.Tensor) -> bool:
    return fused_ops is not None and x.is_cuda
