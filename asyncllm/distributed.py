"""Tensor-parallel process state: this process's rank in the tensor-parallel group."""
from __future__ import annotations

import torch
import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    if get_tp_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard along the last dimension."""
    size = get_tp_size()
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=-1)
