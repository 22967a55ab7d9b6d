import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.fused import fused_ops, use_fused


class SiluAndMul(nn.Module):
    """SwiGLU's gate: silu(gate) * up, with gate and up concatenated on the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return fused_ops.silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
