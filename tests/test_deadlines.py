"""Request deadlines (SamplingParams.timeout) on the tiny random-weight Qwen3 checkpoint (CPU).

A request with no token by its deadline is dropped (its stream raises RequestTimeoutError; LLM:
finish_reason "timeout" and no tokens); one generating then ends with finish_reason "timeout" and
the tokens so far, its blocks free at once; with equal priorities the earlier deadline is admitted
first. Deadlines run on a fake clock here: ManualClock, set by the test, or StepClock, one second
per step the engine launches, so that a timeout counts steps whatever the machine's speed. One
overload test runs on the real clock. Every async test runs under anyio.fail_after, on asyncio and
trio, with serial and overlapped steps.
"""
from __future__ import annotations

import random

import anyio
import pytest

from asyncllm import LLM, RequestTimeoutError, SamplingParams
from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.engine.block_manager import BlockManager
from asyncllm.engine.deadlines import RequestDeadlines
from asyncllm.engine.scheduler import Scheduler
from asyncllm.engine.sequence import Sequence, SequenceStatus
from asyncllm.outputs import FinishReason
from helpers import ManualClock, StepClock, anyio_asyncio_and_trio, assert_all_blocks_free  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(300)

ENGINE_KW = dict(num_kvcache_blocks=64, kvcache_block_size=16, max_model_len=256)
PROMPT = [5, 6, 7, 8, 9]
OTHER_PROMPT = [11, 22, 33, 44]
TIMEOUT = 120  # seconds of real time for an async test: a hang fails, a busy machine does not


def greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)


def step_tokens(core, steps: int) -> list[int]:
    """Run the core `steps` steps; the tokens its events carry (none may end a request)."""
    tokens = []
    for _ in range(steps):
        for event in core.step():
            assert event.finish_reason is None, event
            tokens += event.new_token_ids
    return tokens


# ---- the scheduler's order (no model) ------------------------------------------------------------
def new_seq(request_id: str, deadline: float | None = None, priority: int = 0, length: int = 16) -> Sequence:
    return Sequence(request_id, list(range(100, 100 + length)), SamplingParams(priority=priority), 16,
                    deadline=deadline)


def test_admission_is_by_priority_then_deadline_then_arrival():
    scheduler = Scheduler(BlockManager(64, 16, False), 1024, max_num_seqs=1)
    for seq in (new_seq("none"), new_seq("late", 50.0), new_seq("soon", 10.0), new_seq("urgent", None, priority=-1),
                new_seq("soon-2nd", 10.0)):
        scheduler.add(seq)
    assert [s.request_id for s in scheduler.waiting] == ["urgent", "soon", "soon-2nd", "late", "none"]
    admitted = []
    while scheduler.waiting:
        out = scheduler.schedule()
        seq = out.scheduled[0].seq
        admitted.append(seq.request_id)
        scheduler.finish(seq, FinishReason.STOP)
    assert admitted == ["urgent", "soon", "soon-2nd", "late", "none"]


def test_preemption_takes_the_latest_deadline_first():
    """Three one-block prompts in a four-block cache: at their 17th token two need a block more, and
    the one preempted for it is the one without a deadline, the other end of admission's order."""
    bm = BlockManager(4, 16, False)
    scheduler = Scheduler(bm, 1024, max_num_seqs=8)
    seqs = {name: new_seq(name, deadline) for name, deadline in (("none", None), ("soon", 10.0), ("late", 30.0))}
    for seq in seqs.values():
        scheduler.add(seq)
    for _ in range(2):  # the prompts, then the first decodes
        out = scheduler.schedule()
        scheduler.commit(out)
        for item in out.scheduled:
            if item.samples:
                item.seq.token_ids.append(1)
    assert seqs["none"].status is SequenceStatus.WAITING and seqs["none"].num_preemptions == 1
    assert [s.request_id for s in scheduler.running] == ["soon", "late"]


# ---- RequestDeadlines ------------------------------------------------------------------------------
def test_entries_of_requests_that_ended_otherwise_are_dropped():
    """A long timeout must not keep every finished request's sequence until its deadline."""
    deadlines = RequestDeadlines(clock=lambda: 0.0)
    live = {}
    for i in range(1000):
        seq = new_seq(f"r{i}", deadline=1e6)
        deadlines.add(seq)
        live[seq.request_id] = seq
        if i % 10:  # nine in ten end before their deadline
            del live[seq.request_id]
        deadlines.pop_expired(live)
    assert len(deadlines) <= 2 * len(live) + 64
    assert deadlines.pop_expired(live) == []


