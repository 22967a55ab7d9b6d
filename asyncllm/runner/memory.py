"""The runner's device memory: the KV cache sized (the memory probe), allocated and released; the
weights a sleeping engine parks (in host memory, or dropped) and brings back; and everything handed
back to the device when the engine closes. What other engines of the process would disturb (the
probe with the allocation, graph captures, empty_cache) runs under layers/device_wide.DEVICE_WIDE.

Two ways to sleep (the runner's sleep_path says which it took at start-up): where the CUDA driver's
virtual memory API is there (runner/stable_memory.py), the weights and the KV cache live at
addresses that outlive their memory, so sleep unmaps them and keeps the CUDA graphs, the attention
backend and the graphs' pool (what stays allocated asleep: the pool, the backend's buffers, the
model's buffers such as the rotary cache); wake maps them again and replays the same graphs.
Elsewhere (CPU, ROCm, enforce_eager, a failing driver) sleep drops all of it and wake re-captures.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
from collections.abc import Callable

import torch
from torch import nn

from asyncllm.config import config_error
from asyncllm.layers import device_wide
from asyncllm.layers.device_wide import DEVICE_WIDE
from asyncllm.layers.logits_adjustments import LogitsAdjustments, TokenCounts
from asyncllm.layers.sampler import SamplingTensors
from asyncllm.models.checkpoint import checkpoint_weights, load_weights
from asyncllm.runner.stable_memory import StableBuffer, StableMemoryError, StableTensors, stable_memory_unavailable

logger = logging.getLogger("asyncllm")

SLEEP_LEVELS = (1, 2)  # vLLM's: 1 weights to host memory, 2 weights dropped; the KV cache goes at both
MEMORY_PROBE_KIND = "memory probe"  # the start-up cache's kind of the probe's figures (startup_cache.py)


def probe_answer_fits(answer, total_bytes: int) -> bool:
    """Whether a stored memory-probe answer is one: [activation peak, retained] bytes, whole numbers
    from 0 up to the device's memory."""
    return isinstance(answer, list) and len(answer) == 2 and all(
        type(value) is int and 0 <= value <= total_bytes for value in answer)


def stable_memory_refusal(device: torch.device, enforce_eager: bool, tensor_parallel: bool) -> str | None:
    """Why a runner keeps torch's allocator for its weights and KV cache (wake then re-captures the
    graphs), or None: they go into StableBuffers and the graphs outlive a sleep."""
    if device.type == "cuda" and enforce_eager:
        return "enforce_eager: no CUDA graphs to keep"
    if tensor_parallel:
        return "tensor parallel: no sleep"
    return stable_memory_unavailable(device)


def free_device_memory(device: torch.device) -> None:
    """Hand the memory of tensors just dropped back to the device. A model's modules hold bound
    methods of themselves (each parameter's weight_loader, the attention's norm-rope path): cycles
    that only the cyclic collector frees, so it runs first (the process's start-up heap is frozen
    out of its walk, engine/startup_heap.py)."""
    gc.collect()
    if device.type == "cuda":
        with DEVICE_WIDE:
            device_wide.synchronize(device)
            device_wide.empty_cache()


class ParkedWeights:
    """A sleeping model's weights: level 1 keeps a copy of every parameter in host memory (pinned on
    CUDA, for a fast copy back; on CPU they stay where they are), level 2 drops them (wake reads the
    checkpoint again); buffers (the rotary cache, computed when the model was built) go to host
    memory at both levels. Made whole or not at all (host memory), so a sleep that fails changes nothing."""

    def __init__(self, model: nn.Module, level: int, device: torch.device):
        self.level = level
        self.device = device
        params = list(model.parameters())  # a tied weight is one parameter: listed once
        self._tensors = params + list(model.buffers())
        self._shapes = [t.shape for t in self._tensors]
        self._dropped = [level == 2 and i < len(params) for i in range(len(self._tensors))]
        # a host copy, or None: dropped (level 2), or on CPU already where it would go
        self._host = [torch.empty_like(t, device="cpu", pin_memory=device.type == "cuda").copy_(t)
                      if device.type != "cpu" and not dropped else None
                      for t, dropped in zip(self._tensors, self._dropped)]

    def swap_out(self) -> None:
        """The device copies go (their memory is free once nothing else holds them)."""
        for tensor, host, dropped in zip(self._tensors, self._host, self._dropped):
            if dropped:  # no memory (a meta tensor cannot take a device tensor's place)
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            elif host is not None:
                tensor.data = host

    def restore(self, load_checkpoint: Callable[[], None]) -> None:
        """The weights back on the device: host copies copied back, dropped ones read again by
        load_checkpoint. A failure (device memory, the checkpoint) swaps them out again."""
        copies = [torch.empty(shape, dtype=t.dtype, device=self.device) if dropped else
                  host.to(self.device, non_blocking=True) if host is not None else None
                  for t, shape, host, dropped in zip(self._tensors, self._shapes, self._host, self._dropped)]
        for tensor, copy in zip(self._tensors, copies):
            if copy is not None:
                tensor.data = copy
        del copies
        try:
            if self.level == 2:
                load_checkpoint()
            if self.device.type == "cuda":
                device_wide.synchronize(self.device)  # the copies out of pinned memory end before it is freed
        except BaseException:
            self.swap_out()
            raise


