"""Small host arrays to the device in one copy.

A step's sampling settings are a handful of short arrays (temperatures, noise keys, penalty rows, ...).
Each torch.tensor(...).to(device) from pageable memory costs the host tens of microseconds on CUDA;
packed into one pinned buffer they take one non-blocking copy. The pinned buffer comes from torch's
caching host allocator, which keeps it from reuse until the copy has run.
"""
from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # bytes: every array starts aligned for any dtype (and for Triton's pointer specialization)
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


def upload_arrays(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays (int64, int32 or float32) as tensors on device, through one copy on CUDA."""
    if device.type != "cuda":
        return [torch.from_numpy(np.array(a)) for a in arrays]  # copies: the caller may reuse its arrays
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    host_bytes = host.numpy()
    for a, offset in zip(arrays, offsets):
        host_bytes[offset:offset + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
    on_device = host.to(device, non_blocking=True)
    return [on_device[offset:offset + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, offset in zip(arrays, offsets)]