# ---- the engine core, through the sync LLM ---------------------------------------------------------
@pytest.fixture(scope="module")
def llms(tiny_qwen3):
    """LLM(overlap_scheduling=overlap, max_num_seqs=...), one per setting, made on first use."""
    made = {}

    def get(overlap: bool, max_num_seqs: int = 8) -> LLM:
        key = (overlap, max_num_seqs)
        if key not in made:
            made[key] = LLM(tiny_qwen3, overlap_scheduling=overlap, max_num_seqs=max_num_seqs, **ENGINE_KW)
        return made[key]
    return get


@pytest.fixture(scope="module")
def reference(llms) -> list[int]:
    """PROMPT's greedy tokens without a timeout."""
    return llms(False).generate([PROMPT], greedy(60), use_tqdm=False)[0]["token_ids"]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_request_running_past_its_deadline_ends_with_timeout_and_its_tokens(llms, reference, overlap, monkeypatch):
    core = llms(overlap).core
    clock = ManualClock().install(core, monkeypatch)
    seq = core.add_request(PROMPT, greedy(60, timeout=10), "r")
    delivered = step_tokens(core, 4)
    assert delivered
    clock.now = 10.0  # the deadline
    events = core.step()
    assert [(e.seq.request_id, e.finish_reason, e.request_finished, e.error) for e in events if e.finish_reason] \
        == [("r", FinishReason.TIMEOUT, True, None)]
    delivered += [t for e in events for t in e.new_token_ids]
    # the tokens so far, in order; the one in flight (overlap) dropped, never delivered
    assert delivered == seq.completion_token_ids == reference[:len(delivered)]
    assert seq.finish_reason == "timeout"
    assert_all_blocks_free(core)  # at once, not when a later step resolves
    assert core.drain() == [] and not core.has_unfinished() and core.requests == {}


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_request_with_no_token_by_its_deadline_is_dropped_unscheduled(llms, reference, overlap, monkeypatch):
    core = llms(overlap, max_num_seqs=1).core
    StepClock().install(core, monkeypatch)
    running = core.add_request(PROMPT, greedy(30), "running")
    tokens = step_tokens(core, 2)
    queued = core.add_request(OTHER_PROMPT, greedy(30, timeout=3), "queued")  # waits for the one slot
    ended = []
    while core.has_unfinished():
        for event in core.step():
            tokens += event.new_token_ids if event.seq is running else []
            if event.seq is queued:
                ended.append((event, running.is_finished))
    assert [(e.finish_reason, e.request_finished, e.new_token_ids, running_ended)
            for e, running_ended in ended] == [("timeout", True, [], False)]  # while the other one still ran
    assert "no token within its timeout of 3 s" in ended[0][0].error and "still queued" in ended[0][0].error
    assert queued.first_scheduled_time is None and queued.completion_token_ids == []
    assert running.finish_reason == "length" and tokens == running.completion_token_ids == reference[:30]
    assert_all_blocks_free(core)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_n_sequences_time_out_together(llms, overlap, monkeypatch):
    core = llms(overlap).core
    clock = ManualClock().install(core, monkeypatch)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=60, ignore_eos=True, timeout=5)
    leader = core.add_request(PROMPT, params, "n3")
    delivered = {i: [] for i in range(3)}
    for _ in range(4):
        for event in core.step():
            delivered[event.seq.index] += event.new_token_ids
    clock.now = 5.0
    events = [e for e in core.step() if e.finish_reason is not None]
    assert sorted(e.seq.index for e in events) == [0, 1, 2]
    assert {e.finish_reason for e in events} == {"timeout"} and [e.request_finished for e in events][-1]
    for seq in leader.group:
        assert seq.finish_reason == "timeout" and seq.completion_token_ids == delivered[seq.index]
    assert any(delivered.values())
    assert_all_blocks_free(core)

    # never started: one event, carrying the error; every sequence (none forked yet) ends
    clock.now = 0.0
    leader = core.add_request(PROMPT, params, "n3-late")
    clock.now = 5.0
    events = core.step()
    assert [(e.seq.index, e.finish_reason, e.request_finished) for e in events] == [(0, "timeout", True)]
    assert events[0].error is not None and {s.finish_reason for s in leader.group} == {"timeout"}
    assert core.drain() == [] and core.requests == {}
    assert_all_blocks_free(core)


