"""Scatter one step's new K/V rows into the paged KV cache.

One program per token: it reads the token's slot (block_id * block_size + offset) and copies all
of its KV heads at once, a (num_kv_heads, head_dim) tile. Slot -1 means "don't store" (padding
rows of a CUDA graph, tokens whose KV is already cached) and the program returns before touching
memory, so such rows may hold anything.

An FP8 cache (float8_e4m3fn, Config.kv_cache_dtype="fp8") holds x / scale, clamped to +-448 (e4m3's
largest finite value: a cast past it would give NaN) and rounded to nearest even; readers multiply
by the scale (kernels/paged_attention.py). quantize_for_cache is that rounding's one copy in Triton,
shared by every kernel that writes the cache (this one, fused_ops' q/k norm + rotary, the decode
kernel that stores its own row).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels.host import next_power_of_2


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


@triton.jit
def quantize_for_cache(x, inv_scale, FP8: tl.constexpr):
    """x as the cache stores it before the cast to its dtype: for an FP8 cache x * (1 / scale) in fp32,
    clamped to +-448 (torch.finfo(torch.float8_e4m3fn).max); otherwise x itself."""
    if FP8:
        return tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)
    else:
        return x


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_inv_scale, v_inv_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = token.to(tl.int64)
    dst = k_cache_ptr.dtype.element_ty
    cache_off = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, quantize_for_cache(k, k_inv_scale, FP8).to(dst), mask=mask)
    v = tl.load(v_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_off, quantize_for_cache(v, v_inv_scale, FP8).to(dst), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """k, v: (T, Hkv, D), any token/head strides; caches: (num_blocks, block_size, Hkv, D) with
    identical strides; slot_mapping: (T,) int64, -1 = skip. kv_scales: (k_scale, v_scale) of an FP8
    cache (ignored for any other dtype)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert v.shape == k.shape and slot_mapping.shape[0] == num_tokens
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    block_size = k_cache.shape[1]
    # int64 slots index past 2**31 elements on big caches; block * stride_cb is computed in int64
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / kv_scales[0], 1.0 / kv_scales[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, FP8=is_fp8_cache(k_cache), num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )
