"""The Triton backend: store_kvcache + paged_attention kernels, CUDA-graph capable for decode
steps and for small mixed steps (prefill chunks with or without decodes). In a mixed step the
decodes (one query row each) go to the decode kernel and the prefill chunks to the varlen kernel.

Eager steps pick the decode split count per step from the batch (prepare_metadata). A CUDA graph
bakes its grid in, so each decode graph gets a split count fixed at capture from its context
bound; the decode kernel derives split lengths from the runtime seq_lens, so that count is valid
for whatever lengths up to the bound a replay brings. Each batch size has graphs for the bounds in
DECODE_GRAPH_CONTEXTS where the count differs (decode_graph_context_bounds): one bound of
max_model_len gave a batch-1 chat 64 splits, most of them empty. A mixed graph runs the varlen kernel with the
grid and tile shape of its token bound; padding sequences have no query rows and return at once.
A chunk of a few hundred query rows over a long context splits its KV across programs
(choose_prefill_splits): eager steps choose the count per step; a mixed graph fixes it at capture
for its token bucket and the longest context, and the kernel sizes each tile's splits from the
runtime lengths (a short tile is not split at all), so that count suits any replay: a new chat
turn over a long cached history, a prefix-cache hit, or a prompt's last chunk beside decodes.
Steps whose contexts are too short for any tile to split (a prompt with no cached prefix under
2 * split_tokens) replay a second graph of the bucket, captured unsplit (mixed_graph_context_bounds).
All per-step metadata a graph reads lives in static buffers that prepare_for_replay refreshes
with a few small device copies; the decode graphs' are the runner's staging buffer's views, which
it fills from the host itself (runner/decode_staging.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.attention.base import AttentionBackend, DecodeRope, ForwardBatch
from asyncllm.attention.graph_buffers import PagedGraphBuffers
from asyncllm.kernels import (choose_num_splits, choose_prefill_splits, paged_attention, split_workspace_numel,
                              store_kvcache)
from asyncllm.kernels.paged_attention import DEFAULT_NUM_SMS, PREFILL_SPLIT_TOKENS, longest_unsplit_context

# decode graphs' context bounds below max_model_len. A graph bakes its split count in, and the best
# count grows with the context (in the batch-1 decode graph about one split per 40 tokens), so short
# contexts get graphs of their own; these bounds' counts, each for half its bound (_graph_num_splits),
# are 4, 16, 32, then 64 up to max_model_len
DECODE_GRAPH_CONTEXTS = (256, 1024, 2048)


@dataclass
class TritonAttentionMetadata:
    num_splits: int = 1  # the decode kernel's (decode steps, and a mixed step's decodes)
    prefill_splits: int = 1  # the varlen kernel's KV splits per query tile (prefill / mixed steps)
    workspace: torch.Tensor | None = None  # split-KV scratch (decode's, then prefill's), shared by a step's layers
    single_rows: bool = True  # a mixed step's one-row sequences (decodes) go to the decode kernel


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_mixed_cuda_graphs = True

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, rotate_qk: bool = False,
                 split_tokens: int = PREFILL_SPLIT_TOKENS):
        super().__init__(k_caches, v_caches, num_heads, num_kv_heads, head_dim, scale, rotate_qk)
        # the least KV a prefill split takes (kernels.choose_prefill_splits); tests lower it to send
        # short contexts down the split path
        self.split_tokens = split_tokens
        self.device = k_caches[0].device
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = DEFAULT_NUM_SMS
        self._eager_workspace: torch.Tensor | None = None
        self._graph: PagedGraphBuffers | None = None  # decode graphs
        self._mixed_graph: PagedGraphBuffers | None = None  # graphs of steps with prefill chunks
        self._graph_workspace: torch.Tensor | None = None

    # ---- per step ------------------------------------------------------------------------------
    def _workspace(self, numel: int) -> torch.Tensor:
        # grow-only and reused across steps: kernels run in stream order, so the next step's
        # writes cannot overtake this step's reads
        if self._eager_workspace is None or self._eager_workspace.numel() < numel:
            self._eager_workspace = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._eager_workspace

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        meta = TritonAttentionMetadata()
        # decodes in a mixed step: the split count for them (a bound on their length is enough)
        num_single = batch.num_seqs if batch.max_query_len == 1 else batch.query_lens_cpu.count(1)
        meta.single_rows = num_single > 0
        if num_single:
            meta.num_splits = choose_num_splits(num_single, self.num_kv_heads, batch.max_seq_len, self.num_sms)
        if batch.max_query_len > 1:
            meta.prefill_splits = self._prefill_splits(batch.num_tokens, batch.num_seqs, batch.max_query_len,
                                                       batch.max_seq_len)
        numel = self._workspace_numel(batch.num_seqs, batch.num_tokens, meta)
        if numel:
            meta.workspace = self._workspace(numel)
        batch.attn_metadata = meta

    def _prefill_splits(self, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int) -> int:
        return choose_prefill_splits(num_tokens, num_seqs, max_query_len, self.num_heads, self.num_kv_heads,
                                     self.head_dim, self.k_caches[0].element_size() <= 2, max_seq_len, self.num_sms,
                                     self.split_tokens)

    def _workspace_numel(self, num_seqs: int, num_tokens: int, meta: TritonAttentionMetadata) -> int:
        # paged_attention's layout: the decode kernel's partials, then the varlen kernel's
        return (split_workspace_numel(num_seqs, self.num_heads, self.head_dim, meta.num_splits)
                + split_workspace_numel(num_tokens, self.num_heads, self.head_dim, meta.prefill_splits))

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, self.kv_scales)

    def attend(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch,
               rope: DecodeRope | None = None) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer_id], self.v_caches[layer_id]
        meta = batch.attn_metadata  # set once per step by prepare_metadata or prepare_for_capture
        return paged_attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                               batch.max_query_len, batch.max_seq_len, self.scale,
                               num_splits=meta.num_splits, workspace=meta.workspace, num_sms=self.num_sms,
                               single_rows=meta.single_rows, rope=rope, prefill_splits=meta.prefill_splits,
                               split_tokens=self.split_tokens, kv_scales=self.kv_scales)

    def attend_qkv(self, layer_id: int, qkv: torch.Tensor, rope: DecodeRope, batch: ForwardBatch) -> torch.Tensor:
        # paged_attention decides: on the small grids of batch-1 decodes the decode kernel does the q/k
        # norm + rotary and K/V store itself (one kernel fewer a layer), elsewhere the rotary kernel first
        return self.attend(layer_id, qkv, batch, rope)

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_batch_size: int, max_blocks_per_seq: int, max_mixed_tokens: int = 0,
                              decode_buffers: PagedGraphBuffers | None = None) -> None:
        self._graph = decode_buffers or PagedGraphBuffers(max_batch_size, max_batch_size, max_blocks_per_seq,
                                                          self.block_size, self.device)
        # one scratch buffer sized for the most demanding graph, decode or mixed; graphs replay one at a time
        longest = self._graph.max_seq_len
        numel = max(split_workspace_numel(bs, self.num_heads, self.head_dim, self._graph_num_splits(bs, longest))
                    for bs in range(1, max_batch_size + 1))
        self._mixed_graph = None
        if max_mixed_tokens:
            self._mixed_graph = PagedGraphBuffers(max_mixed_tokens, min(max_mixed_tokens, max_batch_size),
                                                  max_blocks_per_seq, self.block_size, self.device, decode_only=False)
            # every token count a mixed bucket may have, not just the runner's buckets (which it owns)
            longest = self._mixed_graph.max_seq_len
            numel = max(numel, *(split_workspace_numel(tokens, self.num_heads, self.head_dim,
                                                       self._mixed_graph_prefill_splits(
                                                           tokens, min(tokens, max_batch_size), longest))
                                 for tokens in range(1, max_mixed_tokens + 1)))
        self._graph_workspace = torch.empty(max(numel, 1), dtype=torch.float32, device=self.device)

    def _mixed_graph_prefill_splits(self, num_tokens: int, num_seqs: int, context_bound: int) -> int:
        # fixed at capture for the bucket's worst case: its tokens as one chunk (the fewest tiles, so the
        # most splits), its sequence capacity (the grid's bound) and the longest context a replay may
        # bring; the kernel cuts each tile's KV by its runtime length, so shorter replays stay right
        # and tiles over short contexts go unsplit
        return self._prefill_splits(num_tokens, num_seqs, num_tokens, context_bound)

    def mixed_graph_context_bounds(self, num_tokens: int, num_seqs: int, max_seq_len: int) -> list[int]:
        # A graph split for long contexts launches its split grid and a merge kernel a layer on every
        # replay, though over a short context no tile splits: every prompt with no cached prefix paid
        # that (issue 49's TTFT regression since split-KV prefill). Contexts too short for any tile
        # to split get a graph of their own without them: the varlen kernel alone, as before splits.
        unsplit = longest_unsplit_context(self.split_tokens)
        if unsplit < max_seq_len and self._mixed_graph_prefill_splits(num_tokens, num_seqs, max_seq_len) > 1:
            return [unsplit, max_seq_len]
        return [max_seq_len]

    def _graph_num_splits(self, batch_size: int, context_bound: int) -> int:
        # fixed at capture; the kernel sizes each split from the runtime length. A replay's context
        # lies anywhere below the bound, so the count is the one for half of it: the bound's own count
        # would cut the typical, shorter context into splits too short to pay their fixed cost
        return choose_num_splits(batch_size, self.num_kv_heads, max(1, context_bound // 2), self.num_sms)

    def decode_graph_context_bounds(self, batch_size: int, max_seq_len: int) -> list[int]:
        bounds, counts = [], []
        for bound in [b for b in DECODE_GRAPH_CONTEXTS if b < max_seq_len] + [max_seq_len]:
            count = self._graph_num_splits(batch_size, bound)
            if counts and counts[-1] == count:
                bounds[-1] = bound  # the same grid: one graph, for the longer bound
            else:
                bounds.append(bound)
                counts.append(count)
        return bounds

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        assert self._graph is not None, "call init_cuda_graph_state first"
        if not batch.is_decode_only:
            # the varlen kernel's grid is an upper bound from num_tokens and num_seqs, and its tile
            # shape follows max_query_len: all three are the graph's, whatever a replay brings
            self._mixed_graph.bind(batch)
            batch.max_query_len = batch.num_tokens
            # a replay's decodes are not known at capture: one split each (no reduce, no scratch)
            prefill_splits = self._mixed_graph_prefill_splits(batch.num_tokens, batch.num_seqs, batch.max_seq_len)
            batch.attn_metadata = TritonAttentionMetadata(
                num_splits=1, single_rows=True, prefill_splits=prefill_splits,
                workspace=self._graph_workspace if prefill_splits > 1 else None)
            return
        self._graph.bind(batch)
        num_splits = self._graph_num_splits(batch.num_seqs, batch.max_seq_len)
        batch.attn_metadata = TritonAttentionMetadata(
            num_splits=num_splits, workspace=self._graph_workspace if num_splits > 1 else None)

    def prepare_for_replay(self, batch: ForwardBatch, graph_batch: ForwardBatch) -> None:
        (self._graph if graph_batch.is_decode_only else self._mixed_graph).load(batch, graph_batch)
