from __future__ import annotations

import torch
from torch import nn

from asyncllm.layers.fused import fused_ops_for


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    With a residual it first adds it (x = x + residual) and returns the sum as the next residual,
    the pre-norm transformer's usual fused step.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        fused = fused_ops_for(x)
        if fused is not None:
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps)
            return fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return self.forward_native(x, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The plain PyTorch math: the CPU path and the fused kernel's reference."""
        if residual is None:
            return self._norm(x)
        x = (x.float() + residual.float()).to(x.dtype)
        return self._norm(x), x
