"""FP8 conversions around layers/fp8_linear.py's GEMMs at more than 16 rows: activations quantized per
token for the W8A8 GEMM, and FP8 weights dequantized for the bf16 GEMM.

Each row of x (bf16/fp16/fp32) becomes e4m3 with its own float32 scale, amax / 448 (at least 1e-12,
so an all-zero row divides by something): one launch that reads the row, takes its amax, and writes
x / scale clamped to +-448 and rounded to nearest even. The PyTorch form of the same arithmetic
(fp8_linear._quantize_per_token) took nine launches and four fp32 round trips through memory.

Bit for bit PyTorch's: the amax is exact in fp32, the scale and each x / scale are correctly rounded
divisions (div_rn; Triton's plain '/' on fp32 is an approximate one on the GPU), and x / scale is
rounded onto e4m3's grid in fp32 arithmetic (_round_to_e4m3), to nearest, ties to even, as PyTorch's
cast does, before a cast that then has nothing to round: how Triton's own fp32 -> e4m3 cast rounds is
left out of it (the interpreter's cast rounds ties away and mis-carries). PyTorch's own per-token form
must divide as correctly: CUDA torch's `amax / 448` multiplies by the reciprocal, 1 ulp off for about
half the rows, enough to move an activation by an e4m3 step (an output of a GPU test whose reference
divided so was one such step off).
A row of up to MAX_ONE_TILE columns is held in registers between the amax and the cast, so it is read
once; a longer one is read again for the cast (from L2: the row was just read).

dequantize_rows is fp8_linear.dequantize_rows' arithmetic (the e4m3 weight times its row's group
scale in fp32, rounded once to the output dtype) in one launch that reads 1 byte and writes 2 per
weight: PyTorch takes three (a float8 tensor joins no arithmetic before a cast to float32), through
an fp32 copy of the whole matrix, about six times the bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels.host import cdiv, next_power_of_2

# constexpr: a kernel reads no other globals
FP8_MAX = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value
MIN_SCALE = tl.constexpr(1e-12)
DEQUANT_BLOCK = 1024  # columns per program of the dequantization
MAX_ONE_TILE = 8192  # columns held in registers at once (8 warps: 32 fp32 registers a thread)


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, as fp32: its
    quantum is 2**(exponent - 3) (3 mantissa bits), 2**-9 in the subnormal range below 2**-6. Every
    step is exact: a division and a product by a power of two, and a whole part below 16."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    scaled = tl.abs(v) / quantum
    whole = scaled.to(tl.int32)  # truncation: the floor of a non-negative value
    fraction = scaled - whole.to(tl.float32)
    whole += ((fraction > 0.5) | ((fraction == 0.5) & ((whole & 1) == 1))).to(tl.int32)
    magnitude = (whole.to(tl.float32) * quantum).to(tl.int32, bitcast=True)
    return (magnitude | (bits & -0x80000000)).to(tl.float32, bitcast=True)  # v's sign, -0.0 included


@triton.jit
def _quantize_per_token_kernel(x_ptr, out_ptr, scale_ptr, n_cols, stride_x, stride_out,
                               BLOCK: tl.constexpr, ONE_TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)
    if ONE_TILE:
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        running = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            part = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
            running = tl.maximum(running, tl.abs(part))
        amax = tl.max(running, 0)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    if ONE_TILE:
        q = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX))
        tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty), mask=cols < n_cols)
    else:
        for start in range(0, n_cols, BLOCK):
            part = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
            q = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(part, scale), -FP8_MAX), FP8_MAX))
            tl.store(out_row + start + cols, q.to(out_ptr.dtype.element_ty), mask=start + cols < n_cols)


def quantize_per_token(x: torch.Tensor, out: torch.Tensor | None = None,
                       scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float8_e4m3fn, float32 scales (rows, 1)) for x (rows, K) with unit column stride; out and
    scale, where given, are written (the tests poison them)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_per_token: x must be 2-D with unit column stride, got shape "
                         f"{tuple(x.shape)} and strides {x.stride()}")
    rows, cols = x.shape
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    if scale is None:
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, scale
    one_tile = cols <= MAX_ONE_TILE
    block = next_power_of_2(cols) if one_tile else 2048
    _quantize_per_token_kernel[(rows,)](x, out, scale, cols, x.stride(0), out.stride(0), BLOCK=block,
                                        ONE_TILE=one_tile, num_warps=8 if block >= 2048 else 4)
    return out, scale


@triton.jit
def _dequantize_rows_kernel(w_ptr, scale_ptr, out_ptr, n_cols, stride_w, stride_scale, stride_out, group_k,
                            BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + row * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
    if PER_ROW:
        scale = tl.load(scale_ptr + row * stride_scale)
    else:
        scale = tl.load(scale_ptr + row * stride_scale + cols // group_k, mask=mask, other=1.0)
    tl.store(out_ptr + row * stride_out + cols, (w * scale).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, group_k: int | None, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """weight (N, K) float8_e4m3fn times scale (N, G) float32, G groups of group_k columns (one: per row),
    in dtype; out, where given, is written (the tests poison it)."""
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"dequantize_rows: weight must be 2-D with unit column stride, got shape "
                         f"{tuple(weight.shape)} and strides {weight.stride()}")
    rows, cols = weight.shape
    if out is None:
        out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    if weight.numel():
        per_row = scale.shape[1] == 1
        grid = (rows, cdiv(cols, DEQUANT_BLOCK))
        _dequantize_rows_kernel[grid](weight, scale, out, cols, weight.stride(0), scale.stride(0), out.stride(0),
                                      1 if per_row else group_k, BLOCK=DEQUANT_BLOCK, PER_ROW=per_row, num_warps=4)
    return out
