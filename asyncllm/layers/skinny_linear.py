"""F.linear for decode's few rows, through the skinny-GEMM kernel on the shapes where it beats cuBLAS.

Which one is faster depends on the shape, the row count and the GPU, so it is measured: the first
eager call of each (device, dtype, rows bucket, N, K, bias) times cuBLAS and the kernel's candidate
tilings on that call's own tensors (cold L2, CUDA events) and keeps the fastest for good. That
first call is the CUDA-graph warm-up's (an eager run before each capture), so the timing never
runs inside a capture and replays pay nothing; a shape first seen while capturing keeps cuBLAS.

On by default: on the H200 it took the 0.6B model's batch-1 time per token from 1.45 to 1.13 ms
(docs/BENCHMARKS.md run L). ASYNCLLM_SKINNY_GEMM=0 in the environment turns it off (cuBLAS everywhere).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from asyncllm.layers.fused import kernel_module

logger = logging.getLogger("asyncllm")

KERNEL_DEVICE_TYPES = ("cuda",)  # the tests add "cpu" to run the kernel through Triton's interpreter
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
MAX_CANDIDATES = 3  # tilings timed per shape: each is a compile at first start-up
TIMING_REPS = 25

MIN_GAIN = 0.03  # the kernel must be this much faster than cuBLAS: a tie within noise keeps cuBLAS

_enabled = os.environ.get("ASYNCLLM_SKINNY_GEMM", "1") != "0"
_UNDECIDED = object()
# (device, dtype, rows rounded up to a power of two, N, K, has bias) -> the kernel's SkinnyConfig, or None for cuBLAS
_choices: dict[tuple, object] = {}


def set_enabled(enabled: bool) -> None:
    """Switch the kernel on or off for this process (ASYNCLLM_SKINNY_GEMM sets the default)."""
    global _enabled
    _enabled = enabled


def is_enabled() -> bool:
    return _enabled


def choices() -> dict[tuple, object]:
    """The per-shape decisions made so far."""
    return dict(_choices)


def describe_choices() -> dict[str, str]:
    """The decisions made so far, readably: "4 rows x (N, K)[ + bias]" -> the tiling, or cuBLAS."""
    return {f"{rows} rows x ({n}, {k}){' + bias' if has_bias else ''}": "cuBLAS" if config is None else config.label()
            for (_, _, rows, n, k, has_bias), config in sorted(_choices.items(), key=lambda item: item[0][2:])}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); x with 1..16 rows on CUDA may take the skinny kernel."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows and _enabled and x.device.type in KERNEL_DEVICE_TYPES and x.dtype in KERNEL_DTYPES \
            and weight.dtype == x.dtype and weight.stride(-1) == 1:
        kernels = kernel_module("skinny_gemm")
        if kernels is not None and rows <= kernels.MAX_ROWS:
            key = (x.device, x.dtype, 1 << (rows - 1).bit_length(), weight.shape[0], weight.shape[1], bias is not None)
            config = _choices.get(key, _UNDECIDED)
            if config is _UNDECIDED:
                config = _decide(key, kernels, x, weight, bias)
            if config is not None:
                return kernels.skinny_gemm(x, weight, bias, config)
    return F.linear(x, weight, bias)


def _decide(key: tuple, kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # no timing inside a capture; not remembered, so an eager call still decides
    rows = x.numel() // x.shape[-1]
    candidates = kernels.candidate_configs(rows, weight.shape[0], weight.shape[1], _num_sms(x.device))
    config = choose_fastest(kernels, x, weight, bias, candidates[:MAX_CANDIDATES]) if x.is_cuda else candidates[0]
    _choices[key] = config
    logger.debug("skinny GEMM for %d rows x (%d, %d)%s: %s", rows, weight.shape[0], weight.shape[1],
                 " + bias" if bias is not None else "", "cuBLAS" if config is None else config.label())
    return config


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter's runs: any count does
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_fastest(kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   candidates: list) -> object:
    """The fastest of cuBLAS (None) and the kernel's candidate configs on these tensors. A
    candidate that fails to compile or run here (a tile past this GPU's shared memory, no bf16
    MMA) is left out, with a warning: cuBLAS is always there to fall back on."""
    usable, calls = [], []
    for config in candidates:
        call = lambda config=config: kernels.skinny_gemm(x, weight, bias, config)  # noqa: E731
        try:
            call()  # the compile
        except Exception as exc:  # noqa: BLE001 - any failure only drops this tiling
            logger.warning("skinny GEMM tiling %s for (%d, %d) left out: %s: %s", config.label(), weight.shape[0],
                           weight.shape[1], type(exc).__name__, str(exc)[:200])
            continue
        usable.append(config)
        calls.append(call)
    if not usable:
        return None
    times = time_calls([lambda: F.linear(x, weight, bias)] + calls, x.device)
    best = min(range(1, len(times)), key=times.__getitem__)
    return usable[best - 1] if times[best] < (1 - MIN_GAIN) * times[0] else None


def time_calls(calls: list, device: torch.device, reps: int = TIMING_REPS) -> list[float]:
    """Median device ms of each call, each run from a cold L2 (as decode meets its weights, the
    model being far larger than L2), the calls interleaved so that clock drift hits all alike.
    Each call is timed as a CUDA-graph replay where it can be captured: decode runs in graphs, and
    a few-microsecond kernel's eager timing can hold the tens of microseconds of Triton's Python
    launch (bench_gemm's eager figures swung 7.6 to 25.7 us on one shape, docs/BENCHMARKS.md run H)."""
    for call in calls:  # compile and warm up
        call()
    calls = [_graph_replay(call, device) for call in calls]
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    flush = torch.empty(2 * l2_bytes // 4, dtype=torch.int32, device=device)
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in calls]
    for rep in range(reps):
        for call, call_events in zip(calls, events):
            flush.zero_()
            start, end = call_events[rep]
            start.record()
            call()
            end.record()
    torch.cuda.synchronize(device)
    return [sorted(start.elapsed_time(end) for start, end in call_events)[reps // 2] for call_events in events]


def _graph_replay(call, device: torch.device):
    """call captured in a CUDA graph of its own, as its replay; call itself where capture fails."""
    try:
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graph.replay()
        return graph.replay
    except Exception as exc:  # noqa: BLE001 - timing eagerly is still a measurement
        logger.warning("skinny GEMM timing: capture failed (%s: %s); timing eagerly", type(exc).__name__,
                       str(exc)[:200])
        return call
