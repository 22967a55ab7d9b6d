"""Fused elementwise kernels with the math of asyncllm.layers, used by those layers on CUDA.

Unfused, a decoder layer is some 80 tiny PyTorch kernels (casts, means, concatenations for rotary);
at batch 1 those launches, not the weights, set the time per token. These cut a layer to ~9.

- rms_norm / fused_add_rms_norm: RMSNorm's two forms in one pass over the row, computed in fp32
  with the same roundings as the PyTorch module (normed value rounded to the input dtype before
  the weight multiply; the residual sum rounded to the input dtype before normalising).
- silu_and_mul: silu(gate) * up over a (..., 2 * N) input, gate first, in one pass.
- qk_norm_rope_: Qwen3's per-head q/k RMSNorm and then rotary, in place on the fused qkv
  projection, all q and k heads of a token per program, rounding where the PyTorch modules round;
  for an FP8 cache also the q/k Hadamard rotation (hadamard_halves, Config.kv_cache_rotation).
Each saves the intermediate tensors' round trips through memory. All launch with programmatic
dependent launch where kernels/pdl.py allows it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm import settings
from asyncllm.kernels.host import next_power_of_2
from asyncllm.kernels.kv_store import is_fp8_cache, quantize_for_cache
from asyncllm.kernels.pdl import launch_dependents, launch_options, wait_for_previous

# The Triton CPU interpreter multiplies bf16 tensors as raw uint16 bit patterns in tl.dot; compiled
# kernels are unaffected. Under the interpreter only, bf16 dot operands are upcast to fp32. Read at import:
# @triton.jit made this module's kernels interpreted or compiled then, and every launch asks it.
_INTERPRET = settings.TRITON_INTERPRET.read()


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


def _dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    # fp32 inputs (CPU tests, debugging) want exact fp32 dots, not TF32
    upcast = _INTERPRET and dtype == torch.bfloat16
    return upcast, ("ieee" if dtype == torch.float32 else "tf32")


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    launch_dependents(USE_PDL)  # first thing: kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a weight: before the wait (kernels/pdl.py)
    wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * inv_rms).to(dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.stride(1) == 1:  # the model's (tokens, hidden) activations: no reshape
        return x
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), like RMSNorm.forward(x, residual)."""
    return _rms_norm(x, residual, weight, eps)


