"""A step's small host arrays to the device in one copy.

A step's inputs (token ids, positions, slots, block tables, ...) and its sampling settings
(temperatures, noise keys, penalty rows, ...) are a dozen short arrays. Each torch.tensor(...).to(device)
from pageable memory costs the host tens of microseconds on CUDA, and at batch 1 the host's work is
what a decode step waits for; packed into one pinned buffer they take one non-blocking copy. The
pinned buffer comes from torch's caching host allocator, which keeps it from reuse until the copy
has run. Each tensor is one slice of the copy seen as its dtype. Every tensor object costs the host
a few microseconds, so an upload costs about as many of those as it has arrays: fewer arrays, not
another way to cut them, makes it cheaper.
A decode graph's step makes none of them: it is staged into the graph's own buffers
(runner/decode_staging.py), and only what the staging layout has no place for comes here.
"""
from __future__ import annotations

import numpy as np
import torch

# bytes: every array starts aligned for any dtype, and for Triton, which compiles a kernel variant
# per pointer alignment it meets (packed tightly, an array's alignment would follow the batch size
# and compile new variants mid-serving)
_ALIGN = 16


def aligned_bytes(nbytes: int) -> int:
    """nbytes rounded up to the alignment every array of a copy starts at."""
    return -(-nbytes // _ALIGN) * _ALIGN
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


def upload_arrays(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays (int64, int32 or float32) as tensors on device, in order, through one copy on CUDA.
    The tensors never share memory with the arrays (the caller may reuse them)."""
    if not arrays:
        return []  # no copy at all (a greedy step's sampling settings)
    if device.type != "cuda":
        return [torch.from_numpy(np.array(a)) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += aligned_bytes(a.nbytes)
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    host_bytes = host.numpy()
    host_views: dict[np.dtype, np.ndarray] = {}  # the buffer as each dtype: one slice per array
    for a, offset in zip(arrays, offsets):
        typed = host_views.get(a.dtype)
        if typed is None:
            typed = host_views[a.dtype] = host_bytes.view(a.dtype)
        start = offset // a.itemsize
        typed[start:start + a.size] = a.ravel()
    on_device = host.to(device, non_blocking=True)
    device_views: dict[np.dtype, torch.Tensor] = {}
    out = []
    for a, offset in zip(arrays, offsets):
        typed = device_views.get(a.dtype)
        if typed is None:
            typed = device_views[a.dtype] = on_device.view(_TORCH_DTYPES[a.dtype])
        start = offset // a.itemsize
        piece = typed[start:start + a.size]
        out.append(piece if a.ndim == 1 else piece.view(a.shape))
    return out
