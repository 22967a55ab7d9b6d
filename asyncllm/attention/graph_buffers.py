"""The static paged-attention metadata that CUDA graphs read, shared by the backends that capture."""
from __future__ import annotations

import torch

from asyncllm.attention.base import ForwardBatch


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

    @classmethod
    def over(cls, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
             block_size: int) -> "PagedGraphBuffers":
        """Decode-graph buffers that are the given tensors (views of the runner's staging buffer,
        runner/decode_staging.py, which writes a step's metadata into them itself)."""
        buffers = cls.__new__(cls)
        buffers.decode_only = True
        buffers.slot_mapping, buffers.seq_lens, buffers.block_tables = slot_mapping, seq_lens, block_tables
        buffers.query_start_loc = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        buffers.max_seq_len = block_tables.shape[1] * block_size
        return buffers

    def bind(self, batch: ForwardBatch) -> None:
        assert batch.is_decode_only == self.decode_only, "decode graphs and mixed graphs use separate buffers"
        num_tokens, num_seqs = batch.num_tokens, batch.num_seqs
        batch.slot_mapping = self.slot_mapping[:num_tokens]
        batch.seq_lens = self.seq_lens[:num_seqs]
        batch.block_tables = self.block_tables[:num_seqs]
        batch.query_start_loc = self.query_start_loc[:num_seqs + 1]
        assert 0 < batch.max_seq_len <= self.max_seq_len, "a graph's context bound is within max_blocks_per_seq"
        # warm-up and capture run the kernels once on these buffers: store nothing, read nothing
        self.slot_mapping[:num_tokens].fill_(-1)
        self.seq_lens[:num_seqs].fill_(0)
        if not self.decode_only:
            self.query_start_loc[:num_seqs + 1].fill_(0)

    def load(self, batch: ForwardBatch, graph_batch: ForwardBatch) -> None:
        """Copy batch's metadata in for a replay of the graph captured with graph_batch."""
        n, t = batch.num_seqs, batch.num_tokens
        # a batch the graph's size copies into the capture's views (bind): no new views, each a host cost
        full = n == graph_batch.num_seqs and t == graph_batch.num_tokens
        (graph_batch.slot_mapping if full else self.slot_mapping[:t]).copy_(batch.slot_mapping, non_blocking=True)
        (graph_batch.seq_lens if full else self.seq_lens[:n]).copy_(batch.seq_lens, non_blocking=True)
        # columns past the live batch's width keep stale ids; no kernel reads past a row's length
        cols = batch.block_tables.shape[1]
        assert cols <= self.block_tables.shape[1], "block table wider than max_blocks_per_seq"
        (graph_batch.block_tables[:, :cols] if full else self.block_tables[:n, :cols]).copy_(
            batch.block_tables, non_blocking=True)
        if t < graph_batch.num_tokens:
            self.slot_mapping[t:graph_batch.num_tokens].fill_(-1)
        if n < graph_batch.num_seqs:
            self.seq_lens[n:graph_batch.num_seqs].fill_(0)
        if not self.decode_only:
            self.query_start_loc[:n + 1].copy_(batch.query_start_loc, non_blocking=True)
            if n < graph_batch.num_seqs:  # empty sequences after the last: every one starts at t
                self.query_start_loc[n + 1:graph_batch.num_seqs + 1].fill_(t)