def _rms_norm(x, residual, weight, eps):
    x2 = _rows(x)
    num_rows, hidden = x2.shape
    if weight.dtype == x.dtype:
        out = torch.empty_like(x2)
    else:
        out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        r2 = _rows(residual)
        residual_out = torch.empty_like(x2)
    else:
        r2 = residual_out = x2  # unused
    if num_rows:
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x2, r2, weight, out, residual_out, x2.stride(0), r2.stride(0), out.stride(0),
            residual_out.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 512)), **launch_options(x))
    if x2 is not x:
        out = out.view(x.shape)
        residual_out = residual_out.view(x.shape)
    return out, (None if residual is None else residual_out)


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in fp32, from tiles in the input dtype. Shared with the skinny GEMM's gated
    prologue (kernels/skinny_gemm.py), so that the fused and unfused MLPs round alike."""
    g = gate.to(tl.float32)
    # round silu to the input dtype first, as torch does for F.silu(gate) * up
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return silu * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    launch_dependents(USE_PDL)  # first thing: kernels/pdl.py
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, _silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    num_rows, n = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows:
        block = min(4096, next_power_of_2(n))
        _silu_and_mul_kernel[(num_rows, (n + block - 1) // block)](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=max(1, min(8, block // 256)),
            **launch_options(x))
    return out if x2 is x else out.view(*x.shape[:-1], n)


@triton.jit
def head_norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads (rows) given as two halves in the input dtype (the rotary pairs x[i] with x[i + HALF]):
    RMSNorm of each head (where HAS_NORM; w1, w2 the weight's halves, broadcast over rows), then
    rotary by cos, sin (fp32, broadcast over rows). Returns the halves in the input dtype. Shared by
    the q/k norm + rotary kernel and the decode attention kernel that does the same work itself
    (kernels/paged_attention.py), so that the two round alike."""
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        # RMSNorm of each head over HEAD_DIM (Qwen3's q_norm / k_norm), rounded as the module rounds:
        # the normed value to the input dtype, then the weighted product to the output dtype
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)
        x1 = ((x1 * inv_rms[:, None]).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms[:, None]).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
    # the rotary module's roundings, step by step: cos/sin cast to x's dtype, each product
    # rounded, then the sum rounded (exact in fp32; in bf16 it keeps HF parity bit-for-bit)
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def hadamard_halves(x1, x2, HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, UPCAST_DOT: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Heads (rows, at least 16) given as two halves in their dtype, times Sylvester's Hadamard matrix
    of HEAD_DIM over sqrt(HEAD_DIM) (attention.base.hadamard_matrix): by its recursion
    H = [[S, S], [S, -S]] / sqrt(HEAD_DIM), S the half's +-1 matrix, [x1 | x2] H = [a + b | a - b] / sqrt(HEAD_DIM)
    with a = x1 S, b = x2 S. Entry (i, j) of S is (-1) ** popcount(i & j); half columns past HEAD_DIM / 2
    (BLOCK_HALF's padding to a dot's 16) meet zeros of x and are not stored. bf16 / fp16 times +-1 is
    exact and the dot sums in fp32, so the result is rounded once, as attention.base.rotate_heads rounds."""
    offs = tl.arange(0, BLOCK_HALF)
    bits = offs[:, None] & offs[None, :]
    bits = bits ^ (bits >> 8)
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    sign = (1 - 2 * (bits & 1)).to(x1.dtype)
    a = _dot(x1, sign, UPCAST_DOT, PRECISION)
    b = _dot(x2, sign, UPCAST_DOT, PRECISION)
    inv_sqrt = 1.0 / tl.sqrt(HEAD_DIM * 1.0)
    return ((a + b) * inv_sqrt).to(x1.dtype), ((a - b) * inv_sqrt).to(x1.dtype)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, stride_t, stride_cs, eps,
                         k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_cb, stride_cslot, stride_ch,
                         k_inv_scale, v_inv_scale,
                         NUM_Q_HEADS: tl.constexpr, NUM_QK_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, FP8_KV: tl.constexpr, ROTATE: tl.constexpr,
                         UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    launch_dependents(USE_PDL)  # first thing: kernels/pdl.py
    # one program per token: its q heads then its k heads, which sit next to each other in the
    # row of the fused projection, each as two halves (the rotary pairs x[i] with x[i + HALF])
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_H)
    d_mask = offs < HALF
    mask = (heads[:, None] < NUM_QK_HEADS) & d_mask[None, :]
    # before the wait, what no kernel of this step writes (kernels/pdl.py): the position, its
    # cos / sin row and the slot (the step's metadata), the norm weights; after it, one round trip
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=d_mask, other=0.0)[None, :]
    if HAS_NORM:
        is_q = (heads < NUM_Q_HEADS)[:, None]
        w1 = tl.where(is_q, tl.load(q_weight_ptr + offs, mask=d_mask, other=0.0)[None, :],
                      tl.load(k_weight_ptr + offs, mask=d_mask, other=0.0)[None, :]).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + offs, mask=d_mask, other=0.0)[None, :],
                      tl.load(k_weight_ptr + HALF + offs, mask=d_mask, other=0.0)[None, :]).to(tl.float32)
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token)
    wait_for_previous(USE_PDL)
    first = qkv_ptr + token * stride_t + heads[:, None] * HEAD_DIM + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    if STORE_KV:  # v too, with q and k: after the stores below it would be a second round trip
        v_heads = tl.arange(0, BLOCK_KV)
        offs_d = tl.arange(0, BLOCK_D)
        v_mask = (v_heads[:, None] < NUM_QK_HEADS - NUM_Q_HEADS) & (offs_d[None, :] < HEAD_DIM)
        v = tl.load(qkv_ptr + token * stride_t + (NUM_QK_HEADS + v_heads[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=v_mask)
    if not HAS_NORM:
        w1 = cos  # unused
        w2 = cos
    out1, out2 = head_norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM, HAS_NORM)
    if ROTATE:  # q and k heads alike (AttentionBackend.qk_rotation): scores unchanged, K's outliers spread
        out1, out2 = hadamard_halves(out1, out2, HEAD_DIM, BLOCK_HALF, UPCAST_DOT, PRECISION)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    if STORE_KV:
        # this token's k (as rotated above) and v straight into the paged cache: the KV store's
        # own launch, and its re-read of k and v, saved (slot -1: nothing to store)
        if slot >= 0:
            cache_row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cslot
            kv_head = heads - NUM_Q_HEADS
            k_mask = mask & (heads >= NUM_Q_HEADS)[:, None]
            k_dst = k_cache_ptr + cache_row + kv_head[:, None] * stride_ch + offs[None, :]
            cache_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_dst, quantize_for_cache(out1, k_inv_scale, FP8_KV).to(cache_dtype), mask=k_mask)
            tl.store(k_dst + HALF, quantize_for_cache(out2, k_inv_scale, FP8_KV).to(cache_dtype), mask=k_mask)
            tl.store(v_cache_ptr + cache_row + v_heads[:, None] * stride_ch + offs_d[None, :],
                     quantize_for_cache(v, v_inv_scale, FP8_KV).to(cache_dtype), mask=v_mask)


def qk_norm_rope_(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_q_heads: int,
                  num_k_heads: int, head_dim: int, q_weight: torch.Tensor | None = None,
                  k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                  slot_mapping: torch.Tensor | None = None,
                  kv_scales: tuple[float, float] = (1.0, 1.0), rotate: bool = False) -> torch.Tensor:
    """In place on qkv (tokens, (num_q_heads + 2 * num_k_heads) * head_dim), rows [q | k | v]:
    RMSNorm of each q and k head (when q_weight and k_weight are given), then rotary of q and k by
    their positions (half-split layout; cos_sin_cache rows are [cos(half) | sin(half)] in fp32),
    then, where rotate, each q and k head times attention.base.hadamard_matrix(head_dim) (a power of two).
    v is untouched. With kv_cache = (k_cache, v_cache), each (num_blocks, block_size, num_k_heads,
    head_dim) with identical strides, and slot_mapping (tokens,) int64 (-1: skip), the rotated k and
    v are also stored into the cache, as kernels.store_kvcache would (an FP8 cache quantized by
    kv_scales = (k_scale, v_scale)). One launch where the modules take up to six."""
    num_tokens = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.stride(1) == 1 and cos_sin_cache.stride(-1) == 1
    if num_tokens:
        half = head_dim // 2
        has_norm = q_weight is not None
        assert not rotate or head_dim == next_power_of_2(head_dim), "the Hadamard rotation needs a power-of-two head_dim"
        upcast, precision = _dot_config(qkv.dtype)
        # a rotation's dots take at least 16 rows and 16 columns: padded heads and half columns load zeros
        block_h, block_half = next_power_of_2(num_q_heads + num_k_heads), next_power_of_2(half)
        if rotate:
            block_h, block_half = max(block_h, 16), max(block_half, 16)
        store = kv_cache is not None
        if store:
            k_cache, v_cache = kv_cache
            assert k_cache.shape[2:] == (num_k_heads, head_dim) and k_cache.stride() == v_cache.stride()
            assert k_cache.stride(-1) == 1 and slot_mapping is not None and slot_mapping.shape[0] == num_tokens
            cache_args = (k_cache, v_cache, slot_mapping, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          1.0 / kv_scales[0], 1.0 / kv_scales[1])
        else:
            cache_args = (qkv, qkv, positions, 0, 0, 0, 1.0, 1.0)  # unused
        _qk_norm_rope_kernel[(num_tokens,)](
            qkv, positions, cos_sin_cache, q_weight if has_norm else qkv, k_weight if has_norm else qkv,
            qkv.stride(0), cos_sin_cache.stride(0), eps, *cache_args,
            NUM_Q_HEADS=num_q_heads, NUM_QK_HEADS=num_q_heads + num_k_heads, HEAD_DIM=head_dim, HALF=half,
            BLOCK_H=block_h, BLOCK_HALF=block_half, HAS_NORM=has_norm,
            STORE_KV=store, BLOCK_SIZE=kv_cache[0].shape[1] if store else 1, BLOCK_KV=next_power_of_2(num_k_heads),
            BLOCK_D=next_power_of_2(head_dim), FP8_KV=store and is_fp8_cache(kv_cache[0]), ROTATE=rotate,
            UPCAST_DOT=upcast, PRECISION=precision, num_warps=4,
            **launch_options(qkv))
    return qkv
