"""Latency under load (engine/step_budget.py): the step-time model, the per-step prefill budget,
fair chunking, priority order, and a decoding stream's gaps while long prompts arrive (tiny model)."""
from __future__ import annotations

import random

import anyio
import pytest
import torch

from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.config import Config
from asyncllm.engine.block_manager import BlockManager
from asyncllm.engine.scheduler import Scheduler
from asyncllm.engine.sequence import Sequence, SequenceStatus
from asyncllm.engine.step_budget import (STREAMING_TARGET_STEP_MS, StepBudget, StepTimeModel, StepTimer,
                                        calibration_shapes)
from asyncllm.engine.options import make_config
from asyncllm.llm import LLM
from asyncllm.sampling_params import SamplingParams

BS = 16


def true_cost(p: int, d: int) -> float:
    return 1.5 + 0.004 * p + 0.03 * d  # ms


def trained_model(num_steps: int = 400, noise: float = 0.02, seed: int = 0) -> StepTimeModel:
    rng = random.Random(seed)
    model = StepTimeModel()
    for _ in range(num_steps):
        p, d = rng.choice([0, 0, rng.randrange(1, 4096)]), rng.randrange(0, 128)
        model.observe(p, d, true_cost(p, d) * (1 + rng.uniform(-noise, noise)))
    return model


# ---- (a) the model learns known costs, and the budget follows it ----------------------------------
def test_the_model_learns_a_known_linear_cost():
    model = trained_model()
    assert model.ready
    assert model.a == pytest.approx(1.5, rel=0.1)
    assert model.b == pytest.approx(0.004, rel=0.05)
    assert model.c == pytest.approx(0.03, rel=0.1)
    for p, d in [(0, 1), (0, 64), (512, 64), (2048, 8), (4000, 120)]:
        assert model.predict(p, d) == pytest.approx(true_cost(p, d), rel=0.05)


def test_one_outlier_step_barely_moves_the_model_and_coefficients_stay_non_negative():
    model = trained_model()
    before = model.predict(1024, 64)
    model.observe(1024, 64, 5000.0)  # a GC pause or a JIT compile
    assert model.predict(1024, 64) == pytest.approx(before, rel=0.1)
    # steps whose cost does not depend on the decode count: c is pinned at 0, never negative
    flat = StepTimeModel()
    rng = random.Random(1)
    for _ in range(200):
        p, d = rng.randrange(0, 2048), rng.randrange(0, 64)
        flat.observe(p, d, 2.0 + 0.001 * p - 1e-4 * d * rng.random())
    assert flat.ready and flat.a >= 0 and flat.b > 0 and flat.c >= 0


def test_the_budget_follows_the_model():
    model = trained_model()
    budget = StepBudget(target_ms=10.0, max_num_batched_tokens=16384, min_chunk=BS, model=model)
    few, many = budget.prefill_budget(8, 0), budget.prefill_budget(128, 0)
    assert many < few
    # the step it plans costs about the target: decodes plus the budget's prefill tokens
    assert true_cost(few, 8) == pytest.approx(10.0, rel=0.05)
    assert StepBudget(20.0, 16384, BS, model).prefill_budget(8, 0) > few
    # decodes alone over the target: prefill still gets half of the target's time (never less than a chunk)
    assert budget.prefill_budget(1000, 0) == int(0.5 * 10.0 / model.b)
    assert true_cost(budget.prefill_budget(1000, 0), 0) - true_cost(0, 0) == pytest.approx(5.0, rel=0.05)
    assert StepBudget(1e-3, 16384, BS, model).prefill_budget(1000, 0) == BS
    # a target far above what the largest step costs: max_num_batched_tokens
    assert StepBudget(1e6, 16384, BS, model).prefill_budget(8, 0) == 16384
    # not fitted yet, or never seen a prefill step (its cost per token unknown): the throughput-first budget
    assert StepBudget(10.0, 16384, BS, StepTimeModel()).prefill_budget(8, 0) == 16384
    decode_only = StepTimeModel()
    for d in range(1, 100):
        decode_only.observe(0, d, true_cost(0, d))
    assert not decode_only.ready
    assert StepBudget(10.0, 16384, BS, decode_only).prefill_budget(8, 0) == 16384


def test_the_budget_is_planned_for_the_decodes_that_waiting_prompts_add():
    """A burst of 64 prompts on an idle engine gets the budget that 64 decoding streams leave, not
    the idle engine's: the pace it is prefilled at is one the full engine can keep up."""
    model = trained_model()
    budget = StepBudget(target_ms=10.0, max_num_batched_tokens=16384, min_chunk=BS, model=model, max_num_seqs=100)
    assert budget.prefill_budget(0, 64) == budget.prefill_budget(64, 0) == budget.prefill_budget(32, 32)
    assert budget.prefill_budget(0, 64) < budget.prefill_budget(0, 1)
    # no more streams than max_num_seqs can decode at once
    assert budget.prefill_budget(0, 500) == budget.prefill_budget(100, 0) == budget.prefill_budget(0, 100)


# ---- scheduler-level: a fixed budget, no model ----------------------------------------------------
class FixedBudget:
    def __init__(self, tokens: int, min_chunk: int = BS):
        self.tokens, self.min_chunk = tokens, min_chunk

    def prefill_budget(self, num_decodes: int, num_prompts: int) -> int:
        return self.tokens


def make_scheduler(num_blocks: int, budget_policy=None, max_num_seqs: int = 64, prefix_caching: bool = False):
    bm = BlockManager(num_blocks, BS, prefix_caching)
    return Scheduler(bm, 1024, max_num_seqs, budget_policy)


def new_seq(name: str, length: int, max_new: int, priority: int = 0) -> Sequence:
    rng = random.Random(name)
    return Sequence(name, [rng.randrange(100, 50_000) for _ in range(length)],
                    SamplingParams(max_tokens=max_new, priority=priority), BS)


def fake_step(sched: Scheduler, finished: list[Sequence]):
    out = sched.schedule()
    sched.commit(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.token_ids.append(7)
            if item.seq.num_completion_tokens >= item.seq.params.max_tokens:
                sched.finish(item.seq, "length")
                finished.append(item.seq)
    return out


# ---- (b) no starvation, fair chunking -------------------------------------------------------------
def test_tiny_budget_every_prefill_advances_and_short_prompts_pass_a_long_one():
    sched = make_scheduler(num_blocks=64, budget_policy=FixedBudget(16))
    finished: list[Sequence] = []
    long = new_seq("long", 320, max_new=4)
    sched.add(long)
    shorts = []
    for step in range(1, 2000):
        if step == 3:  # short prompts arrive behind the long one's prefill
            shorts = [new_seq(f"short{i}", 10, max_new=4) for i in range(6)]
            for s in shorts:
                sched.add(s)
        prefilling = [s for s in sched.running + sched.waiting if s.num_uncomputed_tokens > 1]
        head = prefilling[0] if prefilling else None
        pending_prefill = sum(s.num_uncomputed_tokens for s in prefilling)
        out = fake_step(sched, finished)
        prefill_tokens = out.num_batched_tokens - out.num_decodes
        if prefilling:
            # work-conserving within the budget, and the first in order always advances
            assert prefill_tokens == min(16, pending_prefill)
            assert any(item.seq is head and item.num_tokens >= 1 for item in out.scheduled)
        assert prefill_tokens <= 16
        if not sched.num_unfinished:
            break
    assert len(finished) == 7
    # fair: every short prompt finished before the long prompt did (FCFS would keep them 20 steps behind it)
    assert finished.index(long) == len(finished) - 1
    assert all(s.num_completion_tokens == 4 for s in finished)


def test_equal_prompts_stay_first_come_first_served():
    sched = make_scheduler(num_blocks=64, budget_policy=FixedBudget(32))
    seqs = [new_seq(f"r{i}", 64, max_new=1) for i in range(4)]
    for s in seqs:
        sched.add(s)
    finished: list[Sequence] = []
    out = fake_step(sched, finished)
    assert [(item.seq, item.num_tokens) for item in out.scheduled] == [(seqs[0], 32)]
    while sched.num_unfinished:
        fake_step(sched, finished)
    assert finished == seqs


def test_without_a_policy_the_step_takes_all_of_max_num_batched_tokens():
    sched = make_scheduler(num_blocks=256)
    long, short = new_seq("long", 2000, 2), new_seq("short", 10, 2)
    sched.add(long)
    sched.add(short)
    out = sched.schedule()
    assert [(item.seq, item.num_tokens) for item in out.scheduled] == [(long, 1024)]


# ---- (c) priority: admission and preemption ---------------------------------------------------------
def test_admission_follows_priority_then_arrival():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    a, b, c, d = (new_seq("a", 10, 2, priority=1), new_seq("b", 10, 2, priority=1),
                  new_seq("c", 10, 2, priority=0), new_seq("d", 10, 2, priority=-5))
    for s in (a, b, c, d):
        sched.add(s)
    assert sched.waiting == [d, c, a, b]
    finished: list[Sequence] = []
    while sched.num_unfinished:
        fake_step(sched, finished)
    assert finished == [d, c, a, b]


def test_preemption_takes_the_lowest_priority_not_the_newest():
    # 5 blocks: a (32 tokens, 2 blocks), b (16, 1 block, priority 1), c (30, 2 blocks, newest) fill the cache
    sched = make_scheduler(num_blocks=5)
    a, b, c = new_seq("a", 32, 5), new_seq("b", 16, 5, priority=1), new_seq("c", 30, 5)
    for s in (a, b, c):
        sched.add(s)
    finished: list[Sequence] = []
    fake_step(sched, finished)
    assert sched.block_manager.num_free_blocks == 0 and sched.running == [a, c, b]
    out = fake_step(sched, finished)  # a's first decode needs a 3rd block
    assert b.status == SequenceStatus.WAITING and b.num_preemptions == 1
    assert c.num_preemptions == 0 and a.num_preemptions == 0
    assert [item.seq for item in out.scheduled] == [a, c]  # without priority c, the newest, would have gone
    while sched.num_unfinished:
        fake_step(sched, finished)
    assert set(finished) == {a, b, c}


def test_priority_is_validated_by_sampling_params():
    for bad in ("high", 1.5, True, None):
        with pytest.raises(ValueError, match="SamplingParams.priority"):
            SamplingParams(priority=bad)
    assert SamplingParams(priority=-3).priority == -3


def test_target_step_ms_is_validated_and_defaults_differ_by_api(tiny_qwen3):
    for bad in (-1, "8", float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="Config.target_step_ms"):
            Config(tiny_qwen3, target_step_ms=bad)
    assert Config(tiny_qwen3, target_step_ms=0).target_step_ms is None
    assert make_config(tiny_qwen3, {}).target_step_ms is None  # LLM: throughput first
    assert AsyncLLMEngine(tiny_qwen3).config.target_step_ms == STREAMING_TARGET_STEP_MS
    assert AsyncLLMEngine(tiny_qwen3, target_step_ms=None).config.target_step_ms is None


# ---- (d) behaviour through the engine ----------------------------------------------------------------
ENGINE_KW = dict(num_kvcache_blocks=256, kvcache_block_size=BS)


def test_chunking_policy_does_not_change_greedy_outputs(tiny_qwen3):
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 10000) for _ in range(n)] for n in (300, 20, 150, 5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for target in (None, 0.01):
        with LLM(tiny_qwen3, target_step_ms=target, **ENGINE_KW) as llm:
            outputs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]


