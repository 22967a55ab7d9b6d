"""F.linear for weights kept in FP8: float8_e4m3fn (N, K) with float32 scales (N, G), one per output
row and group of group_k input columns (group_k None: G is 1, per-channel scales).

Per row, not per 128x128 block as checkpoints store them (models/fp8.py expands a block's scale over
its rows): a fused layer (q/k/v, gate/up) and a tensor-parallel shard then cut their scales exactly
where they cut their rows, whatever the block boundaries (gate/up with an intermediate size that is
not a multiple of 128, q/k/v with replicated KV heads). The cost is one float32 per row per group,
3% of the FP8 bytes at group 128.

Three paths, by the rows of x:
- 1..MAX_ROWS rows on CUDA (decode): the skinny GEMM kernel's weight-only form
  (kernels/skinny_gemm.py, W_SCALED), which reads the FP8 bytes and widens and scales them in
  registers: the time follows the bytes, half of bf16's. Its tiling is the rule's first
  candidate (no timing against cuBLAS: the alternative would first dequantize the whole matrix).
  The MLP's down projection takes the gated form (silu(gate) * up on load) in the FMA loop's
  tilings, the unfused pair in the dot loop's (where the gated form is mostly slower in bf16).
- more rows on CUDA with per-channel scales (sm_89+, bf16): W8A8 through torch._scaled_mm, x quantized
  per token (row) to e4m3 with a dynamic scale (amax / 448, kernels/fp8_quant.py: one launch), the
  product scaled by both rows' scales in fp32; or the dequantizing path below, whichever timed faster
  for this (N, K) and row bucket (ROUTE_BUCKETS): decided at the first eager call of the shape (the
  start-up's probe step), never in a dry run or a capture, kept in the start-up cache (_routes_for).
  Block-wise groups are a scale per K group, which a row-wise scaled GEMM cannot apply: those
  dequantize. e4m3 activations cost as much quality as e4m3 weights (a relative step of
  1/16 whatever the scale, so per-128-column activation scales gain little: docs/BENCHMARKS.md), so
  w8a8=False (Config(quantization="fp8_weight_only")) dequantizes instead, trading the FP8 GEMM's speed.
- otherwise (CPU, the reference; block-wise scales at prefill): dequantize to x's dtype (on CUDA one
  launch, kernels/fp8_quant.py), F.linear.
cuda_paths_on_cpu() makes CPU take CUDA's routes and arithmetic instead (benchmarks/bench_fp8_quality.py:
a teacher-forced prefill on CUDA is W8A8, not the weight-only arithmetic CPU's dequantizing path does).
Its W8A8 is written out in PyTorch, not CPU torch._scaled_mm: torch 2.11's CPU build takes per-tensor
scales only, and a failure there once turned CUDA's W8A8 off for the whole process.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from asyncllm.layers import skinny_linear
from asyncllm.layers.fused import kernel_module
from asyncllm.layers.parallel_compiles import in_dry_run, note_put_off

logger = logging.getLogger("asyncllm")

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_DTYPE = torch.float8_e4m3fn
_configs: dict[tuple, object] = {}  # (device, rows bucket, N, K, group_k) -> SkinnyConfig, or None: no tiling fits
_scaled_mm_broken = False  # CUDA torch._scaled_mm failed once (a build without row-wise scaling): dequantize
_cuda_paths_on_cpu = False  # cuda_paths_on_cpu()'s
WEIGHT_ONLY_MAX_ROWS = 16  # kernels/skinny_gemm.py's MAX_ROWS, for CPU's emulation of the routing (no Triton needed)
ROUTES = ("w8a8", "dequantize")  # above 16 rows; the start-up cache stores an index into this
# rows timed per shape: a call takes the route of the smallest bucket that holds its rows (more than
# the last: the last's; a GEMM that large is compute-bound, where W8A8's tensor cores win)
ROUTE_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048)
ROUTE_TIMING_REPS = 10  # GEMMs of tens of microseconds and more: a median of ten is steady
# W8A8 must be this much faster to be taken: its e4m3 activations cost quality (the module's doc),
# so a tie goes to the dequantizing path's weight-only arithmetic
ROUTE_MIN_GAIN = 0.03
_routes: dict[tuple, str] = {}  # (device, N, K, rows bucket) -> one of ROUTES


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """float32 amax / FP8_MAX, the same bits on every device (1 for an all-zero group). The quotient
    is formed in float64 and rounded once to float32: the correctly rounded float32 quotient, even
    where CUDA torch divides by a Python scalar as a multiply by its reciprocal. In float32 that
    multiply is 1 ulp off CPU's division for about half the rows (a reload's requantized scales on
    CUDA against a checkpoint made on CPU)."""
    return torch.where(amax > 0, (amax.double() / FP8_MAX).float(), torch.ones_like(amax))


def quantize_rows(weight: torch.Tensor, group_k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scales (rows, G)): each row's group of group_k columns (None: the
    whole row) scaled so that its largest magnitude maps to FP8_MAX; an all-zero group keeps scale 1."""
    rows, cols = weight.shape
    group = cols if group_k is None else group_k
    groups = -(-cols // group)
    weight = weight.to(torch.float32)
    if cols % group == 0:  # whole groups: views, no padded copy
        amax = weight.view(rows, groups, group).abs().amax(dim=-1)
    else:
        padded = torch.zeros(rows, groups * group, dtype=torch.float32, device=weight.device)
        padded[:, :cols] = weight
        amax = padded.view(rows, groups, group).abs().amax(dim=-1)
    scale = fp8_scales(amax)
    if cols % group == 0:
        quantized = (weight.view(rows, groups, group) / scale[:, :, None]).view(rows, cols)
    else:
        quantized = weight / _per_column(scale, group, cols)
    return quantized.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, group_k: int | None, dtype: torch.dtype) -> torch.Tensor:
    """weight (FP8) times its row scales, in dtype: the product taken in float32 and rounded once, as
    the weight-only kernel sees it (rounding the scale to bf16 first moved a whole row by up to 2**-9,
    and the product was rounded again: SmolLM2's mean KL 0.0591 against 0.0574, docs/BENCHMARKS.md)."""
    if weight.is_cuda and (kernels := kernel_module("fp8_quant")) is not None:
        return kernels.dequantize_rows(weight, scale, group_k, dtype)
    rows, cols = weight.shape
    if scale.shape[1] == 1:
        return (weight.to(torch.float32) * scale).to(dtype)
    if cols % group_k == 0:  # no (rows, cols) copy of the scales
        groups = scale.shape[1]
        return (weight.view(rows, groups, group_k).to(torch.float32) * scale[:, :, None]).view(rows, cols).to(dtype)
    return (weight.to(torch.float32) * _per_column(scale, group_k, cols)).to(dtype)