def test_the_deadline_of_an_ended_request_never_ends_a_later_one_with_its_id(llms, monkeypatch):
    core = llms(False).core
    clock = ManualClock().install(core, monkeypatch)
    first = core.add_request(PROMPT, greedy(2, timeout=5), "same-id")
    step_tokens(core, 1)
    core.step()
    assert first.finish_reason == "length" and core.requests == {}
    later = core.add_request(PROMPT, greedy(4), "same-id")
    clock.now = 6.0  # past the first one's deadline
    step_tokens(core, 3)
    assert [e.finish_reason for e in core.step()] == ["length"] and later.num_completion_tokens == 4


def test_llm_generate_applies_deadlines_earliest_first(llms, reference, monkeypatch):
    """Two requests, one slot: the one with the earlier deadline runs first (first come first
    served would leave it no token by its deadline); each ends "timeout" with its tokens so far.
    A request that cannot start before its deadline gets "timeout" with no tokens."""
    llm = llms(False, max_num_seqs=1)
    StepClock().install(llm.core, monkeypatch)
    late, soon = llm.generate([PROMPT, OTHER_PROMPT], [greedy(30, timeout=6.5), greedy(30, timeout=3)],
                              use_tqdm=False)
    assert late["finish_reason"] == soon["finish_reason"] == "timeout"
    assert late["token_ids"] and soon["token_ids"] and late["token_ids"] == reference[:len(late["token_ids"])]
    first, never = llm.generate([PROMPT, OTHER_PROMPT], [greedy(20, priority=-1), greedy(20, timeout=3)],
                                use_tqdm=False)
    assert first["finish_reason"] == "length" and first["token_ids"] == reference[:20]
    assert never["finish_reason"] == "timeout" and never["token_ids"] == [] and never["text"] == ""
    assert_all_blocks_free(llm)


def test_requests_without_a_timeout_leave_no_deadline(llms):
    llm = llms(False)
    llm.generate([PROMPT, OTHER_PROMPT], greedy(3), use_tqdm=False)
    assert len(llm.core.deadlines) == 0


# ---- AsyncLLMEngine ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlap"])
def make_engine(tiny_qwen3, request):
    def make(**overrides) -> AsyncLLMEngine:
        return AsyncLLMEngine(tiny_qwen3, **{**ENGINE_KW, "overlap_scheduling": request.param, **overrides})
    return make


async def assert_idle(engine: AsyncLLMEngine) -> None:
    await engine.wait_idle()
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.anyio
async def test_a_stream_running_past_its_deadline_ends_with_timeout(make_engine, reference, monkeypatch):
    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            StepClock().install(engine._core, monkeypatch)
            stream = engine.stream(PROMPT, greedy(60, timeout=6))
            items = [out async for out in stream]
            tokens = [t for out in items for t in out.token_ids]
            assert [out.finish_reason for out in items][-1] == "timeout" == stream.finish_reason
            assert 1 <= len(tokens) < 60 and tokens == reference[:len(tokens)] == stream.token_ids
            result = await engine.generate(PROMPT, greedy(60, timeout=6))
            assert result.finish_reason == "timeout" and result.token_ids == tokens
            await assert_idle(engine)


@pytest.mark.anyio
async def test_a_stream_with_no_token_by_its_deadline_raises(make_engine, reference, monkeypatch):
    with anyio.fail_after(TIMEOUT):
        async with make_engine(max_num_seqs=1) as engine:
            StepClock().install(engine._core, monkeypatch)
            running = engine.stream(PROMPT, greedy(40))
            first = await running.__anext__()  # it holds the one slot
            queued = engine.stream(OTHER_PROMPT, greedy(40, timeout=3))
            with pytest.raises(RequestTimeoutError, match="no token within its timeout of 3 s") as info:
                await queued.__anext__()
            assert isinstance(info.value, TimeoutError)
            tokens = first.token_ids + [t async for out in running for t in out.token_ids]
            assert running.finish_reason == "length" and tokens == reference[:40]
            await assert_idle(engine)


