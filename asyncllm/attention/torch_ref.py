"""The reference backend: plain PyTorch over the paged cache. Runs anywhere; used on CPU.

An FP8 cache (float8_e4m3fn) is emulated exactly as the Triton kernels keep it: stored as
x / scale clamped to +-448 and rounded to nearest even (quantize_kv), read back as stored * scale
in the compute dtype (dequantize_kv); attention then runs in the compute dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncllm.attention.base import AttentionBackend, ForwardBatch


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448: e4m3's cast maps larger values to NaN, so they are clamped first


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as a cache of cache_dtype stores it: for FP8, x * (1 / scale) in fp32 (as the Triton store
    multiplies) clamped to +-FP8_KV_MAX, then cast; any other dtype, a plain cast."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    return (x.float() * (1.0 / scale)).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(cache_dtype)


def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What a reader of the cache computes with: stored * scale in dtype (FP8), else stored in dtype."""
    if stored.dtype != FP8_KV_DTYPE:
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scale in ((k, k_cache, kv_scales[0]), (v, v_cache, kv_scales[1])):
        rows = quantize_kv(x[keep], cache.dtype, scale)
        if cache.dtype == FP8_KV_DTYPE:  # index_copy_ has no float8 kernel on CPU: copy the bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    if cache.dtype == FP8_KV_DTYPE:  # as bytes: not every device's indexing kernel takes float8
        return cache.view(torch.uint8)[tables].view(FP8_KV_DTYPE)
    return cache[tables]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                          max_query_len: int, max_seq_len: int, scale: float,
                          kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged KV (the last query row sits
    at position seq_len - 1). Pads to (num_seqs, max_query_len) and masks; returns (T, H, D).
    kv_scales: an FP8 cache's (k_scale, v_scale)."""
    block_size = k_cache.shape[1]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long()
    k = _gather_blocks(k_cache, tables).flatten(1, 2)[:, :max_seq_len]  # (B, Lk, Hkv, D)
    v = _gather_blocks(v_cache, tables).flatten(1, 2)[:, :max_seq_len]
    starts = query_start_loc[:-1].long()
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    row = torch.arange(max_query_len, device=q.device)
    valid_q = row[None, :] < query_lens[:, None]  # (B, Lq)
    token_index = (starts[:, None] + row[None, :]).clamp(max=q.shape[0] - 1)
    q_padded = q[token_index]  # (B, Lq, H, D)
    q_pos = seq_lens.long()[:, None] - query_lens[:, None] + row[None, :]  # absolute position of each row
    kv_pos = torch.arange(max_seq_len, device=q.device)
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # causal, which also bounds by seq_len
    mask = mask | ~valid_q[:, :, None]  # padding rows attend to everything; their output is dropped
    out = F.scaled_dot_product_attention(
        q_padded.transpose(1, 2), dequantize_kv(k, q.dtype, kv_scales[0]).transpose(1, 2),
        dequantize_kv(v, q.dtype, kv_scales[1]).transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    out = out.transpose(1, 2)  # (B, Lq, H, D)
    return out[valid_q]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping, self.kv_scales)

    def attend(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer_id], self.v_caches[layer_id]
        return paged_attention_torch(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                                     batch.block_tables, batch.max_query_len, batch.max_seq_len, self.scale,
                                     self.kv_scales)
