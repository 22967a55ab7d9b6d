from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    """One step's inputs, packed along a single token axis (no padded batch axis).

    Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; its KV after this step
    spans seq_lens[i] tokens, of which the last (query length) are the ones computed now.
    """
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    slot_mapping: torch.Tensor  # (num_tokens,) int64: block_id * block_size + offset; -1 = don't store
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor  # (num_seqs,) int32
    block_tables: torch.Tensor  # (num_seqs, max_blocks_per_seq) int32, padded with 0
    logits_indices: torch.Tensor  # (num_sampled,) int64: rows whose logits are sampled
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    attn_backend: "AttentionBackend | None" = None
    attn_metadata: Any = None  # the backend's own, set by prepare_metadata

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Stores each step's K/V into the paged cache and attends over it."""

    name = "base"
    supports_cuda_graphs = False

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float):
        # each cache: (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = k_caches[0].shape[1]

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        """Build per-step metadata from the batch (called once per step, before the forward)."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, Hkv, D) for this step's tokens. Returns (T, H, D)."""

    # CUDA graphs: decode-only steps of up to max_batch_size sequences
    def init_cuda_graph_state(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        raise NotImplementedError(f"the {self.name} backend does not support CUDA graphs")

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        """Point batch's metadata at static buffers sized for batch.num_seqs."""
        raise NotImplementedError

    def prepare_for_replay(self, batch: ForwardBatch, graph_batch_size: int) -> None:
        """Copy this step's metadata into the static buffers of the graph for graph_batch_size."""
        raise NotImplementedError


def create_attention_backend(name: str, device: torch.device, **kwargs) -> AttentionBackend:
    from asyncllm.attention.torch_ref import TorchAttentionBackend
    if name == "auto":
        name = _auto_backend(device)
    if name == "torch":
        return TorchAttentionBackend(**kwargs)
    if device.type != "cuda":
        raise ValueError(f"Config.attention_backend: {name!r} needs a CUDA device; use 'torch' or 'auto' on CPU")
    if name == "triton":
        from asyncllm.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(**kwargs)
    if name == "fa4":
        from asyncllm.attention.flash_attn_backend import FA4AttentionBackend
        return FA4AttentionBackend(**kwargs)
    if name == "fa2":
        from asyncllm.attention.flash_attn_backend import FA2AttentionBackend
        return FA2AttentionBackend(**kwargs)
    raise ValueError(f"Config.attention_backend: unknown backend {name!r}")


def _auto_backend(device: torch.device) -> str:
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
        return "triton"
    except ImportError:
        return "torch"


class PagedGraphBuffers:
    """Static copies of the paged-attention metadata that a captured decode graph reads.

    bind() points a capture batch's fields at views of these buffers; load() copies a live
    batch's metadata in before a replay, padding the rows past its sequences so they store
    nothing (slot -1) and attend to nothing (length 0).
    """

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, block_size: int, device: torch.device):
        self.slot_mapping = torch.full((max_batch_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.max_seq_len = max_blocks_per_seq * block_size  # the bound every replay stays within

    def bind(self, batch: ForwardBatch) -> None:
        assert batch.max_query_len == 1, "CUDA graphs capture decode-only steps"
        bs = batch.num_seqs
        batch.slot_mapping = self.slot_mapping[:bs]
        batch.seq_lens = self.seq_lens[:bs]
        batch.block_tables = self.block_tables[:bs]
        batch.query_start_loc = self.query_start_loc[:bs + 1]
        batch.max_seq_len = self.max_seq_len
        # warm-up and capture run the kernels once on these buffers: store nothing, read nothing
        self.slot_mapping[:bs].fill_(-1)
        self.seq_lens[:bs].fill_(0)

    def load(self, batch: ForwardBatch, graph_batch_size: int) -> None:
        n = batch.num_seqs
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        # columns past the live batch's width keep stale ids; no kernel reads past a row's length
        cols = batch.block_tables.shape[1]
        assert cols <= self.block_tables.shape[1], "block table wider than max_blocks_per_seq"
        self.block_tables[:n, :cols].copy_(batch.block_tables, non_blocking=True)
        if n < graph_batch_size:
            self.slot_mapping[n:graph_batch_size].fill_(-1)
            self.seq_lens[n:graph_batch_size].fill_(0)
