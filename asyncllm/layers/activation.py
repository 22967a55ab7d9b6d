import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.fused import fused_ops_for


class SiluAndMul(nn.Module):
    """SwiGLU's gate: silu(gate) * up, with gate and up concatenated on the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_ops_for(x)
        if fused is not None:
            return fused.silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
