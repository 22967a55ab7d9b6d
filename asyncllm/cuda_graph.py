"""CUDA graphs for decode-only steps.

A decode step of B sequences launches hundreds of small kernels; replaying a captured graph
launches them at once. One graph is captured per bucketed batch size (all sharing one memory
pool, largest first so smaller ones fit in its memory); a step of B sequences replays the
smallest bucket >= B with the extra rows padded. Model inputs (token ids, positions) live in this
object's static buffers; attention metadata lives in the backend's (prepare_for_capture /
prepare_for_replay), so this code knows nothing of any kernel.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from asyncllm.attention.base import AttentionBackend, ForwardBatch

logger = logging.getLogger("asyncllm")


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    return [s for s in sizes if s < max_batch_size] + [max_batch_size]


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_batch_size: int,
                 max_seq_len: int, device: torch.device):
        self.model = model
        self.backend = backend
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size = self.batch_sizes[-1]
        max_blocks_per_seq = (max_seq_len + backend.block_size - 1) // backend.block_size
        backend.init_cuda_graph_state(self.max_batch_size, max_blocks_per_seq)
        self.input_ids = torch.zeros(self.max_batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch_size, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(self.max_batch_size, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _static_batch(self, bs: int) -> ForwardBatch:
        batch = ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], slot_mapping=None,
            query_start_loc=None, seq_lens=None, block_tables=None, logits_indices=self.logits_indices[:bs],
            num_seqs=bs, num_tokens=bs, max_query_len=1, max_seq_len=1, attn_backend=self.backend)
        self.backend.prepare_for_capture(batch)
        return batch

    def _run_model(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = None
        for bs in reversed(self.batch_sizes):
            batch = self._static_batch(bs)
            self._run_model(batch)  # warm-up: autotuning and lazy initialisation stay out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._run_model(batch)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            self.batches[bs] = batch
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch sizes up to %d) in %.1f s", len(self.graphs),
                    self.max_batch_size, time.perf_counter() - start)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode_only and batch.num_seqs <= self.max_batch_size

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits for a decode-only batch, by replaying the graph of the next bucket up."""
        num_seqs = batch.num_seqs
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]
        self.input_ids[:num_seqs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(batch.positions, non_blocking=True)
        self.backend.prepare_for_replay(batch, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:num_seqs]