async def run_stream_while_long_prompts_arrive(model: str, target_step_ms) -> tuple[list[int], dict, object]:
    """Prefill tokens of each step that also decoded the stream, the engine's stats, and the
    stream's metrics."""
    rng = random.Random(0)
    async with AsyncLLMEngine(model, target_step_ms=target_step_ms, **ENGINE_KW) as engine:
        # warm-up: the step-time model learns from steps that prefill (a CPU engine has no start-up
        # calibration), so a dozen prompts of varied lengths before the measured part
        for n in range(12):
            await engine.generate([rng.randrange(0, 10000) for _ in range(50 + 25 * n)],
                                  SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        scheduler = engine._core.scheduler
        schedule = scheduler.schedule
        prefill_in_stream_steps: list[int] = []

        def recording_schedule():
            out = schedule()
            if any(item.seq.request_id == "stream" and item.num_tokens == 1 for item in out.scheduled):
                prefill_in_stream_steps.append(out.num_batched_tokens - out.num_decodes)
            return out
        scheduler.schedule = recording_schedule
        stream = engine.stream("Hello, my name is", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                               request_id="stream")
        long_params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        async with anyio.create_task_group() as group:
            num_tokens, submitted = 0, False
            async for out in stream:
                num_tokens += len(out.token_ids)
                if num_tokens >= 3 and not submitted:  # the stream decodes: a batch of long prompts arrives
                    submitted = True
                    for _ in range(6):
                        prompt = [rng.randrange(0, 10000) for _ in range(300)]
                        group.start_soon(engine.generate, prompt, long_params)
        await engine.wait_idle()
        return prefill_in_stream_steps, engine.stats(), stream.metrics


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(400)
async def test_a_decoding_stream_is_not_stalled_by_long_prompts(tiny_qwen3, anyio_backend):
    with anyio.fail_after(360):  # a hang guard; ~15 s on an idle 2-core machine
        unbounded, unbounded_stats, _ = await run_stream_while_long_prompts_arrive(tiny_qwen3, None)
        # a target below any CPU step of the tiny model: the budget sits at its floor, one block
        bounded, stats, metrics = await run_stream_while_long_prompts_arrive(tiny_qwen3, 0.05)
    # without the policy one step takes whole 300-token prompts while the stream waits for it
    assert max(unbounded) >= 300
    assert unbounded_stats["prefill_budget"] is None and unbounded_stats["step_ms"] > 0
    # with it, every step between two of the stream's tokens took at most one chunk of prefill
    assert max(bounded) <= BS
    # the long prompts (112 steps of one chunk) went on beside the stream's remaining ~37 tokens
    assert sum(1 for p in bounded if p > 0) >= 25
    assert stats["target_step_ms"] == 0.05 and stats["prefill_budget"] == BS
    assert stats["step_ms"] > 0 and stats["step_model"] is not None and stats["predicted_step_ms"] > 0
    # per-request metrics still add up
    assert len(metrics.inter_token_latencies) == metrics.num_completion_tokens - 1 == 39
    assert 0 <= metrics.queue_time <= metrics.time_to_first_token <= metrics.e2e_latency


# ---- random workloads: priorities, a tiny budget and a tiny cache still finish everything -------------
@pytest.mark.parametrize("shard", range(2))
def test_random_workloads_with_priorities_and_a_tiny_budget_terminate(shard):
    from test_scheduler import FakeEngine  # the scheduler tests' fake engine and invariant checks

    class ReadmittingFakeEngine(FakeEngine):
        def check(self, out, decoding_before):
            # a decoder preempted for lack of blocks and readmitted in the same step recomputes its
            # KV: that is a prefill, rightly after the decodes
            recomputing = {id(item.seq) for item in out.scheduled[out.num_decodes:]}
            super().check(out, decoding_before - recomputing)

    preemptions = 0
    for seed in range(shard * 40, (shard + 1) * 40):
        rng = random.Random(seed)
        num_blocks = rng.choice([4, 6, 8, 12])
        eng = ReadmittingFakeEngine(num_blocks=num_blocks, budget=rng.choice([16, 64, 512]),
                         max_num_seqs=rng.choice([1, 3, 64]), prefix_caching=rng.random() < 0.5)
        eng.sched.budget_policy = FixedBudget(rng.choice([1, 5, 16, 40]), min_chunk=BS)
        total = 0
        for _ in range(rng.randrange(3, 12)):
            prompt_len = rng.randrange(1, min(80, num_blocks * BS - 1))
            max_new = rng.randrange(1, min(30, num_blocks * BS - prompt_len + 1) + 1)
            seq = eng.add(prompt_len, max_new)
            seq.priority = rng.choice([-1, 0, 0, 2])
            seq.sort_key = (seq.priority, seq.sort_key[1])
            total += prompt_len + max_new
        eng.sched.waiting.sort(key=lambda s: s.sort_key)
        # FakeEngine.step checks that the first running sequence in (priority, arrival) order is
        # scheduled every step: nothing livelocks, whatever the priorities
        eng.run(max_steps=50 * total + 100)
        assert len(eng.finished) == len(eng.max_new)
        preemptions += eng.sched.num_preemptions
    assert preemptions > 0


# ---- the CUDA timing path, with fake events: read only once completed, in order, never waited on ----
class FakeEvent:
    clock = 0.0
    completed_up_to = 0.0

    made = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.time = None
        FakeEvent.made += 1

    def record(self, stream=None):
        FakeEvent.clock += 1.0
        self.time = FakeEvent.clock

    def query(self) -> bool:
        return self.time <= FakeEvent.completed_up_to

    def elapsed_time(self, end) -> float:
        assert self.query() and end.query(), "read before it completed"
        return end.time - self.time

    def synchronize(self):
        raise AssertionError("the step timer must never wait on the device")


def test_cuda_step_timer_reads_events_once_they_completed(monkeypatch):
    import torch

    from asyncllm.engine.step_budget import StepTimer
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    seen = []

    class Recorder:
        def observe(self, p, d, ms):
            seen.append((p, d, ms))
    timer = StepTimer(Recorder(), torch.device("cuda"))
    for p in (100, 200, 300):
        started = timer.start()
        FakeEvent.clock += p / 100  # the step's device work
        timer.stop(started, p, 4)
    FakeEvent.completed_up_to = 0.0
    timer.collect()
    assert seen == []
    FakeEvent.completed_up_to = 5.5  # the first step's end event (at 3.0) done, the second's (at 7.0) not
    timer.collect()
    assert seen == [(100, 4, 2.0)]
    FakeEvent.completed_up_to = 1e9
    timer.collect()
    assert seen == [(100, 4, 2.0), (200, 4, 3.0), (300, 4, 4.0)]
    # events read are recorded again for later steps (none made), and time those steps right
    made = FakeEvent.made
    for p in (500, 600):
        started = timer.start()
        FakeEvent.clock += p / 100
        timer.stop(started, p, 2)
    timer.collect()
    assert FakeEvent.made == made and seen[3:] == [(500, 2, 6.0), (600, 2, 7.0)]


def test_priority_reaches_the_scheduler_through_the_engine(tiny_qwen3):
    with LLM(tiny_qwen3, max_num_seqs=1, **ENGINE_KW) as llm:
        core = llm.core
        ids = [core.add_request([11, 22, 33], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                              priority=p)).request_id for p in (1, 1, 0)]
        order = []
        while core.has_unfinished():
            order += [e.seq.request_id for e in core.step() if e.finish_reason is not None]
        order += [e.seq.request_id for e in core.drain() if e.finish_reason is not None]
    assert order == [ids[2], ids[0], ids[1]]


