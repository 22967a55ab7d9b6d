"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A batch-1 decode step is a chain of ~250 kernels of a few microseconds each, and between two of
them the GPU drains the first and then starts the second's blocks. With PDL the next kernel is
launched while the previous one still runs: its blocks wait in `griddepcontrol.wait` until the
previous kernel has finished and its writes are visible. What a block does before that wait
overlaps the previous kernel: the skinny GEMM loads its first weight tile there (weights are no
kernel's output), so a projection's first trip to memory hides behind the small kernel before it;
the norms load their weights there, the q/k norm + rotary its position's cos / sin row, and the
decode attention its metadata, (on small grids) the first tile of the KV it attends to and, where
it does the q/k norm + rotary itself, what that kernel would read before its wait, so that what
follows the wait is one round trip to memory, not a chain of them.

The contract for a kernel that takes a USE_PDL constexpr:
- `wait_for_previous(USE_PDL)` before it reads anything an earlier kernel wrote and before any
  store, in every program (a program that returned before it would let a later kernel's wait pass
  before this kernel's predecessor finished). Only reads of what no kernel of the step's chain
  writes may come first: weights; the step's metadata (positions, slots, sequence lengths, block
  tables, query offsets), which is copied in before the step's first kernel, the embedding, a
  PyTorch kernel that starts only when every copy before it has ended and launches no kernel
  early; and KV-cache rows of a decode's earlier positions, which earlier steps wrote (its own
  position's row is stored by the q/k norm + rotary kernel of the same step: after the wait; or
  made by the decode kernel itself, which then never reads it from the cache);
- `launch_dependents(USE_PDL)` first thing, before the wait: the next kernel is launched as soon
  as every block of this one has started, and it still waits for all of this one to finish (its
  wait passes only when this kernel has, which passes only after its own predecessor), so the
  trigger is safe anywhere; the earlier it comes, the more of the next kernel's start overlaps.
The wrapper launches it with `**launch_options(tensor)`: USE_PDL and `launch_pdl` alike. A kernel
that never calls launch_dependents (the prefill kernel) lets the next one launch when it ends.

On by default on sm_90+ GPUs; ASYNCLLM_PDL=0 turns it off (to compare).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from asyncllm import settings

# read once, into a global: every kernel launch of a step asks enabled_for, and set_enabled switches it
_enabled = settings.PDL.read()


def set_enabled(enabled: bool) -> None:
    """Switch PDL on or off for the kernels launched from now on (ASYNCLLM_PDL sets the default)."""
    global _enabled
    _enabled = enabled


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled_for(x: torch.Tensor) -> bool:
    """Whether a kernel reading x launches with PDL: on, a CUDA tensor, an sm_90+ device."""
    return _enabled and x.is_cuda and _device_supports(x.device.index or 0)


def launch_options(x: torch.Tensor) -> dict[str, bool]:
    """A PDL kernel's launch keywords for a launch reading x: its USE_PDL constexpr and Triton's
    launch_pdl, which must agree (a kernel launched with PDL that skipped its wait would race)."""
    on = enabled_for(x)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
