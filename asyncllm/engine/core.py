"""The engine core: one scheduler, one block manager, one model runner. Both the sync LLM and the
AsyncLLMEngine drive this same object; it knows nothing of threads or event loops."""
from __future__ import annotations

import logging
import time
import uuid

from asyncllm.config import Config
from asyncllm.engine import lifecycle
from asyncllm.engine.block_manager import BlockManager
from asyncllm.engine.deadlines import RequestDeadlines
from asyncllm.engine.intake import RequestIntake
from asyncllm.engine.pooling import PoolingPlan, embedding_sequence
from asyncllm.engine.scheduler import Scheduler, SchedulerOutput
from asyncllm.engine.sequence import Sequence, SequenceStatus
from asyncllm.engine.speculation import Speculation, make_proposer
from asyncllm.engine.startup_heap import freeze_startup_heap
from asyncllm.engine.step_logprobs import add_prompt_logprobs, token_logprobs
from asyncllm.engine.step_event import StepEvent
from asyncllm.engine.step_resolution import step_events
from asyncllm.engine.stats import engine_stats
from asyncllm.engine.step_budget import StepBudget, StepTimeModel, StepTimer, calibration_fits, calibration_shapes
from asyncllm.engine.step_planner import plan_step
from asyncllm.errors import InvalidValueError
from asyncllm.runner.launched_step import LaunchedStep
from asyncllm.runner.model_runner import ModelRunner
from asyncllm.runner.tp_workers import TensorParallelWorkers
from asyncllm.models.checkpoint import check_tokenizer, check_tokenizer_files
from asyncllm.models.tokenizer_loader import TokenizerLoader
from asyncllm.errors import EngineAsleepError
from asyncllm.outputs import FinishReason
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import SamplingParams
from asyncllm.startup import (BLOCK_MANAGER, HEAP_FREEZE, REQUEST_INTAKE, SCHEDULER, STEP_BUDGET,
                              STEP_MODEL_CALIBRATION, TOKENIZER, TP_WORKERS, StartupTimings)
from asyncllm.structured.grammar import GrammarCompiler

logger = logging.getLogger("asyncllm")