def test_a_calibrated_model_is_ready_before_any_step():
    """Calibration steps of prefill alone and beside decodes give a, b and c at once: a burst on a
    fresh engine is planned with the cost of the decodes it is about to add. The first online steps are
    no longer skipped (the calibration was the warm-up), and the model goes on learning from them."""
    model = StepTimeModel()
    shapes = calibration_shapes(max_num_batched_tokens=16384, max_num_seqs=512)
    assert {d for _, d in shapes} >= {0, 16, 64} and {p for p, _ in shapes} >= {256, 1024}
    assert all(p for p, _ in shapes), "only steps that prefill: the budget is decided for those"
    model.calibrate([(p, d, true_cost(p, d)) for p, d in shapes])
    assert model.ready and model.a == pytest.approx(1.5, rel=0.01) and model.b == pytest.approx(0.004, rel=0.01)
    assert model.c == pytest.approx(0.03, rel=0.01)
    budget = StepBudget(8.0, 16384, 256, model, max_num_seqs=512)
    # a burst of 64 prompts on an idle engine gets the budget of the 64 streams it will become
    assert budget.prefill_budget(0, 64) == budget.prefill_budget(64, 0) == int((8.0 - 1.5 - 0.03 * 64) / 0.004)
    for _ in range(100):  # the device got slower: the model follows where the engine runs now
        model.observe(900, 60, 2 * true_cost(900, 60))
    assert model.predict(900, 60) == pytest.approx(2 * true_cost(900, 60), rel=0.1)