@pytest.mark.anyio
async def test_n_streamed_sequences_end_with_timeout(make_engine, monkeypatch):
    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            StepClock().install(engine._core, monkeypatch)
            params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=60, ignore_eos=True, timeout=6)
            stream = engine.stream(PROMPT, params)
            last = {}
            async for out in stream:
                assert out.index not in last, "an item after a sequence's last"
                if out.finish_reason is not None:
                    last[out.index] = out.finish_reason
            assert last == {0: "timeout", 1: "timeout", 2: "timeout"} and stream.finish_reason == "timeout"
            assert 1 <= stream.num_completion_tokens < 3 * 60
            await assert_idle(engine)


async def run_overload(engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, int]:
    """Stream every request at once; each must end by completing, with "timeout" and its tokens so
    far, or with RequestTimeoutError and none. Returns how many ended each way."""
    outcomes = {"completed": 0, "timeout": 0, "refused": 0}

    async def one(prompt, params) -> None:
        stream = engine.stream(prompt, params)
        try:
            async for _ in stream:
                pass
        except RequestTimeoutError:
            assert stream.token_ids == []
            outcomes["refused"] += 1
            return
        if stream.finish_reason == "timeout":
            assert 1 <= len(stream.token_ids) < params.max_tokens
            outcomes["timeout"] += 1
        else:
            assert stream.finish_reason == "length" and len(stream.token_ids) == params.max_tokens
            outcomes["completed"] += 1

    async with anyio.create_task_group() as tasks:
        for prompt, params in requests:
            tasks.start_soon(one, prompt, params)
    await assert_idle(engine)
    return outcomes


def overload(rng: random.Random, short: float, timeouts: tuple[float, float]) -> list:
    """40 requests for 4 slots, about ten times what fits in their timeouts: 10 with a short
    timeout (at most 4 can start in it), 20 with timeouts drawn from `timeouts`, 10 without one."""
    def prompt() -> list[int]:
        return [rng.randrange(100, 5000) for _ in range(rng.randrange(3, 40))]
    return ([(prompt(), greedy(rng.randrange(8, 24), timeout=short)) for _ in range(10)]
            + [(prompt(), greedy(rng.randrange(8, 24), timeout=rng.uniform(*timeouts))) for _ in range(20)]
            + [(prompt(), greedy(rng.randrange(8, 24))) for _ in range(10)])


@pytest.mark.anyio
async def test_under_a_tenfold_overload_every_request_ends_by_its_deadline(make_engine, monkeypatch):
    """Each request completes or ends by its deadline, none hangs, every block is free afterwards;
    and no request is ever scheduled at or past its deadline (it ends within the step its
    deadline passes in)."""
    requests = overload(random.Random(50), 3, (5, 40))
    late = []
    with anyio.fail_after(TIMEOUT):
        async with make_engine(max_num_seqs=4, num_kvcache_blocks=16) as engine:
            core = engine._core
            clock = StepClock().install(core, monkeypatch)
            schedule = core.scheduler.schedule

            def checked_schedule():  # on the engine thread: recorded, asserted below
                late.extend(seq.request_id for seq in core.requests.values()
                            if seq.deadline is not None and seq.deadline <= clock.now)
                return schedule()
            monkeypatch.setattr(core.scheduler, "schedule", checked_schedule)
            outcomes = await run_overload(engine, requests)
    assert late == []
    # the short timeouts: 4 at most start, and end "timeout"; the rest never start; no timeout: completes
    assert outcomes["completed"] >= 10 and outcomes["timeout"] >= 1 and outcomes["refused"] >= 6, outcomes
    assert sum(outcomes.values()) == 40


@pytest.mark.anyio
async def test_under_overload_on_the_real_clock_nothing_hangs_or_leaks(make_engine):
    requests = overload(random.Random(51), 0.05, (0.1, 2.0))
    with anyio.fail_after(TIMEOUT):
        async with make_engine(max_num_seqs=4, num_kvcache_blocks=16) as engine:
            outcomes = await run_overload(engine, requests)
    assert outcomes["completed"] >= 10 and sum(outcomes.values()) == 40, outcomes
