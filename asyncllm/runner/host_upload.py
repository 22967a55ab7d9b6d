"""A step's small host arrays to the device in one copy.

A step's inputs (token ids, positions, slots, block tables, ...) and its sampling settings
(temperatures, noise keys, penalty rows, ...) are a dozen short arrays. Each torch.tensor(...).to(device)
from pageable memory costs the host tens of microseconds on CUDA, and at batch 1 the host's work is
what a decode step waits for; packed into one pinned buffer they take one non-blocking copy. The
pinned buffer comes from torch's caching host allocator, which keeps it from reuse until the copy
has run. Arrays of one dtype lie side by side, so each dtype's tensors come out of one split: a
slice and a view per array cost the host about as much as the copy.
"""
from __future__ import annotations

import numpy as np
import torch

# bytes: every array starts aligned for any dtype, and for Triton, which compiles a kernel variant
# per pointer alignment it meets (packed tightly, an array's alignment would follow the batch size
# and compile new variants mid-serving)
_ALIGN = 16
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


def upload_arrays(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays (int64, int32 or float32) as tensors on device, in order, through one copy on CUDA.
    The tensors never share memory with the arrays (the caller may reuse them)."""
    if not arrays:
        return []  # no copy at all (a greedy step's sampling settings)
    if device.type != "cuda":
        return [torch.from_numpy(np.array(a)) for a in arrays]
    groups: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype, []).append(i)
    spans, offsets, total = [], [0] * len(arrays), 0  # per dtype: (dtype, indices, first byte, end, split sizes)
    for dtype, indices in groups.items():
        per_align = _ALIGN // dtype.itemsize
        start, sizes = total, []
        for i in indices:
            n = arrays[i].size
            padded = -(-n // per_align) * per_align
            offsets[i] = total
            sizes += (n, padded - n)
            total += padded * dtype.itemsize
        spans.append((dtype, indices, start, total, sizes))
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    host_bytes = host.numpy()
    for a, offset in zip(arrays, offsets):
        host_bytes[offset:offset + a.nbytes].view(a.dtype)[:] = a.ravel()
    on_device = host.to(device, non_blocking=True)
    out: list[torch.Tensor | None] = [None] * len(arrays)
    for dtype, indices, start, end, sizes in spans:
        pieces = on_device[start:end].view(_TORCH_DTYPES[dtype]).split(sizes)
        for j, i in enumerate(indices):
            shape = arrays[i].shape
            out[i] = pieces[2 * j] if len(shape) == 1 else pieces[2 * j].view(shape)
    return out