def _per_column(scale: torch.Tensor, group: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(group, dim=1)[:, :cols]


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int | None,
           bias: torch.Tensor | None = None, w8a8: bool = True) -> torch.Tensor:
    """F.linear(x, weight dequantized by scale, bias) by the path x's rows take (the module's doc);
    w8a8 False: never the W8A8 one (Config(quantization="fp8_weight_only"))."""
    if _cuda_paths_on_cpu and not x.is_cuda:
        return _cuda_path_emulated(x, weight, scale, group_k, bias, w8a8)
    kernels, config = _kernel_choice(x, weight, group_k)
    if config is not None:
        return kernels.skinny_gemm(x, weight, bias, config, scale=scale, group_k=group_k)
    if w8a8 and (group_k is None or scale.shape[1] == 1) and _route(x, weight, scale) == "w8a8":
        out = _scaled_mm_linear(x, weight, scale, bias)
        if out is not None:
            return out
    return F.linear(x, dequantize_rows(weight, scale, group_k, x.dtype), bias)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int | None,
                    bias: torch.Tensor | None = None, w8a8: bool = True) -> torch.Tensor:
    """linear(silu(gate) * up) of x = [gate | up]: the MLP's down projection."""
    kernels, config = _kernel_choice(x, weight, group_k)
    if config is not None and not config.dot:
        return kernels.skinny_gemm(x, weight, bias, config, gated=True, scale=scale, group_k=group_k)
    return linear(skinny_linear.silu_and_mul(x), weight, scale, group_k, bias, w8a8)


