"""CUDA graphs of plain sampling, one over each captured forward graph's logits.

A step whose rows ask for nothing beyond their temperature (SamplingTensors.is_plain: the common
chat request, sampled or greedy) spends more host time launching the sampling kernels than the
device spends running them: at batch 1 the two Triton launches and their buffers, or greedy's
eager argmax, are a noticeable share of a step of under a millisecond. After a forward graph's
replay its logits sit in that graph's static output, so the race over them is captured too, per forward graph, reading
temperatures and noise keys from static buffers (temperature 0: the race's argmax, the first
maximum as torch.argmax's): a step then costs a small copy and one replay, or just the replay where
the runner staged the settings with the step's inputs (decode graphs read them from the staging
buffer, runner/decode_staging.py, where a greedy row's temperature is staged as 0). The kernels are
the eager path's (layers/sampler.sample_race), so the tokens are the same bit for bit.
"""
from __future__ import annotations

import torch

from asyncllm.layers import device_wide
from asyncllm.layers.device_wide import capturing
from asyncllm.layers.sampler import SamplerOutput, SamplingTensors, sample_race
from asyncllm.runner.cuda_graph import CudaGraphRunner


class SamplerGraphs:
    def __init__(self, forward_graphs: CudaGraphRunner):
        self.forward_graphs = forward_graphs
        rows = max(logits.shape[0] for key, logits in forward_graphs.outputs.items() if key[0] == "mixed") \
            if forward_graphs.token_sizes else 0
        device = forward_graphs.staging.buffer.device
        # mixed graphs' settings (decode graphs': the staging buffer's); rows past a step's live ones
        # keep stale settings: their tokens are never read
        self.temperatures = torch.ones(rows, dtype=torch.float32, device=device)
        self.keys = torch.zeros(rows, dtype=torch.int64, device=device)
        # each graph's settings, the views it was captured on
        self.settings: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.token_ids: dict[tuple, torch.Tensor] = {}  # each graph's static output
        self.num_replays = 0
        # a pool of their own: nothing of theirs shares memory with the forward graphs' scratch
        self._pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        staging = self.forward_graphs.staging
        for key, logits in self.forward_graphs.outputs.items():
            rows = logits.shape[0]
            owner = staging if key[0] == "decode" else self
            temperatures, keys = self.settings[key] = owner.temperatures[:rows], owner.keys[:rows]
            sample_race(logits, temperatures, keys)  # warm-up: compiles stay out
            device_wide.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self._pool):
                self.token_ids[key] = sample_race(logits, temperatures, keys)
            self.graphs[key] = graph
        device_wide.synchronize()

    def sample(self, sampling: SamplingTensors, num_rows: int) -> SamplerOutput | None:
        """The step's tokens through the sampler graph of the forward graph just replayed, whose
        first num_rows logits rows are the step's; None where that does not apply (eager forward, a
        step that gathered its rows, no rows, or sampling that is not plain): the eager sampler runs then.

        The output is the graph's static buffer: the next replay of the same graph overwrites it, and
        everything that reads a step's ids (the copy to the host, the next step's inputs) is queued
        before the next step's sampling."""
        forward_graphs = self.forward_graphs
        key = forward_graphs.last_prefix_key
        if key is None or not num_rows or not sampling.is_plain:
            return None
        if not forward_graphs.last_staged:  # staged steps wrote their settings with their inputs
            temperatures, keys = self.settings[key]
            if sampling.all_greedy:
                temperatures[:num_rows].zero_()
            else:
                temperatures[:num_rows].copy_(sampling.temperatures, non_blocking=True)
                keys[:num_rows].copy_(sampling.keys, non_blocking=True)
        self.graphs[key].replay()
        self.num_replays += 1
        return SamplerOutput(self.token_ids[key][:num_rows])

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.token_ids.clear()
        self.settings.clear()
