from __future__ import annotations

import torch
from torch import nn

from asyncllm.attention.base import ForwardBatch


class Attention(nn.Module):
    """Paged attention over this layer's slice of the KV cache, through the step's backend."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return batch.attn_backend.forward(self.layer_id, q, k, v, batch)
