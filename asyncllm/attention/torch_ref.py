"""The reference backend: plain PyTorch over the paged cache. Runs anywhere; used on CPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncllm.attention.base import AttentionBackend, ForwardBatch


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                          max_query_len: int, max_seq_len: int, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged KV (the last query row sits
    at position seq_len - 1). Pads to (num_seqs, max_query_len) and masks; returns (T, H, D)."""
    block_size = k_cache.shape[1]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long()
    k = k_cache[tables].flatten(1, 2)[:, :max_seq_len]  # (B, Lk, Hkv, D)
    v = v_cache[tables].flatten(1, 2)[:, :max_seq_len]
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
        q_padded.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    out = out.transpose(1, 2)  # (B, Lq, H, D)
    return out[valid_q]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    store_kv = staticmethod(store_kvcache_torch)

    def attend(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer_id], self.v_caches[layer_id]
        return paged_attention_torch(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                                     batch.block_tables, batch.max_query_len, batch.max_seq_len, self.scale)