def test_the_calibration_keeps_the_slope_that_narrow_online_steps_cannot_give():
    """Under load every step prefills about the budget, so online steps alone cannot tell the cost per
    token from the fixed cost; the calibration's varied shapes stay in the fit and keep the slope."""
    calibrated, online_only = StepTimeModel(), StepTimeModel()
    calibrated.calibrate([(p, d, true_cost(p, d)) for p, d in calibration_shapes(16384, 512)])
    rng = random.Random(3)
    for _ in range(400):
        p, d = 900 + rng.randrange(-20, 20), 60 + rng.randrange(-4, 4)
        for model in (calibrated, online_only):
            model.observe(p, d, true_cost(p, d) * (1 + rng.uniform(-0.03, 0.03)))
    assert calibrated.b == pytest.approx(0.004, rel=0.1)
    # a burst's steps (large prefill, few decodes) are predicted right only with the slope kept
    assert calibrated.predict(2000, 4) == pytest.approx(true_cost(2000, 4), rel=0.1)


def test_the_step_timer_learns_only_from_steps_that_prefill():
    model = StepTimeModel()
    timer = StepTimer(model, torch.device("cpu"))
    timer._observe(0, 64, 3.0)
    assert model.num_observations == 0 and model.last_step_ms == 3.0 and timer.total_ms == 3.0
    timer._observe(512, 64, 6.0)
    assert model.num_observations == 1 and model.last_step_ms == 6.0 and timer.total_ms == 9.0


def test_calibration_shapes_fit_the_engine_limits():
    shapes = calibration_shapes(max_num_batched_tokens=512, max_num_seqs=8)
    assert shapes and all(p + d <= 512 and d <= 8 for p, d in shapes)
    assert len(set(shapes)) == len(shapes)