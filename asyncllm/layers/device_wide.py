"""Device-wide work, one engine of the process at a time.

CUDA graph captures: torch captures on one stream that the whole process shares (torch.cuda.graph's
default capture stream), so two captures at once, from two engines' threads, would capture into
each other. The memory probe with the KV cache's allocation: two engines probing at once would
both count the same free memory, and both take it (runner/memory.py). torch.cuda.empty_cache frees
cached blocks device-wide. Each holds DEVICE_WIDE; captures use the thread-local capture mode, so
another engine's steps go on meanwhile (the default, global mode fails any thread's cudaMalloc or
synchronize during a capture). A device-wide synchronize or empty_cache from one engine's thread
while another engine captures still breaks that capture ("operation not permitted when stream is
capturing", seen with two engines starting at once on an H100), so both go through the lock too:
`synchronize` and `empty_cache` below are the package's only calls of torch's.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

# reentrant: start-up holds it from the probe to the last graph, and captures take it again inside
DEVICE_WIDE = threading.RLock()


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """torch.cuda.graph(graph, pool): the work queued inside is captured, and no other capture runs."""
    with DEVICE_WIDE, torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        yield


def synchronize(device=None) -> None:
    """torch.cuda.synchronize, never while another engine's thread captures a graph."""
    with DEVICE_WIDE:
        torch.cuda.synchronize(device)


def empty_cache() -> None:
    """torch.cuda.empty_cache (it frees device memory, which waits for the device), never during a capture."""
    with DEVICE_WIDE:
        torch.cuda.empty_cache()
