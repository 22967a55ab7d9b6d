"""FlashAttention backends (optional extras): FlashAttention-4 (`flash-attn-4`, module
flash_attn.cute, Hopper/Blackwell) and FlashAttention-2 (`flash-attn`).

Both read our paged cache in place: the cache layout (num_blocks, block_size, kv_heads, head_dim)
is FlashAttention's paged layout, and our block tables are its page tables. New K/V rows are
written by our Triton store kernel first. CUDA-graph buffers are the shared PagedGraphBuffers.
"""
from __future__ import annotations

import torch

from asyncllm.attention.base import AttentionBackend, ForwardBatch
from asyncllm.attention.graph_buffers import PagedGraphBuffers
from asyncllm.config import config_error


def _store_kvcache():
    try:
        from asyncllm.kernels import store_kvcache
        return store_kvcache
    except ImportError:  # no Triton: the plain PyTorch scatter
        from asyncllm.attention.torch_ref import store_kvcache_torch
        return store_kvcache_torch


class _FlashAttnBackend(AttentionBackend):
    supports_cuda_graphs = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._store_kvcache = _store_kvcache()
        self.graph_buffers: PagedGraphBuffers | None = None

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        self._store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def init_cuda_graph_state(self, max_batch_size: int, max_blocks_per_seq: int, max_mixed_tokens: int = 0,
                              decode_buffers: PagedGraphBuffers | None = None) -> None:
        # decode graphs only: FlashAttention's varlen path under a fixed max_seqlen_q is not checked
        self.graph_buffers = decode_buffers or PagedGraphBuffers(
            max_batch_size, max_batch_size, max_blocks_per_seq, self.block_size, self.k_caches[0].device)

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        self.graph_buffers.bind(batch)

    def prepare_for_replay(self, batch: ForwardBatch, graph_batch: ForwardBatch) -> None:
        self.graph_buffers.load(batch, graph_batch)


class FA4AttentionBackend(_FlashAttnBackend):
    name = "fa4"

    def __init__(self, *args, **kwargs):
        try:
            from flash_attn.cute import flash_attn_varlen_func
        except ImportError as e:
            raise config_error("attention_backend", "'fa4' needs FlashAttention-4 "
                               "(pip install 'asyncllm-engine[fa4]', module flash_attn.cute)") from e
        super().__init__(*args, **kwargs)
        if self.k_caches[0].dtype not in (torch.float16, torch.bfloat16):
            raise config_error("dtype", f"FlashAttention-4 needs float16 or bfloat16, got {self.k_caches[0].dtype}")
        self._attn = flash_attn_varlen_func

    def attend(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer_id], self.v_caches[layer_id]
        out = self._attn(q, k_cache, v_cache, cu_seqlens_q=batch.query_start_loc, seqused_k=batch.seq_lens,
                         page_table=batch.block_tables, max_seqlen_q=batch.max_query_len,
                         max_seqlen_k=batch.max_seq_len, softmax_scale=self.scale, causal=True)
        return out[0] if isinstance(out, tuple) else out


class FA2AttentionBackend(_FlashAttnBackend):
    """FlashAttention-2's paged path needs block sizes that are multiples of 256."""
    name = "fa2"

    def __init__(self, *args, **kwargs):
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as e:
            raise config_error("attention_backend", "'fa2' needs FlashAttention-2 (pip install flash-attn)") from e
        super().__init__(*args, **kwargs)
        if self.block_size % 256:
            raise config_error("kvcache_block_size", f"FlashAttention-2's paged KV needs a multiple of 256, "
                               f"got {self.block_size}")
        self._varlen, self._with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        if batch.max_query_len > 1:
            cu_seqlens_k = torch.zeros(batch.num_seqs + 1, dtype=torch.int32, device=batch.seq_lens.device)
            torch.cumsum(batch.seq_lens, 0, out=cu_seqlens_k[1:])
            batch.attn_metadata = cu_seqlens_k

    def attend(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer_id], self.v_caches[layer_id]
        if batch.max_query_len == 1:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=batch.seq_lens,
                                     block_table=batch.block_tables, softmax_scale=self.scale, causal=True)
            return out.squeeze(1)
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=batch.query_start_loc,
                            cu_seqlens_k=batch.attn_metadata, max_seqlen_q=batch.max_query_len,
                            max_seqlen_k=batch.max_seq_len, softmax_scale=self.scale, causal=True,
                            block_table=batch.block_tables)