@contextlib.contextmanager
def cuda_paths_on_cpu():
    """Within it, FP8 layers on CPU compute what CUDA computes for the same rows: 1..16 rows the
    weight-only kernel's arithmetic (fp32 products of the widened, scaled weights, one rounding), more
    rows with per-row scales in bf16 W8A8 (the same per-token e4m3 activations, the exact e4m3 products
    summed and scaled in fp32, one rounding, then the bias), block-wise groups dequantized. Not the default: CPU's
    own path (dequantize, one bf16 GEMM) is several times faster there. The W8A8 product is computed
    in PyTorch (_w8a8_emulated), whatever CPU torch's _scaled_mm supports."""
    global _cuda_paths_on_cpu
    previous, _cuda_paths_on_cpu = _cuda_paths_on_cpu, True
    try:
        yield
    finally:
        _cuda_paths_on_cpu = previous


def _cuda_path_emulated(x, weight, scale, group_k, bias, w8a8):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= WEIGHT_ONLY_MAX_ROWS:
        out = F.linear(x.float(), dequantize_rows(weight, scale, group_k, torch.float32),
                       None if bias is None else bias.float())
        return out.to(x.dtype)
    if w8a8 and (group_k is None or scale.shape[1] == 1) and _scaled_mm_shapes(x, weight):
        return _w8a8_emulated(x, weight, scale, bias)
    return F.linear(x, dequantize_rows(weight, scale, group_k, x.dtype), bias)


