"""Decode graphs' inputs in one device buffer, written from the host with one copy per step.

A decode step replayed from a CUDA graph needs its token ids, positions, KV slots, sequence lengths
and block tables (and, to sample in a sampler graph, temperatures and noise keys) in the static
buffers the graphs were captured on. Uploaded as separate tensors and then copied into those
buffers, that is some 13 tensor objects and 6 device copies per step, each a few microseconds of
host time, and on a slow host a batch-1 step is host-bound. Here the
static buffers are views of one device buffer; the host writes a step's fields into a pinned copy
of its layout and one copy lands them all. Every field has a region of max_batch_size rows, and
the rows past a step's own are written as padding (KV slot -1, length 0: the kernels skip them),
so one layout serves every decode graph whatever its batch size or context bound.

The block tables come last, max_blocks_per_seq wide: a step's rows go in the same copy while they
are small (TABLE_BYTES_IN_COPY); wider ones (long contexts with small KV blocks) would copy mostly
unused columns, so they go in a second copy of just the step's width.
"""
from __future__ import annotations

import numpy as np
import torch

from asyncllm.attention.graph_buffers import PagedGraphBuffers
from asyncllm.runner.host_upload import aligned_bytes, upload_arrays
from asyncllm.runner.step_inputs import StepInputs

TABLE_BYTES_IN_COPY = 64 * 1024
# (name, dtype): each field's region holds max_batch_size values; the block tables follow them
_FIELDS = (("input_ids", torch.int64), ("positions", torch.int64), ("slot_mapping", torch.int64),
           ("seq_lens", torch.int32), ("temperatures", torch.float32), ("keys", torch.int64))


class DecodeStaging:
    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, block_size: int, device: torch.device):
        self.max_batch_size = rows = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        # each field starts aligned (host_upload's alignment: any dtype, and Triton's pointer specialisation)
        starts, offset = {}, 0
        for name, dtype in _FIELDS:
            starts[name] = offset
            offset += aligned_bytes(rows * dtype.itemsize)
        self._first_element = {name: starts[name] // dtype.itemsize for name, dtype in _FIELDS}
        self.table_offset = offset
        self.buffer = torch.zeros(aligned_bytes(offset + rows * max_blocks_per_seq * 4), dtype=torch.uint8,
                                  device=device)
        for name, dtype in _FIELDS:
            setattr(self, name, self.buffer[starts[name]:starts[name] + rows * dtype.itemsize].view(dtype))
        self.block_tables = self.buffer[offset:offset + rows * max_blocks_per_seq * 4].view(torch.int32).view(
            rows, max_blocks_per_seq)
        self.slot_mapping.fill_(-1)
        # the attention backend's decode-graph metadata are these views (query_start_loc, constant
        # for decode graphs, is its own)
        self.paged_buffers = PagedGraphBuffers.over(self.slot_mapping, self.seq_lens, self.block_tables, block_size)
        self.device = device
        self._pinned = device.type == "cuda"
        self._copy_targets: dict[int, torch.Tensor] = {}  # bytes copied -> the buffer's first that many
        self._row_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def rows(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first num_seqs rows of (input_ids, temperatures, keys): a step's own (kept, not made per step)."""
        views = self._row_views.get(num_seqs)
        if views is None:
            views = self._row_views[num_seqs] = (self.input_ids[:num_seqs], self.temperatures[:num_seqs],
                                                 self.keys[:num_seqs])
        return views

    def stage(self, inputs: StepInputs, extra: list[np.ndarray] = (),
              sampling_arrays: dict[str, np.ndarray] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Queue the copy of a decode step's inputs (one token per sequence, at most max_batch_size
        sequences) and its sampling temperatures and noise keys into the buffers (temperature 0 where
        sampling_arrays has none: every row greedy, for a sampler graph's argmax). extra and the
        other sampling arrays (SamplingPlan.arrays) go in a second copy where there are any
        (host_upload). Returns the step's input ids on the device, and extra's tensors then the
        sampling arrays', in order. The arrays may be reused once this returns."""
        sampling_arrays = sampling_arrays or {}
        self._stage(inputs, sampling_arrays.get("temperatures"), sampling_arrays.get("keys"))
        input_ids, temperatures, keys = self.rows(len(inputs.input_ids))
        staged = {"temperatures": temperatures, "keys": keys}
        extra = list(extra)
        rest = upload_arrays(extra + [a for name, a in sampling_arrays.items() if name not in staged], self.device)
        others = iter(rest[len(extra):])
        return input_ids, rest[:len(extra)] + [staged[name] if name in staged else next(others)
                                               for name in sampling_arrays]

    def _stage(self, inputs: StepInputs, temperatures: np.ndarray | None, keys: np.ndarray | None) -> None:
        block_tables = inputs.block_tables
        n, width = block_tables.shape
        assert n == len(inputs.input_ids) <= self.max_batch_size and width <= self.max_blocks_per_seq
        table_cols = self.max_blocks_per_seq if n * self.max_blocks_per_seq * 4 <= TABLE_BYTES_IN_COPY else width
        table_end = self.table_offset + n * table_cols * 4
        # torch's caching host allocator keeps this memory from reuse until the copy has run
        host = torch.empty(aligned_bytes(table_end), dtype=torch.uint8, pin_memory=self._pinned)
        host_bytes = host.numpy()
        host_bytes[:self.table_offset] = 0
        int64, int32, float32 = (host_bytes.view(t) for t in (np.int64, np.int32, np.float32))
        at = self._first_element  # each field's first element in a view of its dtype
        int64[at["input_ids"]:][:n] = inputs.input_ids
        int64[at["positions"]:][:n] = inputs.positions
        slots = int64[at["slot_mapping"]:][:self.max_batch_size]
        slots[:n] = inputs.slot_mapping
        slots[n:] = -1  # padding rows store nothing (and have length 0)
        int32[at["seq_lens"]:][:n] = inputs.seq_lens
        if temperatures is not None:  # else zero, from the fill above: every row greedy
            float32[at["temperatures"]:][:n] = temperatures
            int64[at["keys"]:][:n] = keys
        tables = int32[self.table_offset // 4:table_end // 4].reshape(n, table_cols)
        tables[:, :width] = block_tables
        if table_cols > width:
            tables[:, width:] = 0
        if table_cols == self.max_blocks_per_seq:
            self._copy_target(host.shape[0]).copy_(host, non_blocking=True)
        else:  # the fields in one copy, the step's table columns in another
            self._copy_target(self.table_offset).copy_(host[:self.table_offset], non_blocking=True)
            self.block_tables[:n, :width].copy_(host[self.table_offset:table_end].view(torch.int32).view(n, width),
                                                non_blocking=True)

    def _copy_target(self, nbytes: int) -> torch.Tensor:
        target = self._copy_targets.get(nbytes)
        if target is None:
            target = self._copy_targets[nbytes] = self.buffer[:nbytes]
        return target