class RunnerMemory:
    """ModelRunner's device memory, a mixin over the runner's own attributes (config, device, dtype,
    model, sampler, the KV geometry) and steps (_create_backend, _synthetic_step, _forward,
    _capture_graphs). A sleeping runner has no KV cache, attention backend or graphs, and its
    weights are parked (ParkedWeights); it runs no step until wake()."""

    sleep_level: int | None = None  # 1 or 2 while asleep
    _parked: ParkedWeights | None = None
    stable_weights: StableTensors | None = None  # the parameters in a StableBuffer: sleep keeps the graphs
    _kv_buffer: StableBuffer | None = None  # the KV cache's, with stable_weights
    sleep_path = "recapture"  # what a wake does with the CUDA graphs, and why (set by _choose_sleep_path)

    def _choose_sleep_path(self) -> None:
        """After the weights are loaded: into a StableBuffer where the driver allows (else a reason)."""
        reason = stable_memory_refusal(self.device, self.config.enforce_eager, self.step_group is not None)
        if reason is None:
            with DEVICE_WIDE:  # the loading's temporaries cached by torch: the move needs the weights twice, briefly
                device_wide.empty_cache()
            try:
                self.stable_weights = StableTensors(list(self.model.parameters()), self.device)
            except StableMemoryError as error:  # (out of memory, too) nothing moved yet: they are where they were
                reason = str(error)
        self.sleep_path = "stable memory: wake keeps the CUDA graphs" if reason is None else f"recapture ({reason})"
        logger.info("sleep/wake: %s", self.sleep_path)

    @property
    def kv_bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def _allocate_kv_cache(self) -> None:
        shape = (2, self.num_layers, self.num_kvcache_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.stable_weights is not None:
            self._kv_buffer = StableBuffer(torch.Size(shape).numel() * self.kv_dtype.itemsize, self.device.index)
            self._kv_buffer.map()
            self.kv_cache = self._kv_buffer.tensor().view(self.kv_dtype).view(shape).zero_()
            return
        # zeros, not garbage: the CPU path's attention reads whole blocks (masked), where NaN would spread
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _release_kv_cache(self) -> None:
        """The graphs, the attention backend (views of the cache, and its workspaces) and the cache go."""
        self.release_cuda_graphs()
        self.attn_backend = None
        self.kv_cache = None

    # ---- sleep and wake (between requests: engine/lifecycle.py) -------------------------------
    def sleep(self, level: int) -> None:
        """Release the KV cache (and the graphs, which read its addresses) and park the weights
        (ParkedWeights, level 1 or 2); a failure (host memory) changes nothing. With stable memory
        the weights' and the cache's memory is unmapped instead, the graphs kept."""
        if self.stable_weights is not None:
            self.stable_weights.park(keep_copy=level == 1)  # (pinned host memory first: a failure changes nothing)
            self._kv_buffer.unmap()
            self.sampling_inputs.release_token_counts()
            self.sleep_level = level
            free_device_memory(self.device)
            return
        parked = ParkedWeights(self.model, level, self.device)
        self._release_kv_cache()
        parked.swap_out()
        self.sampling_inputs.release_token_counts()  # every sequence has ended: the slots go
        self._parked, self.sleep_level = parked, level
        free_device_memory(self.device)

    def wake(self) -> None:
        """Bring the weights back and the KV cache (as many blocks as before, zeroed), the attention
        backend and the graphs, with every decision start-up took (no build, probe or tuning); a
        failure (device memory) leaves the runner asleep. With stable memory: the same addresses
        mapped again, the weights copied back (level 1) or read again (level 2), the same graphs."""
        if self.stable_weights is not None:
            self._wake_in_place()
            return
        parked = self._parked
        with DEVICE_WIDE:
            try:
                parked.restore(lambda: load_weights(self.model, checkpoint_weights(self.config, self.weight_layout,
                                                                                   device=self.device)))
                self._allocate_kv_cache()
                self.attn_backend = self._create_backend(self.kv_cache)
                try:
                    # the kernels were compiled and decided at start-up: no warm-up before each capture
                    self._capture_graphs(_untimed, warm_up=False, tune=False)
                except Exception:  # noqa: BLE001 - something lazy met a capture after all: as start-up does
                    logger.warning("CUDA graphs: re-capture without warm-ups failed; capturing with them",
                                   exc_info=True)
                    self.release_cuda_graphs()
                    self._capture_graphs(_untimed, warm_up=True, tune=False)
            except BaseException:
                self._release_kv_cache()
                parked.swap_out()
                free_device_memory(self.device)
                raise
        self._parked, self.sleep_level = None, None

    def _wake_in_place(self) -> None:
        with DEVICE_WIDE:
            try:
                self.stable_weights.restore()
                if self.sleep_level == 2:
                    load_weights(self.model, checkpoint_weights(self.config, self.weight_layout, device=self.device))
                self._kv_buffer.map()
                self.kv_cache.zero_()
                device_wide.synchronize(self.device)
            except BaseException:  # asleep as before (a level-1 host copy is kept until a wake succeeds)
                device_wide.synchronize(self.device)
                self.stable_weights.buffer.unmap()
                self._kv_buffer.unmap()
                raise
        self.sleep_level = None

    def _release_device_state(self) -> None:
        """close(): every tensor the runner holds goes (model, KV cache, graphs, sampler state,
        parked weights), and their memory back to the device."""
        self._release_kv_cache()
        if self.stable_weights is not None:  # now, not when the last view of them is collected
            device_wide.synchronize(self.device)
            self.stable_weights.close()
            if self._kv_buffer is not None:
                self._kv_buffer.unmap()
            self.stable_weights = self._kv_buffer = None
        self.model = self.sampler = self.sampling_inputs = self._parked = None
        free_device_memory(self.device)

    # ---- the memory probe ------------------------------------------------------------------------
    def _decide_num_blocks(self) -> int:
        if self.config.num_kvcache_blocks > 0:
            return self.config.num_kvcache_blocks
        if self.device.type == "cpu":
            field, blocks = "cpu_kvcache_bytes", self.config.cpu_kvcache_bytes // self.kv_bytes_per_block
            budget = f"{self.config.cpu_kvcache_bytes} bytes"
        else:
            field, (blocks, budget) = "gpu_memory_utilization", self._blocks_from_gpu_memory()
        if blocks < 1:
            raise config_error(field, f"not enough memory for even one KV-cache block of "
                                      f"{self.kv_bytes_per_block / 2**20:.2f} MiB ({budget}); raise it, lower "
                                      "kvcache_block_size or set num_kvcache_blocks")
        return int(blocks)

    def _blocks_from_gpu_memory(self) -> tuple[int, str]:
        """Give the KV cache what a worst-case step leaves of the device's memory: (blocks, how the
        budget was reached, for the error when it is not one block). The step's activation peak, and
        what the probe leaves allocated (the cuBLAS workspace, loaded kernels, the sampler's state), are
        measured by running it (_measure_probe), or read from the start-up cache where a start-up of
        the same fingerprint and question measured them: then the forward and the sampler's worst cases
        do not run here (their kernels load at the graphs' warm-ups, or at the first step that uses
        them) and the budget is the same arithmetic, with the stored figures."""
        device_wide.synchronize()
        device_wide.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used_before = total - free
        activation_peak, retained = self.decisions.remembered(
            MEMORY_PROBE_KIND, self._probe_question(), lambda: self._measure_probe(used_before),
            lambda answer: probe_answer_fits(answer, total))
        free, total = torch.cuda.mem_get_info()
        # weights, the CUDA context, other engines and processes: anything on the device; read from the
        # cache, the probe has not run, so what it would have left allocated is counted as used
        used = max(total - free, used_before + retained)
        budget = total * self.config.gpu_memory_utilization - used - activation_peak
        summary = (f"gpu_memory_utilization {self.config.gpu_memory_utilization} of {total / 2**30:.1f} GiB, "
                   f"{used / 2**30:.1f} GiB in use on the device (this engine's weights and any other engine or "
                   f"process), {activation_peak / 2**30:.1f} GiB activation peak: {budget / 2**30:.1f} GiB left")
        logger.info("GPU memory: %s for the KV cache", summary)
        return int(budget // self.kv_bytes_per_block), summary

    def _probe_shape(self) -> tuple[int, int]:
        """(sequences, tokens each) of the worst-case step: max_num_batched_tokens in prompts of at
        most max_model_len."""
        num_tokens = self.config.max_num_batched_tokens
        seq_len = min(self.config.max_model_len, num_tokens)
        return max(1, min(self.config.max_num_seqs, num_tokens // seq_len)), seq_len

    def _probe_question(self) -> dict:
        """What the probe's figures depend on beyond the start-up cache's fingerprint (which has the
        GPU, versions, code, the model's main shapes, dtype, TP size and the step's Config fields):
        the step and the sampler's rows, all of config.json (experts, quantization_config), the
        weights' quantization, speculation (a draft's memory is used before the probe) and the rank."""
        hf = self.config.hf_config
        model_fields = {k: v for k, v in sorted(vars(hf).items()) if not k.startswith("_")}
        return {"step": list(self._probe_shape()), "sampler_rows": self.config.max_num_seqs,
                "vocab": self.vocab_size, "bitmask_words": self.bitmasks.words, "block_size": self.block_size,
                "kv_dtype": str(self.kv_dtype), "quantization": self.config.quantization,
                "speculative": self.config.speculative_config, "rank": self.rank,
                "model_config": hashlib.sha256(json.dumps(model_fields, sort_keys=True, default=str).encode())
                .hexdigest()}

    def _measure_probe(self, used_before: int) -> list[int]:
        """Run the worst-case step and the sampler's worst cases on a one-block cache: [activation peak
        (the peak above what stays allocated after), what the probe left on the device beyond
        used_before], in bytes."""
        torch.cuda.reset_peak_memory_stats()
        probe_cache = torch.zeros((2, self.num_layers, 1, self.block_size, self.num_kv_heads, self.head_dim),
                                  dtype=self.kv_dtype, device=self.device)
        self.attn_backend = self._create_backend(probe_cache)
        self.num_kvcache_blocks = 1  # the probe cache's: what the synthetic step's block tables index
        batch = self._synthetic_step(*self._probe_shape())
        # (no dry run of layers/parallel_compiles.py here: a launch it skips leaves its output
        # unwritten, and the probe's embedding would read that output as token indices: a device-side
        # assert)
        with torch.inference_mode():
            self._probe_steps(batch)
        device_wide.synchronize()
        del probe_cache, self.attn_backend, batch
        peak = torch.cuda.max_memory_allocated()
        current = torch.cuda.memory_allocated()
        device_wide.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return [int(peak - current), max(0, int(total - free - used_before))]

    def _probe_steps(self, batch) -> None:
        """The worst-case step's forward and the sampler's worst cases, whose activation peak the probe measures."""
        self._forward(batch)
        # the sampler's worst case too: every sequence with top-k/top-p/min-p, penalties, logprobs
        rows = self.config.max_num_seqs
        # in the model's dtype: the kernels that read the model's logits compile for it here
        # (a generator of its own: torch's default one is shared by the process's engines, and a capture
        # of another engine's that failed leaves it in its capture state)
        noise = torch.Generator(self.device).manual_seed(0)
        logits = torch.randn(rows, self.vocab_size, device=self.device, generator=noise).to(self.dtype)
        ones = torch.ones(rows, device=self.device)
        rows_index = torch.arange(rows, device=self.device)
        # with penalties and a grammar's mask on every row (one token-count slot: the kernels
        # are compiled here, not in the first step that needs them)
        counts = TokenCounts(self.vocab_size, self.device)
        same_slot = torch.full((rows,), counts.acquire([], []), device=self.device)
        penalties = LogitsAdjustments(penalty_rows=rows_index, penalty_slots=same_slot, presence=ones,
                                      frequency=ones, repetition=ones, token_counts=counts)
        every_token = torch.full((rows, self.bitmasks.words), -1, dtype=torch.int32, device=self.device)
        for mask_rows in (rows_index, rows_index[:1]):
            self.sampler(logits, SamplingTensors(
                temperatures=ones, top_ks=ones.long() * 50, top_ps=ones * 0.9, min_ps=ones * 0.05,
                seeded_rows=[], all_greedy=False, keys=rows_index, adjustments=penalties,
                logprob_rows=rows_index, num_top_logprobs=20, mask_rows=mask_rows,
                token_bitmask=every_token[:len(mask_rows)]))
        # and the other common filter sets (each is a compile of the cutoff kernels), then none
        for top_ks, top_ps in ((None, ones * 0.9), (ones.long() * 50, ones * 0.9), (None, None)):
            self.sampler(logits, SamplingTensors(
                temperatures=ones, top_ks=top_ks, top_ps=top_ps, min_ps=None, seeded_rows=[],
                all_greedy=False, keys=rows_index, logprob_rows=rows_index, num_top_logprobs=20))


def _untimed(name: str) -> contextlib.AbstractContextManager:
    """A wake's stand-in for StartupTimings.phase: its steps are start-up's, not timed as start-up."""
    return contextlib.nullcontext()
