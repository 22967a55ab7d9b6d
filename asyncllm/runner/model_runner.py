"""Runs one scheduled step on the model: pack inputs, forward, sample.

The runner is backend-blind: everything attention-specific (KV layout use, kernel metadata, CUDA
graph buffers) sits behind the AttentionBackend it creates.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import numpy as np
import torch

from asyncllm.attention import ForwardBatch, create_attention_backend
from asyncllm.config import Config
from asyncllm.runner.cuda_graph import CudaGraphRunner
from asyncllm.runner.decode_tuning import tune_batch1_projections
from asyncllm.runner.host_upload import upload_arrays
from asyncllm.distributed import get_tp_size
from asyncllm.layers import skinny_linear
from asyncllm.layers.device_wide import DEVICE_WIDE
from asyncllm.layers.rejection_sampler import RejectionSampler
from asyncllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors, gather_logprobs
from asyncllm.models.checkpoint import checkpoint_weights, load_weights, weight_layout
from asyncllm.models.fp8 import keep_linear_weights_fp8
from asyncllm.models.registry import create_model
from asyncllm.runner.launched_step import LaunchedStep
from asyncllm.runner.memory import RunnerMemory
from asyncllm.runner.pooling import StepPooling
from asyncllm.runner.request_table import GRAMMAR, speculative_positions
from asyncllm.runner.sampler_graphs import SamplerGraphs
from asyncllm.runner.sampling_inputs import SamplingInputs, SamplingPlan
from asyncllm.runner.step_inputs import (NO_TOKENS_IN_FLIGHT, InFlightTokens, StepInputs, padded_block_tables,
                                         synthetic_step_inputs)
from asyncllm.runner.step_bitmask import StepBitmasks
from asyncllm.runner.tp_protocol import agree_on_min
from asyncllm.startup import (ATTENTION_BACKEND, BUILD_MODEL, CUDA_GRAPHS, DECODE_TUNING, KV_CACHE, LOAD_WEIGHTS,
                              MEMORY_PROBE, SAMPLER, SAMPLER_GRAPHS, StartupTimings)
from asyncllm.startup_cache import StartupDecisions
from asyncllm.step_plan import StepPlan
from asyncllm.structured.step_masks import CatchUp, StepConstraints

logger = logging.getLogger("asyncllm")


class ModelRunner(RunnerMemory):
    def __init__(self, config: Config, weights=None, rank: int = 0, step_group=None, workers=None,
                 startup: StartupTimings | None = None, samples: bool = True):
        """Rank 0 of a tensor-parallel engine gets the started workers (tp_workers.TensorParallelWorkers)
        and steps through their group; a worker rank gets its step_group. startup: the engine's
        start-up record, which the runner's phases join (build model ... sampler graphs). samples
        False: its owner samples the logits of forward() itself (a draft model's proposer), so no
        sampler graphs are captured."""
        self.workers = workers
        # whether sample() runs here: the other tensor-parallel ranks never sample
        self.samples = samples and rank == 0
        try:
            self._init(config, weights, rank, step_group, StartupTimings() if startup is None else startup)
        except BaseException:
            if self.workers is not None:
                self.workers.abort()  # a failed start-up leaves no worker process behind
            raise

    def _init(self, config: Config, weights, rank: int, step_group, startup: StartupTimings) -> None:
        """The runner's start-up phases, in order (asyncllm/startup.py): the model built and loaded,
        the KV cache sized by a probe step (or its figures from the start-up cache) and allocated, then
        (CUDA, not eager) the graphs, the batch-1 decode graph's tuning and the sampler graphs, which
        replay what the probe sized."""
        self.config = config
        hf = config.hf_config
        self.rank = rank
        if config.tensor_parallel_size == 1 and get_tp_size() > 1:
            # the layers would shard themselves over that group and wait on its all-reduces forever
            raise RuntimeError("Config.tensor_parallel_size: torch.distributed is initialized in this process (by a "
                               "tensor-parallel engine that still runs?); a tensor_parallel_size=1 engine cannot be "
                               "built beside it")
        if self.workers is not None:
            step_group = self.workers.group
        self.step_group = step_group
        self.device = torch.device(config.device, torch.cuda.current_device()) if config.device == "cuda" \
            else torch.device("cpu")
        # the start-up cache (startup_cache.py), opened before anything compiles: Triton's folder, stored decisions
        self.decisions = StartupDecisions.opened_for(config, self.device)
        skinny_linear.use_decisions(self.decisions)
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_cache_torch_dtype  # the compute dtype, or float8_e4m3fn (kv_cache_dtype="fp8")
        self.block_size = config.kvcache_block_size
        self.graph_runner = None  # captured last; the memory probe below runs the model eagerly
        self.sampler_graphs = None  # plain sampling over each graph's logits, captured after the graphs
        phase = startup.phase
        with phase(BUILD_MODEL):
            with torch.device(self.device):
                self.model = create_model(hf, max_model_len=config.max_model_len, dtype=self.dtype)
                self.weight_layout = weight_layout(config)  # FP8 linear weights, or None
                if self.weight_layout is not None:
                    keep_linear_weights_fp8(self.model, self.weight_layout)
        with phase(LOAD_WEIGHTS):
            load_weights(self.model, checkpoint_weights(config, weights=weights, device=self.device))
            self.model.eval()
            self._choose_sleep_path()  # the weights into stable memory, where the driver allows
        with phase(SAMPLER):
            # the CPU path's noise for unseeded rows, the engine's own (the process's generator is the
            # application's, and another engine's)
            self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
            # speculative decoding's verification, with noise of its own (the sampler's stream is unchanged)
            self.rejection_sampler = RejectionSampler(torch.Generator(self.device).manual_seed(
                (config.seed + 1) % (1 << 64)))
            self.sampling_inputs = SamplingInputs(hf.vocab_size, self.device, config.seed)
            self.num_layers = hf.num_hidden_layers
            attn = self.model.model.layers[0].self_attn
            self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
            self.vocab_size = hf.vocab_size
            self.bitmasks = StepBitmasks(self.vocab_size, self.device)  # constrained steps' token masks
        with DEVICE_WIDE:  # one engine of the process at a time (layers/device_wide.py)
            with phase(MEMORY_PROBE):
                self.num_kvcache_blocks = self._decide_num_blocks()
                if self.step_group is not None:
                    self.num_kvcache_blocks = agree_on_min(self.num_kvcache_blocks, self.step_group)
            with phase(KV_CACHE):
                self._allocate_kv_cache()
            with phase(ATTENTION_BACKEND):
                self.attn_backend = self._create_backend(self.kv_cache)
            self._capture_graphs(phase, warm_up=True, tune=True)
        logger.info("KV cache: %d blocks of %d tokens, %.1f MiB", self.num_kvcache_blocks, self.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    def _capture_graphs(self, phase, warm_up: bool, tune: bool) -> None:
        """(CUDA, not eager) the graphs, the batch-1 decode graph's tuning and the sampler graphs,
        which replay what the probe sized. Start-up's run a warm-up before each capture (kernels
        compile, the skinny GEMM decides) and tune; a wake's re-capture reuses what those decided."""
        config = self.config
        if self.device.type != "cuda" or config.enforce_eager or not self.attn_backend.supports_cuda_graphs:
            return
        with phase(CUDA_GRAPHS):
            self.graph_runner = CudaGraphRunner(
                self.model, self.attn_backend, min(config.max_num_seqs, 512), config.max_model_len, self.device,
                max_mixed_tokens=min(config.cuda_graph_max_tokens, config.max_num_batched_tokens), warm_up=warm_up)
        if tune and self.step_group is None:  # one rank: its batch-1 graph's tilings by the step's time
            with phase(DECODE_TUNING):
                tune_batch1_projections(self.graph_runner, lambda context: self._synthetic_step(0, 0, 1, context),
                                        self.decisions)
        if self.samples:
            with phase(SAMPLER_GRAPHS):
                self.sampler_graphs = SamplerGraphs(self.graph_runner)

    # ---- set-up -------------------------------------------------------------------------------
    def _create_backend(self, kv_cache: torch.Tensor):
        return create_attention_backend(
            self.config.attention_backend, self.device,
            k_caches=list(kv_cache[0].unbind(0)), v_caches=list(kv_cache[1].unbind(0)),
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            scale=self.head_dim ** -0.5,
            rotate_qk=self.config.kv_cache_dtype == "fp8" and self.config.kv_cache_rotation)

    def _synthetic_step(self, num_prompts: int, prompt_len: int, num_decodes: int = 0,
                        context: int = 0) -> ForwardBatch:
        """The ForwardBatch of step_inputs.synthetic_step_inputs over this runner's cache: for measuring."""
        return self._make_batch(synthetic_step_inputs(num_prompts, prompt_len, num_decodes, context, self.block_size,
                                                      self.num_kvcache_blocks))[0]

    @torch.inference_mode()
    def time_steps(self, shapes: list[tuple[int, int]], prompt_len: int = 1024, context: int = 1024,
                   repeats: int = 3) -> list[tuple[int, int, float]]:
        """(prefill tokens, decodes, ms) of steps of about each (prefill tokens, decodes) shape: the
        prefill in prompts of prompt_len tokens, each decode over context tokens. Timed on the device
        (CUDA events) through the path a real step of that shape takes (CUDA graphs where they
        apply); the first run of each shape, which may compile kernels, untimed. One rank only:
        under tensor parallelism the workers would not join the forward."""
        if self.device.type != "cuda" or self.workers is not None:
            raise RuntimeError("time_steps needs one CUDA device")
        context = max(1, min(context, self.config.max_model_len))
        timings = []
        for prefill_tokens, num_decodes in shapes:
            seq_len = max(1, min(prefill_tokens, prompt_len, self.config.max_model_len))
            num_prompts = prefill_tokens // seq_len if prefill_tokens else 0
            batch = self._synthetic_step(num_prompts, seq_len if num_prompts else 0, num_decodes, context)
            self._forward(batch)
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self._forward(batch)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            timings.append((num_prompts * seq_len, num_decodes, sorted(times)[len(times) // 2]))
        return timings

    # ---- one step ------------------------------------------------------------------------------
    def _make_batch(self, inputs: StepInputs,
                    extra: list[np.ndarray] = ()) -> tuple[ForwardBatch, list[torch.Tensor]]:
        """The step's ForwardBatch on the device; extra arrays (the step's sampling settings, pending
        token rows) travel in the same copy (host_upload: one copy per step, not one per array)."""
        query_start_loc = np.zeros(len(inputs.query_lens) + 1, dtype=np.int32)
        np.cumsum(inputs.query_lens, out=query_start_loc[1:])
        (input_ids, positions, slot_mapping, logits_indices, query_start_loc_t, seq_lens, block_tables,
         *extra) = upload_arrays([inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices,
                                  query_start_loc, inputs.seq_lens, inputs.block_tables, *extra], self.device)
        query_lens_cpu, seq_lens_cpu = inputs.query_lens.tolist(), inputs.seq_lens.tolist()
        batch = ForwardBatch(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, query_start_loc=query_start_loc_t,
            seq_lens=seq_lens, block_tables=block_tables, logits_indices=logits_indices,
            num_seqs=len(query_lens_cpu), num_tokens=len(inputs.input_ids), max_query_len=max(query_lens_cpu),
            max_seq_len=max(seq_lens_cpu), query_lens_cpu=query_lens_cpu, seq_lens_cpu=seq_lens_cpu,
            attn_backend=self.attn_backend)
        return batch, extra

    def build_inputs(self, plan: StepPlan, sampling_rows: np.ndarray) -> tuple[StepInputs, InFlightTokens]:
        """The step's inputs on the host, whichever way they reach the device (launch's
        _transfer), and its tokens in flight (StepPlan.in_flight_rows; their values the step in
        flight's, filled in by the transfer). sampling_rows: the request table's rows of the plan's
        sampling rows. All numpy: the plan's one pass of plain Python over the rows is the
        engine's (engine/step_planner.py)."""
        num_seqs, num_tokens = len(plan.query_lens), plan.num_tokens
        starts, query_lens, block_rows = plan.starts, plan.query_lens, plan.block_rows
        starts_np = np.array(starts, dtype=np.int64)
        query_lens_np = np.array(query_lens, dtype=np.int32)
        seq_lens = (starts_np + query_lens_np).astype(np.int32)
        if num_tokens == num_seqs:  # one token per row (decodes): positions are the starts
            positions, rows = starts_np, np.arange(num_seqs)
        else:
            rows = np.repeat(np.arange(num_seqs), query_lens_np)
            first_token = np.cumsum(query_lens_np) - query_lens_np  # each row's first index in the step
            positions = np.arange(num_tokens) + (starts_np - first_token)[rows]
        block_tables = padded_block_tables(block_rows)
        bs = self.block_size
        slot_mapping = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        inputs = StepInputs(np.array(plan.input_ids, dtype=np.int64), positions, slot_mapping, query_lens_np, seq_lens,
                            block_tables, np.array(plan.logits_indices, dtype=np.int64))
        if not plan.in_flight_rows:
            return inputs, NO_TOKENS_IN_FLIGHT
        at = inputs.logits_indices[plan.in_flight_rows]
        rows = self.sampling_inputs.table.in_flight_rows(plan, sampling_rows)
        in_place = at[-1] == len(at) - 1 and np.array_equal(rows, np.arange(len(rows)))
        return inputs, InFlightTokens(at, rows, bool(in_place))

    def _staged_decode_key(self, inputs: StepInputs) -> tuple[str, int, int] | None:
        """The decode graph that replays this step from inputs staged in one copy (DecodeStaging): a
        decode-only step whose every row samples; None for any other."""
        num_seqs = len(inputs.query_lens)
        if self.graph_runner is None or len(inputs.input_ids) != num_seqs or len(inputs.logits_indices) != num_seqs:
            return None
        return self.graph_runner.decode_key(num_seqs, int(inputs.seq_lens.max()))

    def release_request(self, request: int) -> None:
        """The engine ended a request (RequestSampling.request): its table row and penalty slot go.
        A request the table never had (it never sampled) is ignored."""
        self.sampling_inputs.release(request)

    def _constraints(self, plan: StepPlan, sampling_plan: SamplingPlan, compiler) -> StepConstraints:
        """The step's rows held to a grammar (some are), from the request table."""
        table, rows = self.sampling_inputs.table, sampling_plan.rows
        constrained = np.flatnonzero(sampling_plan.flags & GRAMMAR).tolist()
        positions = None if plan.rows_per_request is None else speculative_positions(plan.rows_per_request)
        states, catch_ups, drafts = [], [], []
        for row in constrained:
            entry = table.entries[plan.sampling_ids[row]]
            state = entry.settings.grammar
            states.append(state)
            j = 0 if positions is None else int(positions[row])
            drafts.append(plan.draft_token_ids[row - j:row] if j else [])
            if not j:  # a speculating request's first position: its matcher catches up once
                catch_ups.append(CatchUp(state, entry.token_ids, entry.settings.num_prompt_tokens,
                                         int(table.pending_row[rows[row]])))
        return StepConstraints(constrained, states, catch_ups, compiler, drafts if any(drafts) else None)

    def _forward(self, batch: ForwardBatch, pooling: StepPooling | None = None) -> torch.Tensor:
        if self.graph_runner is not None:
            if pooling is None:
                logits = self.graph_runner.run(batch)
                if logits is not None:
                    return logits
            else:  # graphs keep no hidden states: eagerly, and no sampler graph over an older replay's logits
                self.graph_runner.last_prefix_key = None
        self.attn_backend.prepare_metadata(batch)  # a replay reads the graph's own: eager steps only
        hidden_states = self.model(batch.input_ids, batch.positions, batch)
        if pooling is not None:
            pooling.pool(hidden_states)
        return self.model.compute_logits(hidden_states[batch.logits_indices])

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The model on one step's inputs: logits of the rows in inputs.logits_indices. input_ids (on
        the device) in place of inputs.input_ids: tokens the device sampled, which the host never
        waits for (a draft model's next step)."""
        batch = self._make_batch(inputs)[0]
        if input_ids is not None:
            batch.input_ids = input_ids
        return self._forward(batch)

    def current_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream this thread queues work on (None on CPU)."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: LaunchedStep | None, grammar_compiler=None,
               stream: torch.cuda.Stream | None = None, pooling_plan=None) -> LaunchedStep:
        """Queue one step's forward and sampling (plan: the engine's StepPlan). A row's last token
        in flight (StepPlan.in_flight_rows) is the id prev sampled for its request (the request
        table's sampled_row): it is filled in on the device, so the host never waits for prev.

        grammar_compiler (structured.grammar.GrammarCompiler, or None: no request has a grammar): the
        compiler of the requests' grammars. The bitmask of the rows held to one is filled on the host
        after the forward is queued, so it overlaps the forward; a row whose last token prev is still
        sampling waits for prev's ids (not for this step's forward).
        stream: the current stream where the caller has it (None: looked up when needed).
        pooling_plan (engine.pooling.PoolingPlan, or None): embedding rows, whose hidden states the
        step sums (it then runs eagerly: CUDA graphs return logits only)."""
        table = self.sampling_inputs.table
        for request in plan.new_requests:  # first: the engine counts them as the runner's from here
            table.add(request)
        if prev is not None:
            prev.queue_sampling()  # the device runs prev's sampling before this step's forward
        # the sampling settings are ready before the forward: they travel in the step's one copy
        sampling_plan = self.sampling_inputs.plan(plan)
        inputs, in_flight = self.build_inputs(plan, sampling_plan.rows)
        assert prev is not None or not len(in_flight.at), "a token in flight without the step that samples it"
        num_sampling = len(inputs.logits_indices)
        prompt_plan = plan.prompt_logprobs
        if prompt_plan is not None:  # prompt positions' logits too, after the sampling rows
            inputs.logits_indices = np.concatenate([inputs.logits_indices, prompt_plan.token_rows])
        constraints = None
        if grammar_compiler is not None and sampling_plan.any_flags & GRAMMAR:
            constraints = self._constraints(plan, sampling_plan, grammar_compiler)
        # from here the rows' next tokens are in flight
        launched_rows = table.launched(plan, sampling_plan.rows, sampling_plan.flags, sampling_plan.any_flags)
        prev_sampled = None if prev is None else prev.sampled
        pooling = None if pooling_plan is None else StepPooling(pooling_plan, self.device)
        uploaded, forward = self._transfer(inputs, in_flight, sampling_plan.arrays, prev, pooling)
        # before the forward: whatever reads prev's ids is queued ahead of this step's graphs, whose
        # replays may reuse the memory that holds them (a sampler graph's static output)
        sampling = self.sampling_inputs.tensors(sampling_plan, uploaded, prev_sampled)
        logits = forward()
        prompt_logprobs = None
        if prompt_plan is not None:
            targets = torch.tensor(prompt_plan.targets, dtype=torch.int64).to(self.device, non_blocking=True)
            prompt_logprobs = gather_logprobs(logits[num_sampling:], targets, prompt_plan.num_top)
            logits = logits[:num_sampling]
        logprob_ks = sampling_plan.logprob_ks
        sampler = self.sampler
        if plan.draft_token_ids is not None:  # speculative decoding: each position verifies its draft
            counts = np.array(plan.rows_per_request, dtype=np.int64)
            draft_ids, first_rows = upload_arrays([np.array(plan.draft_token_ids, dtype=np.int64),
                                                   np.repeat(np.cumsum(counts) - counts, counts)], self.device)
            sampler = functools.partial(self.rejection_sampler, draft_ids=draft_ids, first_rows=first_rows,
                                        draft_probs=plan.draft_probs)
        if constraints is None:
            output = self.sample(logits, sampling) if sampler is self.sampler else sampler(logits, sampling)
            return LaunchedStep(plan, output, logprob_ks, prompt_logprobs, stream=stream, pooling=pooling,
                                table=table, launched_rows=launched_rows)
        # constrained rows: advance their matchers here (it may wait for prev's ids), then fill the
        # bitmask on a worker thread (xgrammar releases the GIL) while this thread resolves prev and
        # plans the next step; the sampling is queued once the next step needs it
        constraints.catch_up(prev.token_ids if prev is not None else None)
        upload_bitmask = self.bitmasks.fill(constraints, wait=plan.draft_token_ids is not None)

        @torch.inference_mode()
        def sample() -> SamplerOutput:
            sampling.mask_rows, sampling.token_bitmask = upload_bitmask()
            return sampler(logits, sampling)
        return LaunchedStep(plan, None, logprob_ks, prompt_logprobs, sample=sample, stream=stream,
                            pooling=pooling, table=table, launched_rows=launched_rows)

    def _transfer(self, inputs: StepInputs, in_flight: InFlightTokens, sampling_arrays: dict[str, np.ndarray],
                  prev: LaunchedStep | None, pooling: StepPooling | None
                  ) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
        """The step's inputs (build_inputs') and sampling arrays to where its forward reads them, its
        tokens in flight filled in: the one place the three ways differ. Tensor-parallel ranks get the
        inputs from the host (the wire: StepInputs.pack), so the host fills the tokens in from prev's
        ids; a decode graph's step is staged into the graph's own buffers; any other step is
        uploaded in one copy; both fill the tokens in on the device, never waiting for prev. Returns
        the sampling arrays on the device (in sampling_arrays' order) and the step's forward."""
        arrays = list(sampling_arrays.values())
        if self.workers is not None:
            if len(in_flight.at):
                inputs.input_ids[in_flight.at] = np.asarray(prev.token_ids(), dtype=np.int64)[in_flight.rows]
            return upload_arrays(arrays, self.device), lambda: self.workers.run_step(inputs, self.forward)
        index_arrays = in_flight.index_arrays
        key = self._staged_decode_key(inputs)
        if key is None:
            batch, uploaded = self._make_batch(inputs, index_arrays + arrays)
            input_ids = batch.input_ids
            forward = lambda: self._forward(batch, pooling)  # noqa: E731
        else:  # a decode graph's step: its inputs straight into the graph's buffers (never a pooling step)
            input_ids, uploaded = self.graph_runner.staging.stage(inputs, index_arrays, sampling_arrays)
            forward = lambda: self.graph_runner.replay_staged(key, len(input_ids))  # noqa: E731
        prev_sampled = None if prev is None else prev.sampled
        if in_flight.in_place:
            num = len(in_flight.at)  # whole tensors where they fit (a steady decode batch): no new views
            (input_ids if num == len(input_ids) else input_ids[:num]).copy_(
                prev_sampled if num == len(prev_sampled) else prev_sampled[:num])
        elif index_arrays:
            at, rows, *uploaded = uploaded
            input_ids.index_copy_(0, at, prev_sampled.index_select(0, rows))
        return uploaded, forward

    def sample(self, logits: torch.Tensor, sampling: SamplingTensors) -> SamplerOutput:
        """Queue the sampling of a step's logits, just computed: the sampler graph over the forward
        graph that made them where one applies (SamplerGraphs.sample), else the eager sampler."""
        output = None if self.sampler_graphs is None else self.sampler_graphs.sample(sampling, len(logits))
        return output or self.sampler(logits, sampling)

    def release_cuda_graphs(self) -> None:
        """Drop the CUDA graphs (and their memory); later steps run eagerly."""
        if self.sampler_graphs is not None:
            self.sampler_graphs.release()
            self.sampler_graphs = None
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = None

    def load_checkpoint(self, weights) -> None:
        """A checkpoint's tensors into the parameters, in place: the CUDA graphs read them where they are."""
        load_weights(self.model, weights)

    def close(self) -> None:
        """Stop tensor-parallel workers, if any, and release every tensor (RunnerMemory). Idempotent."""
        self.release_cuda_graphs()  # first: graphs holding NCCL work would stall the group's teardown
        self.bitmasks.close()
        if self.workers is not None:
            self.workers.close()
            self.step_group = None  # it holds the rendezvous store, whose port a new engine may reuse
        self._release_device_state()
