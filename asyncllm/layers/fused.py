"""Which fused Triton kernels the layers may use: on CUDA tensors when Triton is installed.
The plain PyTorch code in each layer (forward_native) is the reference and the CPU path.

The kernels module is imported on the first CUDA tensor, not with the package: CPU users never
import Triton, and tests can still choose Triton's interpreter before it is loaded.
"""
from __future__ import annotations

import torch

_fused_ops = _logits_ops = None
_looked = False


def _load() -> None:
    global _fused_ops, _logits_ops, _looked
    _looked = True
    try:
        from asyncllm.kernels import fused_ops, logits_ops
        _fused_ops, _logits_ops = fused_ops, logits_ops
    except ImportError:  # no Triton: every layer keeps its PyTorch path
        pass


def fused_ops_for(x: torch.Tensor):
    """The fused-kernels module (kernels/fused_ops.py) if x can use it, else None."""
    if not x.is_cuda:
        return None
    if not _looked:
        _load()
    return _fused_ops


def logits_ops_for(logits: torch.Tensor):
    """The in-place logits kernels (kernels/logits_ops.py) if logits can use them, else None."""
    if not logits.is_cuda:
        return None
    if not _looked:
        _load()
    return _logits_ops
