"""CUDA graphs for decode steps and small mixed steps.

A step launches hundreds of small kernels, and at small sizes launching them (Python and driver
work for each) takes longer than running them; replaying a captured graph launches
them at once. Decode graphs are captured per bucketed batch size, and per context-length bound
where the backend asks for it (a Triton decode graph bakes its KV split count in, and the count
that suits a 40k-token bound wastes most splits on a 200-token chat); where the backend supports
it, mixed graphs (prefill chunks, with or without decodes) per bucketed token count up to a bound.
All share one memory pool, captured largest first so smaller ones fit in its memory. A step
replays the smallest bucket that holds it, the rows past it padded. Model inputs (token ids,
positions, sampled rows) live in this object's static buffers; attention metadata lives in the
backend's (prepare_for_capture / prepare_for_replay), so this code knows nothing of any kernel.
Decode graphs' inputs and metadata (and their sampler graphs' settings) are views of one staging
buffer (runner/decode_staging.py), which the runner fills from the host with one copy a step
(stage, then replay_staged); a decode batch already on the device is copied in by run.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from asyncllm.attention.base import AttentionBackend, ForwardBatch
from asyncllm.layers import device_wide
from asyncllm.layers.device_wide import capturing
from asyncllm.runner.decode_staging import DecodeStaging

logger = logging.getLogger("asyncllm")


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    return [s for s in sizes if s < max_batch_size] + [max_batch_size]


def graph_token_sizes(max_num_tokens: int) -> list[int]:
    """Token buckets of the mixed graphs: powers of two from 16, with halfway steps from 512 so
    a step pads by at most a third."""
    if max_num_tokens <= 0:
        return []
    sizes, size = [], 16
    while size < max_num_tokens:
        sizes.append(size)
        if size >= 512 and size + size // 2 < max_num_tokens:
            sizes.append(size + size // 2)
        size *= 2
    return sizes + [max_num_tokens]


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_batch_size: int,
                 max_seq_len: int, device: torch.device, max_mixed_tokens: int = 0, warm_up: bool = True):
        """warm_up: an eager run before each capture (start-up: kernels compile and the skinny GEMM
        decides there, never inside a capture); a wake's re-capture, where all that is done, skips it."""
        self.model = model
        self.warm_up = warm_up
        self.backend = backend
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size = self.batch_sizes[-1]
        if not backend.supports_mixed_cuda_graphs:
            max_mixed_tokens = 0
        self.token_sizes = graph_token_sizes(max_mixed_tokens)
        self.max_mixed_tokens = max_mixed_tokens
        max_blocks_per_seq = (max_seq_len + backend.block_size - 1) // backend.block_size
        self.max_context = max_blocks_per_seq * backend.block_size
        # decode graphs' context bounds per batch size, ascending, the last max_context
        self.context_bounds = {size: backend.decode_graph_context_bounds(size, self.max_context)
                               for size in self.batch_sizes}
        self.staging = DecodeStaging(self.max_batch_size, max_blocks_per_seq, backend.block_size, device)
        backend.init_cuda_graph_state(self.max_batch_size, max_blocks_per_seq, max_mixed_tokens,
                                      decode_buffers=self.staging.paged_buffers)
        # mixed graphs' token inputs (decode graphs': the staging buffer's)
        self.input_ids = torch.zeros(max_mixed_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_mixed_tokens, dtype=torch.int64, device=device)
        # rows whose logits a mixed step samples; decode graphs compute every row's
        self.logits_indices = torch.zeros(min(max_mixed_tokens, self.max_batch_size), dtype=torch.int64,
                                          device=device)
        # keyed by (kind, batch size or token count, context bound)
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self.batches: dict[tuple[str, int, int], ForwardBatch] = {}
        self.outputs: dict[tuple[str, int, int], torch.Tensor] = {}
        self.num_replays = {"decode": 0, "mixed": 0}
        # the key of the graph the last step replayed, if its logits rows were the graph output's first
        # rows (a sampler graph over that output can then sample them); None after an eager step
        self.last_prefix_key: tuple[str, int, int] | None = None
        # whether that step's inputs were staged (replay_staged): its sampler settings are in place
        self.last_staged = False
        self._capture_all()

    def _static_batch(self, kind: str, size: int, context_bound: int) -> ForwardBatch:
        if kind == "decode":
            num_tokens = num_seqs = size
            token_inputs = self.staging
        else:  # a mixed graph of `size` tokens takes as many sequences as a step can bring
            num_tokens, num_seqs = size, min(size, self.max_batch_size)
            token_inputs = self
        batch = ForwardBatch(
            input_ids=token_inputs.input_ids[:num_tokens], positions=token_inputs.positions[:num_tokens],
            slot_mapping=None,
            query_start_loc=None, seq_lens=None, block_tables=None,
            logits_indices=None if kind == "decode" else self.logits_indices[:num_seqs],
            num_seqs=num_seqs, num_tokens=num_tokens, max_query_len=1 if kind == "decode" else num_tokens,
            max_seq_len=context_bound, attn_backend=self.backend)
        self.backend.prepare_for_capture(batch)
        return batch

    def _run_model(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, batch)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        self._pool = None
        # largest first, so that smaller graphs fit in the memory the first one took
        keys = [("mixed", t, self.max_context) for t in self.token_sizes]
        keys += [("decode", b, bound) for b in self.batch_sizes for bound in self.context_bounds[b]]
        keys.sort(key=lambda key: (-key[1], -key[2]))
        for key in keys:
            self._capture(key)
        device_wide.synchronize()
        logger.info("captured %d CUDA graphs (decode batches up to %d, mixed steps up to %d tokens) in %.1f s",
                    len(self.graphs), self.max_batch_size, self.max_mixed_tokens, time.perf_counter() - start)
        logger.debug("decode graphs' context bounds by batch size: %s", self.context_bounds)

    def _capture(self, key: tuple[str, int, int]) -> None:
        batch = self._static_batch(*key)
        if self.warm_up:
            self._run_model(batch)  # autotuning and lazy initialisation stay out of the graph
        device_wide.synchronize()
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self._pool):
            self.outputs[key] = self._run_model(batch)
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[key] = graph
        self.batches[key] = batch

    @torch.inference_mode()
    def recapture(self, keys: list[tuple[str, int, int]]) -> None:
        """Capture these graphs again, in the shared pool: after a change to what the forward launches
        (runner/decode_tuning.py). A graph captured over one of their outputs (a sampler graph) must
        be captured again too."""
        for key in keys:
            graph = self.graphs.pop(key, None)  # gone where a capture of it failed before
            if graph is not None:
                graph.reset()
            self.outputs.pop(key, None)
            self._capture(key)
        device_wide.synchronize()

    def replay_ms(self, key: tuple[str, int, int], iters: int) -> float:
        """Device ms of one replay of a graph, over iters back-to-back replays between two events (no
        host time inside), on the metadata its buffers hold; after one replay untimed."""
        graph = self.graphs[key]
        graph.replay()
        device_wide.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    def release(self) -> None:
        """Destroy every graph. Before a tensor-parallel engine's process group goes: a graph that
        captured an NCCL all-reduce holds its communicator, whose teardown then waits forever."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.batches.clear()
        self.outputs.clear()
        device_wide.synchronize()

    def decode_key(self, num_seqs: int, max_seq_len: int) -> tuple[str, int, int] | None:
        """The decode graph that replays a decode step of num_seqs sequences whose longest is
        max_seq_len tokens (None: more sequences than any graph takes)."""
        if num_seqs > self.max_batch_size:
            return None
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]
        bounds = self.context_bounds[size]
        return "decode", size, bounds[bisect.bisect_left(bounds, max_seq_len)]

    def replay_staged(self, key: tuple[str, int, int], num_seqs: int) -> torch.Tensor:
        """Logits of a decode step staged (self.staging.stage) for the graph key, every row sampled."""
        logits = self._replay(key, num_seqs)
        self.last_staged = True
        return logits

    def _replay(self, key: tuple[str, int, int], num_rows: int) -> torch.Tensor:
        """Replay the graph key: its output's first num_rows logits rows (the whole output where
        that is all of it: no new view)."""
        self.graphs[key].replay()
        self.num_replays[key[0]] += 1
        self.last_prefix_key = key
        self.last_staged = False
        logits = self.outputs[key]
        return logits if num_rows == logits.shape[0] else logits[:num_rows]

    def _key(self, batch: ForwardBatch) -> tuple[str, int, int] | None:
        num_logits = batch.logits_indices.shape[0]
        if batch.is_decode_only and batch.num_seqs <= self.max_batch_size and num_logits <= batch.num_seqs:
            return self.decode_key(batch.num_seqs, batch.max_seq_len)
        if batch.num_tokens <= self.max_mixed_tokens:
            size = self.token_sizes[bisect.bisect_left(self.token_sizes, batch.num_tokens)]
            # a mixed graph gathers min(size, max_batch_size) logits rows: a speculative verification's
            # 1 + k rows per sequence fit as a step's sequences do (both are at most its tokens)
            if max(batch.num_seqs, num_logits) <= min(size, self.max_batch_size):
                return "mixed", size, self.max_context
        return None  # more logits rows than any graph gathers (prompt_logprobs of a long prompt), or too big

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits of batch's sampled rows, by replaying the graph of the next bucket up; None where
        no graph fits the batch (the caller runs the model eagerly)."""
        key = self._key(batch)
        if key is None:
            self.last_prefix_key = None
            return None
        graph_batch = self.batches[key]
        num_tokens = batch.num_tokens
        full = num_tokens == graph_batch.num_tokens  # the capture's views: no new ones (each a host cost)
        (graph_batch.input_ids if full else graph_batch.input_ids[:num_tokens]).copy_(batch.input_ids,
                                                                                     non_blocking=True)
        (graph_batch.positions if full else graph_batch.positions[:num_tokens]).copy_(batch.positions,
                                                                                     non_blocking=True)
        num_logits = batch.logits_indices.shape[0]
        if key[0] == "mixed":
            self.logits_indices[:num_logits].copy_(batch.logits_indices, non_blocking=True)
            # rows past them gather row 0: a stale index from a larger graph's step would overrun
            self.logits_indices[num_logits:graph_batch.num_seqs].zero_()
        self.backend.prepare_for_replay(batch, graph_batch)
        if key[0] == "decode" and num_logits < batch.num_seqs:
            # a decode-only step can hold a 1-token prefill chunk that does not sample: the graph
            # computed logits for every row (row = token here), keep the sampled rows only
            logits = self._replay(key, key[1])
            self.last_prefix_key = None
            return logits[batch.logits_indices]
        return self._replay(key, num_logits)