def _w8a8_emulated(x, weight, scale, bias):
    """_scaled_mm_linear's arithmetic in PyTorch: e4m3 x e4m3 products are exact in fp32, summed in
    fp32 (another order than the tensor cores'), scaled by both rows' scales, rounded once to x's
    dtype; the bias added after, in x's dtype, as _scaled_mm_linear adds it."""
    x2 = x.reshape(-1, x.shape[-1])
    quantized, x_scale = _quantize_per_token(x2)
    out = ((quantized.float() @ weight.float().t()) * x_scale * scale.view(1, -1)).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _kernel_choice(x: torch.Tensor, weight: torch.Tensor, group_k: int | None):
    """(the kernels module, the weight-only tiling for x's rows), or (None, None)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (rows and skinny_linear.kernel_enabled_for(x)):
        return None, None
    kernels = kernel_module("skinny_gemm")
    if kernels is None or rows > kernels.MAX_ROWS:
        return None, None
    n, k = weight.shape
    key = (x.device, 1 << (rows - 1).bit_length(), n, k, group_k)
    config = _configs.get(key, False)
    if config is False:
        candidates = kernels.fp8_candidate_configs(rows, n, k, skinny_linear.num_sms(x.device), group_k)
        config = _configs[key] = candidates[0] if candidates else None
        logger.debug("FP8 skinny GEMM for %d rows x (%d, %d), group %s: %s", rows, n, k, group_k,
                     "dequantize" if config is None else config.label())
    return kernels, config


def _route(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> str:
    """ROUTES' choice for x's rows (above the weight-only kernel's) on a per-row-scaled weight."""
    if _scaled_mm_broken or not (x.is_cuda and _scaled_mm_shapes(x, weight)):
        return "dequantize"
    key = (x.device, *weight.shape, route_bucket(x.numel() // x.shape[-1]))
    route = _routes.get(key)
    if route is not None:
        return route
    if torch.cuda.get_device_capability(x.device) < (8, 9):  # no FP8 tensor cores
        route = _routes[key] = "dequantize"
        return route
    if torch.cuda.is_current_stream_capturing():  # no timing inside a capture; an eager call decides later
        return "w8a8"
    if in_dry_run():  # nor in a dry run, whose kernels may not run: the real run decides
        note_put_off()
        return "w8a8"
    _routes.update(_routes_for(x.device, weight, scale, measure_route))
    return _routes[key]


def route_bucket(rows: int) -> int:
    """The smallest of ROUTE_BUCKETS (powers of two) that holds rows; the largest above it."""
    return min(max(1 << (rows - 1).bit_length(), ROUTE_BUCKETS[0]), ROUTE_BUCKETS[-1])


def _routes_for(device: torch.device, weight: torch.Tensor, scale: torch.Tensor, measure) -> dict[tuple, str]:
    """Every ROUTE_BUCKETS' route for weight's (N, K): the start-up cache's answer where it has a valid
    one, else measure(x, weight, scale)'s (an index into ROUTES) on bf16 rows of that many."""
    n, k = weight.shape
    scratch = []  # the rows timed: made once, and only where something is measured

    def rows(bucket: int) -> torch.Tensor:
        if not scratch:
            scratch.append(torch.randn(ROUTE_BUCKETS[-1], k, device=device, dtype=torch.bfloat16))
        return scratch[0][:bucket]

    routes = {}
    for bucket in ROUTE_BUCKETS:
        question = {"shape": [n, k], "rows": bucket, "candidates": list(ROUTES)}
        index = skinny_linear.startup_decisions().remembered(
            "FP8 GEMM route", question, lambda bucket=bucket: measure(rows(bucket), weight, scale),
            valid=lambda i: type(i) is int and 0 <= i < len(ROUTES))
        routes[(device, n, k, bucket)] = ROUTES[index]
        logger.debug("FP8 GEMM for %d rows x (%d, %d): %s", bucket, n, k, ROUTES[index])
    return routes


def measure_route(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> int:
    """The index in ROUTES of the faster of W8A8 and dequantize + bf16 GEMM on these tensors (timed as
    skinny_linear times its candidates, from a cold L2); dequantize where _scaled_mm fails here."""
    if _scaled_mm_linear(x, weight, scale, None) is None:
        return ROUTES.index("dequantize")
    times = skinny_linear.time_calls([lambda: _scaled_mm_linear(x, weight, scale, None),
                                      lambda: F.linear(x, dequantize_rows(weight, scale, None, x.dtype))],
                                     x.device, reps=ROUTE_TIMING_REPS)
    logger.debug("FP8 GEMM timings for %d rows x (%d, %d): W8A8 %.1f us, dequantize %.1f us", x.shape[0],
                 *weight.shape, times[0] * 1e3, times[1] * 1e3)
    return choose_route(times)


def choose_route(times: list[float]) -> int:
    """ROUTES' index given their times in ROUTES' order: W8A8 only where it is ROUTE_MIN_GAIN faster."""
    w8a8, dequantize = times[ROUTES.index("w8a8")], times[ROUTES.index("dequantize")]
    return ROUTES.index("w8a8" if w8a8 < (1 - ROUTE_MIN_GAIN) * dequantize else "dequantize")


def _scaled_mm_shapes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # bf16 only: row-wise scaled _scaled_mm outputs bf16 (an fp16 model dequantizes)
    n, k = weight.shape
    return x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def _quantize_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x2 in e4m3, float32 scales (rows, 1)): each row's amax mapped to FP8_MAX (on CUDA in one
    launch, kernels/fp8_quant.py; the PyTorch below is its reference and CPU's emulation)."""
    if x2.is_cuda and x2.stride(-1) == 1 and (kernels := kernel_module("fp8_quant")) is not None:
        return kernels.quantize_per_token(x2)
    # the correctly rounded amax / FP8_MAX, as the kernel's div_rn and CPU's division give it (fp8_scales' why)
    x_scale = (x2.abs().amax(dim=-1, keepdim=True).double() / FP8_MAX).float().clamp_min(1e-12)
    return (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), x_scale


def _scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """W8A8: x quantized per row with a dynamic scale, one FP8 tensor-core GEMM scaled by both rows'
    scales; None where torch._scaled_mm refuses (remembered: the dequantizing path from then on)."""
    global _scaled_mm_broken
    x2 = x.reshape(-1, x.shape[-1])
    quantized, x_scale = _quantize_per_token(x2)
    try:
        out = torch._scaled_mm(quantized, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    except (RuntimeError, NotImplementedError) as exc:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise
        _scaled_mm_broken = True
        logger.warning("FP8 GEMM: torch._scaled_mm with row-wise scales failed (%s: %s); FP8 weights are "
                       "dequantized for large batches instead", type(exc).__name__, str(exc)[:200])
        return None
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])
