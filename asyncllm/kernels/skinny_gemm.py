"""y = x @ W^T (+ bias) for a few rows of x: decode's linear layers, which stream their weights.

At batch 1..16 a linear layer reads its whole weight matrix to compute a handful of outputs per
row: the time is the weight bytes over memory bandwidth, which cuBLAS's kernels for these skinny
shapes leave largely unused (bench_gemm.py measures both). Here each program
owns BLOCK_N output features and streams their weight rows in wide contiguous tiles along K,
accumulating in fp32; x's few rows are re-read from L2.

Two inner loops, a choice of the tiling (SkinnyConfig.dot):
- FMA (up to 4 rows): the products x[m, k] * W[n, k] are accumulated elementwise in a
  (BLOCK_M, BLOCK_N, BLOCK_K) fp32 tile and reduced over K once, after the loop, so the loop is
  loads and FMAs only, no cross-thread reductions.
- dot (1..16 rows): tl.dot of the weight tile with x^T (x padded to 16 rows), the weight rows as
  the MMA's M dimension, so the tensor cores do the 16-wide products; Triton pipelines its loads.
  The FMA loop has a grouped form (SkinnyConfig.grouped): each thread sums its 16-byte run of
  products before accumulating, an eighth of the accumulators and so more programs per SM; faster
  alone on the 8B shapes, but inside the decode step only for some (runner/decode_tuning.py).
Each program loads its first weight tile before waiting for the previous kernel (kernels/pdl.py):
with the previous kernels' early launch_dependents that load overlaps them, where a projection's
first memory round trip would otherwise be its own fixed cost, paid once per projection.
When the outputs are too few to give every SM programs (o_proj, down at 0.6B), split-K gives each
program a K range; the fp32 partial sums go to a workspace and a second small kernel adds them
(no atomics: deterministic, and nothing to zero first).

Gated (the MLP's down projection): x is the gate_up projection's output [gate | up], and each x
tile is computed as silu(gate) * up on load, rounded as fused_ops.silu_and_mul rounds, so the
SwiGLU's own launch and its output's round trip through memory disappear. Every program recomputes
the gate of its K range, so the layer times this form against the unfused pair too.

FP8 weights (weight-only; layers/fp8_linear.py): the same kernels read float8_e4m3fn weight tiles
(half the bytes of bf16) with a float32 scale per output row and group of `group_k` input columns
(one group: per-channel scales). W_SCALED widens each tile in registers: the FMA loop multiplies the
widened tile by its rows' scales before the products; the dot loop feeds the tile to the MMA in x's
dtype (e4m3 -> bf16/fp16 is exact) and scales the tile's fp32 partial sums. A K tile must lie inside
one scale group (fp8_candidate_configs caps block_k at group_k's largest power-of-two divisor).

Tilings come from candidate_configs, a small fixed rule per (rows, N, K) and its neighbours; the
layer that uses this kernel (asyncllm.layers.skinny_linear) times the first few against cuBLAS once
per shape, outside graph capture, and benchmarks/bench_gemm.py times them all.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

# _dot: the interpreter's bf16 tl.dot workaround, shared with the attention kernels
from asyncllm.kernels.fused_ops import _dot, _dot_config, _silu_mul
from asyncllm.kernels.host import cdiv, next_power_of_2
from asyncllm.kernels.pdl import launch_dependents, launch_options, wait_for_previous

MAX_ROWS = 16  # the dot loop's row tile; more rows go to cuBLAS, which is compute-efficient there
FMA_MAX_ROWS = 4  # the FMA loop's accumulators grow with the rows: above this, the dot loop only
FMA_GROUP = tl.constexpr(8)  # the FMA loop sums each thread's 16-byte run of bf16 products before accumulating


@dataclass(frozen=True)
class SkinnyConfig:
    dot: bool  # the inner loop: tl.dot (any row count) or FMA (up to FMA_MAX_ROWS rows)
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int = 3
    grouped: bool = False  # the FMA loop: each thread's 16-byte run of products summed before accumulating

    def label(self) -> str:
        return (f"{'dot' if self.dot else 'fma'} n{self.block_n} k{self.block_k} s{self.split_k} "
                f"w{self.num_warps} st{self.num_stages}{' grouped' if self.grouped else ''}")

    @classmethod
    def from_label(cls, label: str) -> SkinnyConfig:
        """The config label() printed (a benchmark's JSON keeps the choices so)."""
        match = re.fullmatch(r"(dot|fma) n(\d+) k(\d+) s(\d+) w(\d+) st(\d+)( grouped)?", label)
        if match is None:
            raise ValueError(f"not a skinny GEMM tiling label: {label!r} (e.g. 'fma n16 k512 s1 w4 st3 grouped')")
        loop, *numbers, grouped = match.groups()
        return cls(loop == "dot", *map(int, numbers), grouped=grouped is not None)


@triton.jit
def _store_result(acc, rows_m, rows_n, M, N, bias_ptr, out_ptr, partial_ptr, stride_om, pid_k,
                  SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    mask = (rows_m[:, None] < M) & (rows_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows_n, mask=rows_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows_m[:, None] * stride_om + rows_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:  # this split's fp32 partial sums, at partial[pid_k, m, n]
        offsets = (pid_k * M + rows_m[:, None]).to(tl.int64) * N + rows_n[None, :]
        tl.store(partial_ptr + offsets, acc, mask=mask)


@triton.jit
def _load_x(ptrs, mask, K, GATED: tl.constexpr):
    """An input tile: x's own, or where GATED silu(gate) * up, the up half K columns to the right of
    the gate in the row, rounded to x's dtype as the unfused silu_and_mul stores it (bit for bit)."""
    if GATED:
        gate = tl.load(ptrs, mask=mask, other=0.0)
        up = tl.load(ptrs + K, mask=mask, other=0.0)
        x = _silu_mul(gate, up).to(gate.dtype)  # masked lanes: silu(0) * 0 = 0, as the loads' zeros
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _scaled(w, scale_ptrs, group, mask, W_SCALED: tl.constexpr):
    """An FP8 weight tile widened to fp32 and multiplied by its rows' scales for K group `group`
    (scale_ptrs: the rows' scale rows, shaped to broadcast over the tile); any other tile as it is."""
    if W_SCALED:
        tile = w.to(tl.float32) * tl.load(scale_ptrs + group, mask=mask, other=0.0)
    else:
        tile = w
    return tile


@triton.jit
def _tile_dot(w, xt, scale_ptrs, group, mask, W_SCALED: tl.constexpr, UPCAST_DOT: tl.constexpr,
              PRECISION: tl.constexpr):
    """w @ x^T for one K tile in fp32; an FP8 tile goes to the MMA in x's dtype (exact) and its sums
    are scaled per row after (one multiply per output, not per weight)."""
    if W_SCALED:
        scale = tl.load(scale_ptrs + group, mask=mask, other=0.0)
        part = _dot(w.to(xt.dtype), xt, UPCAST_DOT, PRECISION) * scale[:, None]
    else:
        part = _dot(w, xt, UPCAST_DOT, PRECISION)
    return part


@triton.jit
def _fma_tile(x, w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPED: tl.constexpr):
    """The products of x (BLOCK_M, 1, BLOCK_K) and w (1, BLOCK_N, BLOCK_K) in fp32, to accumulate:
    elementwise, or where GROUPED summed over each run of FMA_GROUP neighbouring K columns first,
    (BLOCK_M, BLOCK_N, BLOCK_K // FMA_GROUP). A run is what one thread loads in one 16-byte access,
    so that sum stays in the thread (no shuffles), and the loop keeps an eighth of the accumulators:
    72 registers a thread for the 8B o_proj's n8 x k1024 tile against 127 (ptxas, sm_90), so more
    programs fit an SM. Which form is faster in a decode step is measured there (SkinnyConfig.grouped)."""
    products = x.to(tl.float32) * w.to(tl.float32)
    if GROUPED:
        products = tl.sum(tl.reshape(products, (BLOCK_M, BLOCK_N, BLOCK_K // FMA_GROUP, FMA_GROUP)), 3)
    return products


@triton.jit
def _skinny_fma_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, scale_ptr, M, N, K, stride_xm, stride_wn,
                       stride_om, stride_sn, group_k, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       GATED: tl.constexpr, GROUPED: tl.constexpr, W_SCALED: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # 3-D index vectors: x tiles are (BLOCK_M, 1, BLOCK_K), weight tiles (1, BLOCK_N, BLOCK_K); their
    # product broadcasts in registers with no layout conversion
    m3 = tl.arange(0, BLOCK_M)[:, None, None]
    n3 = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :, None]
    k3 = tl.arange(0, BLOCK_K)[None, None, :]
    x_ptrs = x_ptr + m3 * stride_xm + k3
    w_ptrs = w_ptr + n3.to(tl.int64) * stride_wn + k3
    m_mask = m3 < M
    n_mask = n3 < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # the first weight tile before the wait: no kernel writes weights, so it streams in while the
    # kernels before this one finish (kernels/pdl.py); an empty split's tile is all masked
    first_mask = n_mask & (k_start + k3 < k_end)
    scale_ptrs = scale_ptr + n3 * stride_sn
    w = tl.load(w_ptrs + k_start, mask=first_mask, other=0.0)
    w = _scaled(w, scale_ptrs, k_start // group_k, n_mask & (k_start < k_end), W_SCALED)
    launch_dependents(USE_PDL)
    wait_for_previous(USE_PDL)
    x = _load_x(x_ptrs + k_start, m_mask & (k_start + k3 < k_end), K, GATED)
    acc = _fma_tile(x, w, BLOCK_M, BLOCK_N, BLOCK_K, GROUPED)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        if EVEN_K:
            x = _load_x(x_ptrs + k0, m_mask, K, GATED)
            w = tl.load(w_ptrs + k0, mask=n_mask, other=0.0)
        else:
            k_mask = k0 + k3 < k_end
            x = _load_x(x_ptrs + k0, m_mask & k_mask, K, GATED)
            w = tl.load(w_ptrs + k0, mask=n_mask & k_mask, other=0.0)
        w = _scaled(w, scale_ptrs, k0 // group_k, n_mask, W_SCALED)
        acc += _fma_tile(x, w, BLOCK_M, BLOCK_N, BLOCK_K, GROUPED)
    rows_m = tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _store_result(tl.sum(acc, 2), rows_m, rows_n, M, N, bias_ptr, out_ptr, partial_ptr, stride_om, pid_k,
                  SPLIT_K, HAS_BIAS)


@triton.jit
def _skinny_dot_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, scale_ptr, M, N, K, stride_xm, stride_wn,
                       stride_om, stride_sn, group_k, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       GATED: tl.constexpr, W_SCALED: tl.constexpr, UPCAST_DOT: tl.constexpr,
                       PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows_m = tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    xt_ptrs = x_ptr + rows_m[None, :] * stride_xm + cols[:, None]  # x^T tiles, (BLOCK_K, BLOCK_M)
    w_ptrs = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    m_mask = (rows_m < M)[None, :]
    n_mask = (rows_n < N)[:, None]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # the first weight tile before the wait, as in the FMA kernel
    w = tl.load(w_ptrs + k_start, mask=n_mask & (k_start + cols < k_end)[None, :], other=0.0)
    launch_dependents(USE_PDL)
    wait_for_previous(USE_PDL)
    xt = _load_x(xt_ptrs + k_start, m_mask & (k_start + cols < k_end)[:, None], K, GATED)
    scale_ptrs = scale_ptr + rows_n * stride_sn
    n_rows = rows_n < N
    # y^T: the weight rows are the MMA's M
    acc = _tile_dot(w, xt, scale_ptrs, k_start // group_k, n_rows & (k_start < k_end), W_SCALED, UPCAST_DOT,
                    PRECISION)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        if EVEN_K:
            xt = _load_x(xt_ptrs + k0, m_mask, K, GATED)
            w = tl.load(w_ptrs + k0, mask=n_mask, other=0.0)
        else:
            xt = _load_x(xt_ptrs + k0, m_mask & (k0 + cols < k_end)[:, None], K, GATED)
            w = tl.load(w_ptrs + k0, mask=n_mask & (k0 + cols < k_end)[None, :], other=0.0)
        acc += _tile_dot(w, xt, scale_ptrs, k0 // group_k, n_rows, W_SCALED, UPCAST_DOT, PRECISION)
    _store_result(tl.trans(acc), rows_m, rows_n, M, N, bias_ptr, out_ptr, partial_ptr, stride_om, pid_k,
                  SPLIT_K, HAS_BIAS)


@triton.jit
def _split_k_reduce_kernel(partial_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr,
                           BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr):
    launch_dependents(USE_PDL)  # first thing: kernels/pdl.py
    wait_for_previous(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + (split * M + row).to(tl.int64) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_rows(num_rows: int, dot: bool) -> int:
    """The row tile: a power of two for the FMA loop, 16 (the MMA's least) for the dot loop."""
    return MAX_ROWS if dot else next_power_of_2(num_rows)


def _floor_power_of_2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _rule(num_rows: int, n: int, k: int, num_sms: int, dot: bool, num_warps: int) -> SkinnyConfig:
    """Two programs per SM from narrower output tiles, and at least one by split-K (whose second
    kernel costs a launch and a round trip of the partial sums). Each program's weight tile is as
    large as ~64 fp32 accumulators per thread allow in the FMA loop (BLOCK_M*BLOCK_N*BLOCK_K of
    them), so that every SM has its share of the matrix in flight at once; the dot loop's
    accumulators are few, and Triton pipelines its loads num_stages deep instead."""
    target = 2 * num_sms
    if dot:  # the MMA needs 16 weight rows
        block_n = max(16, min(64, _floor_power_of_2(n // target)))
        # 64 x 128 for the widest tile: the best of bench_gemm.py --tiling-grid for the 8B lm_head
        block_k = min(128 if block_n == 64 else 256, max(16, next_power_of_2(k)))
    else:
        budget = 64 * 32 * num_warps // block_rows(num_rows, dot)  # weight elements per tile
        least_k = max(128, 512 // block_rows(num_rows, dot))  # rows of at least 256 contiguous bytes
        block_n = max(2, min(budget // least_k, _floor_power_of_2(n // target)))
        block_k = max(16, min(budget // block_n, _floor_power_of_2(k)))
    split = 1
    while cdiv(n, block_n) * split < num_sms and split < 8 and cdiv(k, block_k) >= 2 * split:
        split *= 2
    return SkinnyConfig(dot, block_n, block_k, split, num_warps)


def candidate_configs(num_rows: int, n: int, k: int, num_sms: int) -> list[SkinnyConfig]:
    """A few tilings for rows x (n, k), best guesses first: the rule's choice for the row
    count's own loop (FMA up to FMA_MAX_ROWS rows), the dot loop's (for few rows), then the
    neighbours of the first: the same tile area wider or narrower, another split, 8 warps."""
    fma = num_rows <= FMA_MAX_ROWS
    first = _rule(num_rows, n, k, num_sms, dot=not fma, num_warps=4)
    least_n = 16 if first.dot else 2
    configs = [first]
    if fma:
        configs.append(_rule(num_rows, n, k, num_sms, dot=True, num_warps=4))
    if first.block_k >= 32:
        configs.append(replace(first, block_n=first.block_n * 2, block_k=first.block_k // 2))
    if first.block_n // 2 >= least_n and first.block_k * 2 <= max(16, _floor_power_of_2(k)):
        configs.append(replace(first, block_n=first.block_n // 2, block_k=first.block_k * 2))
    more_splits = cdiv(k, first.block_k) >= 2 * first.split_k
    configs.append(replace(first, split_k=first.split_k * 2 if more_splits else 1))
    configs.append(_rule(num_rows, n, k, num_sms, dot=first.dot, num_warps=8))
    unique = []
    for config in configs:
        if config not in unique:
            unique.append(config)
    return unique


def fp8_candidate_configs(num_rows: int, n: int, k: int, num_sms: int, group_k: int | None) -> list[SkinnyConfig]:
    """candidate_configs for FP8 weights whose scales come per group_k columns (None: per channel): every
    K tile inside one group, block_k at most group_k's largest power-of-two divisor (the tl.dot loop
    needs 16 or more). Empty where no tiling fits (the layer dequantizes instead)."""
    configs = []
    for config in candidate_configs(num_rows, n, k, num_sms):
        if group_k is not None:
            config = replace(config, block_k=min(config.block_k, group_k & -group_k))
        if (config.block_k >= 16 or not config.dot) and config not in configs:
            configs.append(config)
    return configs


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig,
                out: torch.Tensor | None = None, gated: bool = False, scale: torch.Tensor | None = None,
                group_k: int | None = None) -> torch.Tensor:
    """x (..., K) with at most MAX_ROWS rows, weight (N, K) row-major, bias (N,) or None: the
    (..., N) result in x's dtype, as F.linear gives it. gated: x is (..., 2K), gate then up, and the
    result is F.linear(fused_ops.silu_and_mul(x), weight, bias). scale: weight is float8_e4m3fn and
    weight[n, k] stands for weight[n, k] * scale[n, k // group_k] (scale (N, G) float32; group_k
    None: G is 1, per-channel scales); each of config's K tiles must lie in one group."""
    n, k = weight.shape
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    num_rows = x2.shape[0]
    assert x.shape[-1] == (2 * k if gated else k), (tuple(x.shape), tuple(weight.shape), gated)
    assert num_rows <= MAX_ROWS and weight.stride(1) == 1
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out.view(*x.shape[:-1], n)
    split = config.split_k
    k_per_split = cdiv(cdiv(k, config.block_k), split) * config.block_k
    partial = torch.empty((split, num_rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    bias_arg = bias if bias is not None else weight  # unused when HAS_BIAS is off
    assert config.dot or num_rows <= FMA_MAX_ROWS, "the FMA loop is for up to FMA_MAX_ROWS rows"
    if not config.dot:
        kernel, dot_args = _skinny_fma_kernel, dict(GROUPED=config.grouped)
    else:
        upcast, precision = _dot_config(x.dtype)
        kernel, dot_args = _skinny_dot_kernel, dict(UPCAST_DOT=upcast, PRECISION=precision)
    pdl = launch_options(x)
    if scale is not None:
        assert scale.dtype == torch.float32 and scale.shape[0] == n and scale.stride(1) == 1, scale.shape
        assert scale.shape[1] == 1 or (group_k % config.block_k == 0 and scale.shape[1] == cdiv(k, group_k)), \
            (tuple(scale.shape), group_k, config)
    scale_arg = scale if scale is not None else weight  # unused when W_SCALED is off
    # one group (per-channel scales): any k // group_k is 0
    group_arg = group_k if scale is not None and scale.shape[1] > 1 else 1 << 30
    kernel[(cdiv(n, config.block_n), split)](
        x2, weight, bias_arg, out, partial, scale_arg, num_rows, n, k, x2.stride(0), weight.stride(0), out.stride(0),
        scale_arg.stride(0), group_arg, k_per_split, BLOCK_M=block_rows(num_rows, config.dot), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLIT_K=split, EVEN_K=k % config.block_k == 0, HAS_BIAS=bias is not None,
        GATED=gated, W_SCALED=scale is not None, num_warps=config.num_warps, num_stages=config.num_stages, **pdl,
        **dot_args)
    if split > 1:
        reduce_splits(partial, out, bias, pdl)
    return out.view(*x.shape[:-1], n)


def reduce_splits(partial: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
                  pdl: dict[str, bool] | None = None) -> None:
    """out (M, N) = partial (SPLIT, M, N) float32 summed over its splits in split order, plus bias:
    the split-K reduce, one launch (pdl: launch_options' keywords; None: no PDL)."""
    split, num_rows, n = partial.shape
    block = min(1024, next_power_of_2(n))
    _split_k_reduce_kernel[(num_rows, cdiv(n, block))](
        partial, bias if bias is not None else out, out, num_rows, n, out.stride(0), SPLIT_K=split, BLOCK=block,
        HAS_BIAS=bias is not None, num_warps=4, **(pdl or {"USE_PDL": False}))
