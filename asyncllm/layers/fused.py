"""Which fused Triton kernels the layers may use: on CUDA tensors when Triton is installed.
The plain PyTorch code in each layer (forward_native) is the reference and the CPU path.

The kernels module is imported on the first CUDA tensor, not with the package: CPU users never
import Triton, and tests can still choose Triton's interpreter before it is loaded.
"""
from __future__ import annotations

import torch

_fused_ops = None
_looked = False


def fused_ops_for(x: torch.Tensor):
    """The fused-kernels module if x can use it, else None."""
    global _fused_ops, _looked
    if not x.is_cuda:
        return None
    if not _looked:
        _looked = True
        try:
            from asyncllm.kernels import fused_ops
            _fused_ops = fused_ops
        except ImportError:  # no Triton: every layer keeps its PyTorch path
            _fused_ops = None
    return _fused_ops