class EngineCore:
    def __init__(self, config: Config, weights=None, startup: StartupTimings | None = None):
        """The start-up's phases, in order (asyncllm/startup.py; the ModelRunner's in the middle),
        each timed into startup (a new record unless the caller's, which timed the config)."""
        self.config = config
        self.startup = StartupTimings() if startup is None else startup
        phase = self.startup.phase
        with phase(HEAP_FREEZE):
            freeze_startup_heap()
        with phase(TOKENIZER):
            # loaded on a thread beside the model's build, weights and graphs; needed at the request intake
            tokenizer_load = TokenizerLoader(config.model)
            if not check_tokenizer_files(config.hf_config, config.model):
                check_tokenizer(tokenizer_load.result(), config.hf_config, config.model)  # raises, naming all three
        # speculative decoding's proposer first: a draft model's memory is then counted by the target's probe
        proposer = None if config.speculative is None else make_proposer(config, tokenizer_load.result())
        workers = None
        try:
            if config.tensor_parallel_size > 1:
                # rank 0 of a tensor-parallel engine starts the other ranks; the runner steps them from then on
                with phase(TP_WORKERS):
                    workers = TensorParallelWorkers(config)
            self.runner = ModelRunner(config, weights=weights, workers=workers, startup=self.startup)
        except BaseException:
            if proposer is not None:
                proposer.close()  # a draft model's device memory goes back with the failed start-up
            raise
        with phase(BLOCK_MANAGER):
            self.block_manager = BlockManager(self.runner.num_kvcache_blocks, config.kvcache_block_size,
                                              config.enable_prefix_caching)
        with phase(STEP_BUDGET):
            # every step is timed and modelled, with a target or without (stats show the step time)
            self.step_model = StepTimeModel()
            self.step_timer = StepTimer(self.step_model, self.runner.device)
            # a chunk of one KV block: the least a waiting prefill advances per step; a full block is
            # hashed (prefix cache) as soon as it is computed
            self.step_budget = StepBudget(config.target_step_ms, config.max_num_batched_tokens,
                                          config.kvcache_block_size, self.step_model,
                                          config.max_num_seqs) if config.target_step_ms else None
        if self.step_budget is not None and self.runner.device.type == "cuda" and config.tensor_parallel_size == 1:
            # a fresh engine's first steps compile kernels, so their times teach nothing: measure
            # steps now, after a warm-up, and start with a fitted model (or with the start-up
            # cache's measurement of the same steps on this GPU, model and settings)
            with phase(STEP_MODEL_CALIBRATION):
                shapes = calibration_shapes(config.max_num_batched_tokens, config.max_num_seqs)
                self.step_model.calibrate(self.runner.decisions.remembered(
                    "step-model calibration", shapes, lambda: self.runner.time_steps(shapes),
                    valid=lambda steps: calibration_fits(steps, shapes)))
        with phase(SCHEDULER):
            self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                       self.step_budget)
            # a sequence can never outgrow the whole cache, so that is a length limit too
            self.max_seq_len = min(config.max_model_len,
                                   self.block_manager.num_total_blocks * config.kvcache_block_size)
        with phase(REQUEST_INTAKE):
            try:
                tokenizer = tokenizer_load.result()  # the wait, if any, is this phase's time
                check_tokenizer(tokenizer, config.hf_config, config.model)
            except BaseException:
                self.runner.close()  # the device memory and any tensor-parallel workers go back
                if proposer is not None:
                    proposer.close()
                raise
            self.use_tokenizer(tokenizer)
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self._last_sched: SchedulerOutput | None = None
        self.overlap = config.overlap_scheduling
        self._in_flight: LaunchedStep | None = None  # launched, not yet resolved (overlap only)
        self._launched: LaunchedStep | None = None  # launched by launch_step, before its resolve_step
        # constrained decoding: the intake's compiler once a request has a grammar; the sequences
        # with a grammar, pruned once finished
        self._grammar_compiler: GrammarCompiler | None = None
        self._constrained: list[Sequence] = []
        # requests with a timeout; those ended at a launch report with the next resolve
        self.deadlines = RequestDeadlines()
        self._timed_out: list[StepEvent] = []
        # speculative decoding (engine/speculation.py): None when off
        self.speculation = None if proposer is None else Speculation(config.speculative, proposer, config.max_num_seqs)
        self.startup.finish(self.runner.decisions.num_read, self.runner.decisions.num_measured)  # ready

    # ---- input: the intake's checks, for the callers that hold the core (LLM, AsyncLLMEngine, the
    # chat template, asyncllm.vllm) ---------------------------------------------------------------
    def encode_prompt(self, prompt, argument: str = "prompt") -> list[int]:
        """A prompt string or token-id list, checked, as token ids."""
        return self.intake.encode_prompt(prompt, argument)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      argument: str = "prompt") -> SamplingParams:
        """Check a request; returns the validated snapshot of params that the request must keep."""
        return self.intake.check_request(prompt_token_ids, params, argument)

    def check_embedding_request(self, prompt_token_ids: list[int], params: PoolingParams,
                                argument: str = "prompt") -> PoolingParams:
        """Check an embedding request (engine/pooling.py); returns its params."""
        return self.intake.check_embedding_request(prompt_token_ids, params, argument)

    def use_tokenizer(self, tokenizer) -> None:
        """Check and encode requests with tokenizer (start-up's, or a reload's checkpoint's): a new
        intake, and what it read of the tokenizer and config, read by the callers that hold the core."""
        self.tokenizer = tokenizer
        self.intake = RequestIntake(self.config, tokenizer, self.max_seq_len)
        self.vocab_size, self.eos_token_ids = self.intake.vocab_size, self.intake.eos_token_ids
        self.max_prompt_chars, self.reasoning = self.intake.max_prompt_chars, self.intake.reasoning
        self.chat_text_encoder = self.intake.chat_text_encoder

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        return self.intake.grammar_compiler

    def grammar_stats(self) -> dict:  # live, from any thread; {} before the first constrained request
        return self.intake.grammar_stats()

    @staticmethod
    def new_request_id() -> str:
        # random, not a counter: a counter's "req-3" collides with an id a caller chose
        return f"req-{uuid.uuid4().hex}"

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Check a request and queue it."""
        return self.add_checked_request(prompt_token_ids, self.check_request(prompt_token_ids, params), request_id)

    def add_checked_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                            request_id: str | None = None, submitted_at: float | None = None) -> Sequence:
        """Queue a request whose params are what check_request returned for it (its own snapshot), or
        an embedding request with what check_embedding_request returned. submitted_at: when the caller
        submitted it, on self.deadlines.clock (None: now); a timeout counts from then."""
        self.check_awake()
        if request_id is None:
            request_id = self.new_request_id()
        if request_id in self.requests:
            raise InvalidValueError("request_id", f"{request_id!r} is already in use")
        deadline = None
        if isinstance(params, PoolingParams):  # an embedding: one sequence, prefilled, never sampled
            seq = embedding_sequence(request_id, prompt_token_ids, params, self.block_manager.block_size)
        else:
            if params.timeout is not None:
                deadline = (self.deadlines.clock() if submitted_at is None else submitted_at) + params.timeout
            seq = self._new_sequence(request_id, prompt_token_ids, params, 0, deadline)
        if seq.pooling is None and params.n > 1:
            # the first sequence prefills the prompt; the others wait in its forks until then
            seq.forks = [self._new_sequence(request_id, prompt_token_ids, params, i, deadline)
                         for i in range(1, params.n)]
            seq.group = [seq, *seq.forks]
            for child in seq.forks:
                child.group = seq.group
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        if deadline is not None:
            self.deadlines.add(seq)
        return seq

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      index: int, deadline: float | None) -> Sequence:
        seq = self.intake.new_sequence(request_id, prompt_token_ids, params, index, deadline)
        if seq.grammar is not None:  # its steps build a token mask (with the compiler it was made by)
            self._grammar_compiler = self.intake.grammar_compiler
            self._constrained.append(seq)
        return seq

    def _fork(self, seq: Sequence) -> None:
        """seq (an n > 1 request's first sequence) has its prompt computed: the other sequences take
        its full prompt blocks (shared, reference-counted) and recompute only the rest (the last
        partial block, or the last full one: each needs its own logits of the last prompt token)."""
        num_shared = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        now = time.monotonic()
        for child in seq.forks:
            self.block_manager.fork(seq, child, num_shared)
            child.first_scheduled_time = now
            child.num_cached_prompt_tokens = child.num_computed_tokens
            self.scheduler.add(child)
        seq.forks = []

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        """End one sequence: its blocks and its sampler state are freed, its tokens in flight dropped
        (never delivered)."""
        self.scheduler.finish(seq, reason)
        seq.num_in_flight = 0
        if seq.in_runner_table:
            self.runner.release_request(seq.uid)
        if self.speculation is not None:
            self.speculation.release(seq)

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
                       index: int | None = None) -> Sequence | None:
        """End a request now (abort, or a stop string found by the caller); its blocks are freed at once.
        Unknown or finished ids are ignored. With n > 1, index ends one of its sequences (None: all);
        returns the request's first sequence."""
        leader = self.requests.get(request_id)
        if leader is None:
            return None
        for seq in leader.group or [leader]:
            if index is not None and seq.index != index or seq.is_finished:
                continue
            if seq in leader.forks:  # not forked yet: it holds nothing
                leader.forks.remove(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                continue
            self._end(seq, reason)
        if leader.request_finished:
            del self.requests[request_id]
        return leader

    def end_expired_requests(self) -> list[StepEvent]:
        """End the requests whose deadline has passed (finish_request: blocks freed at once, tokens in
        flight dropped), each sequence still open with finish_reason TIMEOUT. A request without a
        token yet gets one event, carrying the error its stream raises (RequestTimeoutError);
        otherwise each sequence ended gets an event (the last: request_finished)."""
        events = []
        for leader in self.deadlines.pop_expired(self.requests):
            group = leader.group or [leader]
            # tokens the host knows are (or will be) delivered; the ones in flight are dropped below
            produced = any(seq.num_completion_tokens for seq in group)
            ending = [seq for seq in group if not seq.is_finished]
            queued = leader.first_scheduled_time is None
            self.finish_request(leader.request_id, FinishReason.TIMEOUT)
            if not produced:
                events.append(StepEvent(leader, [], FinishReason.TIMEOUT, request_finished=True, error=(
                    f"request {leader.request_id!r}: no token within its timeout of {leader.params.timeout:g} s "
                    f"(SamplingParams.timeout); it was {'still queued' if queued else 'computing its prompt'}")))
                continue
            events.extend(StepEvent(seq, [], FinishReason.TIMEOUT) for seq in ending)
            events[-1].request_finished = True
        return events

    # ---- the step -----------------------------------------------------------------------------
    # A step is launched (inputs built, forward and sampling queued on the device) and later
    # resolved (its sampled ids read, finishes checked). Launching commits the step's KV and counts
    # each sampling sequence's next token in flight (Sequence.num_in_flight: its value is the
    # runner's until the step is read), so the scheduler can plan the next step at once.
    # With overlap, step N+1 is launched before step N is resolved: the host's work for both
    # runs while the device computes, and N+1 takes N's sampled ids on the device.
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None or self._launched is not None

    def step(self) -> list[StepEvent]:
        """Run the engine one step; returns what happened in the step resolved now (with overlap,
        the one launched by the previous call)."""
        self.launch_step()
        return self.resolve_step()

    # step() in two halves, for a caller with work to do between them (AsyncLLMEngine delivers the
    # previous step's tokens once the next step is queued, so that the consumers' Python never
    # delays a launch)
    def launch_step(self) -> None:
        """Schedule the next step and queue it on the device (with overlap, behind the one in flight)."""
        try:
            if self.deadlines:  # before scheduling: a request past its deadline takes no further step
                self._timed_out.extend(self.end_expired_requests())
            # drafts for the rows that speculate, before the scheduler fits their tokens into the step
            serial = self.speculation is not None and self.speculation.draft(self.scheduler.running, self.num_steps)
            sched = self.scheduler.schedule()
            sched.serial = serial
            self._launched = None if sched.is_empty else self._launch(sched)
        except BaseException:
            self._abandon_steps()
            raise

    def resolve_step(self) -> list[StepEvent]:
        """Resolve a step and return its events: with overlap the one launched before the latest
        (which stays in flight), without it the latest; then those of the requests that timed out
        at the latest launch."""
        launched, self._launched = self._launched, None
        try:
            steps = [launched]
            if self.overlap:
                steps = [self._in_flight]
                if launched is not None and launched.plan.engine_step.serial:
                    steps.append(launched)  # a speculating step is resolved now: the next one's drafts need it
                    launched = None
                self._in_flight = launched
            events = [event for step in steps if step is not None for event in self._resolve(step)]
        except BaseException:
            self._abandon_steps()
            raise
        if self._timed_out:
            events += self._timed_out
            self._timed_out = []
        return events

    def wait_step(self) -> None:
        """Block until the step that resolve_step() resolves next has its results on the host."""
        steps = [self._in_flight, self._launched] if self.overlap else [self._launched]
        if self.overlap and (self._launched is None or not self._launched.plan.engine_step.serial):
            steps.pop()  # stays in flight
        for step in steps:
            if step is not None:
                step.wait()

    def _abandon_steps(self) -> None:
        self._in_flight = self._launched = None  # their requests are ended by whoever handles this
        self._timed_out = []
        self.step_timer.reset()

    def drain(self) -> list[StepEvent]:
        """Resolve the steps still launched, if any (at the end of a batch, or before closing)."""
        launched = [step for step in (self._in_flight, self._launched) if step is not None]  # oldest first
        self._in_flight = self._launched = None
        return [event for step in launched for event in self._resolve(step)]

    def _launch(self, sched: SchedulerOutput) -> LaunchedStep:
        stream = self.runner.current_stream()  # looked up once: the step's three events are recorded on it
        started = self.step_timer.start(stream)
        plan = plan_step(sched)  # the step as the runner reads it (asyncllm/step_plan.py)
        grammar_compiler = None
        if self._constrained:  # requests without a grammar pay this one check
            self._constrained = [seq for seq in self._constrained if not seq.is_finished]
            grammar_compiler = self._grammar_compiler if self._constrained else None
        pooling_plan = PoolingPlan.of(sched) if sched.has_pooling else None  # before the commit below
        launched = self.runner.launch(plan, self._in_flight, grammar_compiler=grammar_compiler, stream=stream,
                                      pooling_plan=pooling_plan)
        self.step_timer.stop(started, sched.num_batched_tokens - sched.num_decodes, sched.num_decodes, stream)
        self.scheduler.commit(sched)
        self._last_sched = sched
        for item in sched.scheduled:
            if item.samples:
                seq = item.seq
                if seq.forks:
                    self._fork(seq)
                seq.num_in_flight += 1
        return launched

    def _resolve(self, launched: LaunchedStep) -> list[StepEvent]:
        plan, result = launched.plan, launched.result()
        token_ids = result.token_ids
        self.step_timer.collect()
        sampling = [item for item in plan.engine_step.scheduled if item.samples]
        per_row = result.num_per_row  # None: one token each; else speculative decoding's kept tokens
        if len(token_ids) != len(sampling) if per_row is None else \
                len(per_row) != len(sampling) or len(token_ids) != sum(per_row):  # a runner bug, not a wrong token
            raise RuntimeError(f"the step sampled {len(token_ids)} tokens for {len(sampling)} sampling rows")
        self.num_steps += 1
        if result.prompt_logprobs is not None:
            add_prompt_logprobs(plan.prompt_logprobs, result.prompt_logprobs)
        logprobs = result.logprobs
        if logprobs is not None:
            logprobs = token_logprobs(result.logprob_ks, token_ids, logprobs)
        events = step_events(self, sampling, token_ids, per_row, logprobs)
        if launched.pooling_plan is not None:
            events += self._pooled_events(launched.pooling_plan, result.pooled_sums)
        return events

    def _pooled_events(self, plan: PoolingPlan, sums) -> list[StepEvent]:
        """The embedding requests this step completes: each ends "stop" with its vector."""
        events = []
        for seq, vector in plan.vectors(sums):
            self._end(seq, FinishReason.STOP)
            self.requests.pop(seq.request_id, None)
            events.append(StepEvent(seq, [], FinishReason.STOP, request_finished=True, embedding=vector))
        return events

    @property
    def last_step(self) -> tuple[int, int] | None:
        """(prefill tokens, decode tokens) of the last step launched, for progress reports."""
        sched = self._last_sched
        if sched is None:
            return None
        return sched.num_batched_tokens - sched.num_decodes, sched.num_decodes

    def close(self) -> None:
        """Release what outlives Python's garbage collection (tensor-parallel worker processes) and
        every tensor of the engine, whose device memory goes back (runner/memory.py). Idempotent."""
        self._in_flight = self._launched = None
        self.runner.close()
        if self.speculation is not None:
            self.speculation.proposer.close()

    # ---- lifecycle between requests: sleep, wake, reload (engine/lifecycle.py) ------------------
    @property
    def sleep_level(self) -> int | None:
        """1 or 2 while asleep (sleep()'s level), None while awake."""
        return self.runner.sleep_level

    def check_awake(self) -> None:
        """Raise EngineAsleepError while asleep: a request waits for no wake()."""
        if self.runner.sleep_level is not None:
            raise EngineAsleepError(f"the engine is asleep (sleep(level={self.runner.sleep_level})): wake() it "
                                    "before submitting requests")

    def sleep(self, level: int = 1) -> None:
        lifecycle.sleep(self, level)

    def wake(self) -> None:
        lifecycle.wake(self)

    def reload(self, checkpoint: lifecycle.Checkpoint) -> None:
        """Serve checkpoint (lifecycle.prepare_reload's) from now on."""
        lifecycle.reload(self, checkpoint)

    def stats(self) -> dict:
        return engine_stats(self)
