"""Fused elementwise kernels with the math of asyncllm.layers, used by those layers on CUDA.

Unfused, a decoder layer is some 80 tiny PyTorch kernels (casts, means, concatenations for rotary);
at batch 1 those launches, not the weights, set the time per token. These cut a layer to ~11.

- rms_norm / fused_add_rms_norm: RMSNorm's two forms in one pass over the row, computed in fp32
  with the same roundings as the PyTorch module (normed value rounded to the input dtype before
  the weight multiply; the residual sum rounded to the input dtype before normalising).
- silu_and_mul: silu(gate) * up over a (..., 2 * N) input, gate first, in one pass.
- rotary_embedding_: rotary position embedding applied in place, all heads of a token per program,
  rounding where the PyTorch module rounds.
Each saves the intermediate tensors' round trips through memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = (xf * inv_rms).to(dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), like RMSNorm.forward(x, residual)."""
    return _rms_norm(x, residual, weight, eps)


def _rms_norm(x, residual, weight, eps):
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        r2 = _rows(residual)
        residual_out = torch.empty_like(x2)
    else:
        r2 = residual_out = x2  # unused
    block = triton.next_power_of_2(hidden)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, residual_out, x2.stride(0), r2.stride(0), out.stride(0),
            residual_out.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 512)))
    out = out.view(x.shape)
    if residual is None:
        return out, None
    return out, residual_out.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # round silu to the input dtype first, as torch does for F.silu(gate) * up
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(4096, triton.next_power_of_2(n))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=max(1, min(8, block // 256)))
    return out.view(*x.shape[:-1], n)


@triton.jit
def _rotary_kernel(x_ptr, cos_sin_ptr, positions_ptr, stride_xt, stride_xh, stride_cs, num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_H)
    d_mask = offs < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=d_mask, other=0.0)[None, :]
    mask = (heads[:, None] < num_heads) & d_mask[None, :]
    first = x_ptr + token * stride_xt + heads[:, None] * stride_xh + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    # the PyTorch module's roundings, step by step: cos/sin cast to x's dtype, each product
    # rounded, then the sum rounded (exact in fp32; in bf16 it keeps HF parity bit-for-bit)
    dtype = x1.dtype
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


def rotary_embedding_(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate x (tokens, heads, head_dim; any token/head strides) in place by its positions'
    angles, half-split layout: cos_sin_cache rows are [cos(half) | sin(half)] in fp32."""
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            x, cos_sin_cache, positions, x.stride(0), x.stride(1), cos_sin_cache.stride(0), num_heads,
            HALF=half, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=4)
    return x
