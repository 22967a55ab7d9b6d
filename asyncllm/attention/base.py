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
    supports_cuda_graphs = False  # decode-only steps
    supports_mixed_cuda_graphs = False  # steps with prefill chunks too (up to a token bound)

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

    # CUDA graphs: decode-only steps of up to max_batch_size sequences, and (where
    # supports_mixed_cuda_graphs) any step of up to max_mixed_tokens tokens
    def init_cuda_graph_state(self, max_batch_size: int, max_blocks_per_seq: int, max_mixed_tokens: int = 0) -> None:
        raise NotImplementedError(f"the {self.name} backend does not support CUDA graphs")

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        """Point batch's metadata at static buffers sized for its num_tokens and num_seqs; a batch
        with max_query_len > 1 is captured as a mixed step."""
        raise NotImplementedError

    def prepare_for_replay(self, batch: ForwardBatch, graph_batch: ForwardBatch) -> None:
        """Copy this step's metadata into the static buffers of the graph captured with graph_batch."""
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
    # triton even where FA4 is installed: on the H200 our kernels serve faster end to end (mixed-step
    # CUDA graphs; FA4's eager prefill makes its TTFT 14 ms against 2) -- docs/BENCHMARKS.md
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
        return "triton"
    except ImportError:
        return "torch"


class PagedGraphBuffers:
    """Static copies of the paged-attention metadata that captured graphs read.

    One set serves every graph of one kind: decode graphs (one token per sequence; query_start_loc
    stays 0, 1, 2, ...) or mixed graphs (prefill chunks and decodes; query_start_loc is loaded per
    replay). bind() points a capture batch's fields at views of these buffers; load() copies a live
    batch's metadata in before a replay, padding what lies past it: tokens store nothing (slot -1),
    sequences have no query rows and no KV (length 0), so every kernel skips them.
    """

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, decode_only: bool = True):
        self.decode_only = decode_only
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        if not decode_only:
            self.query_start_loc.zero_()
        self.max_seq_len = max_blocks_per_seq * block_size  # the bound every replay stays within

    def bind(self, batch: ForwardBatch) -> None:
        assert batch.is_decode_only == self.decode_only, "decode graphs and mixed graphs use separate buffers"
        num_tokens, num_seqs = batch.num_tokens, batch.num_seqs
        batch.slot_mapping = self.slot_mapping[:num_tokens]
        batch.seq_lens = self.seq_lens[:num_seqs]
        batch.block_tables = self.block_tables[:num_seqs]
        batch.query_start_loc = self.query_start_loc[:num_seqs + 1]
        batch.max_seq_len = self.max_seq_len
        # warm-up and capture run the kernels once on these buffers: store nothing, read nothing
        self.slot_mapping[:num_tokens].fill_(-1)
        self.seq_lens[:num_seqs].fill_(0)
        if not self.decode_only:
            self.query_start_loc[:num_seqs + 1].fill_(0)

    def load(self, batch: ForwardBatch, graph_batch: ForwardBatch) -> None:
        """Copy batch's metadata in for a replay of the graph captured with graph_batch."""
        n, t = batch.num_seqs, batch.num_tokens
        self.slot_mapping[:t].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        # columns past the live batch's width keep stale ids; no kernel reads past a row's length
        cols = batch.block_tables.shape[1]
        assert cols <= self.block_tables.shape[1], "block table wider than max_blocks_per_seq"
        self.block_tables[:n, :cols].copy_(batch.block_tables, non_blocking=True)
        if t < graph_batch.num_tokens:
            self.slot_mapping[t:graph_batch.num_tokens].fill_(-1)
        if n < graph_batch.num_seqs:
            self.seq_lens[n:graph_batch.num_seqs].fill_(0)
        if not self.decode_only:
            self.query_start_loc[:n + 1].copy_(batch.query_start_loc, non_blocking=True)
            if n < graph_batch.num_seqs:  # empty sequences after the last: every one starts at t
                self.query_start_loc[n + 1:graph_batch.num_seqs + 1].fill_(t)
