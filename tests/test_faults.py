"""Fault injection: what users see when something breaks, and that nothing hangs.

Every wait is bounded (anyio.fail_after), so a hang fails the test instead of stalling the suite.
Faults are injected into a running engine by monkeypatching its parts on the engine thread's path:
the model's forward, the sampler, the scheduler. Consumers' own failures and misbehaviour (raising
inside `async for`, never reading) must cost only their own request.
"""
from __future__ import annotations

import gc
import threading

import anyio
import pytest
import torch

from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.errors import EngineDeadError
from asyncllm.llm import LLM
from asyncllm.sampling_params import SamplingParams
from helpers import assert_all_blocks_free, engine_threads

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ENGINE_KW = dict(num_kvcache_blocks=64, kvcache_block_size=16)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # ~minutes on CPU: only ever cut short
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TIMEOUT = 60


def record_finishes(engine: AsyncLLMEngine) -> list[tuple[str, str, int]]:
    """(request_id, reason, completion tokens) of every request the engine ended early."""
    finishes = []
    finish_request = engine._core.finish_request

    def recording(request_id, reason="abort", index=None):
        seq = finish_request(request_id, reason, index)
        if seq is not None:
            finishes.append((request_id, reason, seq.num_completion_tokens))
        return seq
    engine._core.finish_request = recording
    return finishes


async def assert_idle_and_free(engine: AsyncLLMEngine) -> None:
    await engine.wait_idle()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert engine._core.requests == {} and engine._engine_thread.channels == {}


class Arm:
    """A fault that fires on the engine thread once armed, after the test saw the streams flowing."""

    def __init__(self, error: BaseException):
        self.error = error
        self.armed = threading.Event()
        self.fired = threading.Event()

    def wrap(self, fn):
        def faulty(*args, **kwargs):
            if self.armed.is_set():
                self.fired.set()
                raise self.error
            return fn(*args, **kwargs)
        return faulty


def inject(engine: AsyncLLMEngine, where: str, arm: Arm) -> None:
    core = engine._core
    if where == "model.forward":
        core.runner.model.forward = arm.wrap(core.runner.model.forward)
    elif where == "sampler.forward":
        core.runner.sampler.forward = arm.wrap(core.runner.sampler.forward)
    elif where == "scheduler.schedule":
        core.scheduler.schedule = arm.wrap(core.scheduler.schedule)
    else:
        raise AssertionError(where)


# ---- a failure on the engine thread: everybody hears EngineDeadError, nothing hangs --------------
FAULTS = [
    ("model.forward", RuntimeError("CUDA error: an illegal memory access was encountered"), "asyncio"),
    ("model.forward", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "trio"),
    ("sampler.forward", RuntimeError("probability tensor contains inf or nan"), "asyncio"),
    ("scheduler.schedule", RuntimeError("scheduler bug"), "trio"),
]


@pytest.mark.parametrize("where,error,anyio_backend", FAULTS, ids=[f"{w}-{b}" for w, _, b in FAULTS])
async def test_engine_thread_failure_reaches_every_consumer(tiny_qwen3, where, error, anyio_backend):
    outcomes: dict[str, BaseException | str] = {}
    arm = Arm(error)
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, max_num_seqs=2, **ENGINE_KW) as engine:
            inject(engine, where, arm)

            async def consume(name: str, stream, first: anyio.Event | None = None) -> None:
                try:
                    async for _ in stream:
                        if first is not None:
                            first.set()
                    outcomes[name] = f"ended: {stream.finish_reason}"
                except EngineDeadError as e:
                    outcomes[name] = e

            async with anyio.create_task_group() as tg:
                firsts = [anyio.Event(), anyio.Event()]
                for i in range(2):  # decoding (max_num_seqs=2)
                    tg.start_soon(consume, f"running{i}", engine.stream([i + 1] * 6, LONG), firsts[i])
                for i in range(2):  # queued in the scheduler behind them
                    tg.start_soon(consume, f"queued{i}", engine.stream([i + 7] * 6, LONG))
                tg.start_soon(consume, "chat", engine.chat([{"role": "user", "content": "Hi"}], LONG))
                for first in firsts:
                    await first.wait()
                arm.armed.set()
                await anyio.to_thread.run_sync(arm.fired.wait, TIMEOUT)
                assert arm.fired.is_set()

            # every consumer, running or queued, got EngineDeadError with the cause attached
            assert sorted(outcomes) == ["chat", "queued0", "queued1", "running0", "running1"]
            for name, outcome in outcomes.items():
                assert isinstance(outcome, EngineDeadError), (name, outcome)
                assert outcome.__cause__ is error
                assert type(error).__name__ in str(outcome)
            # later calls fail at once with the same error type, never hang
            with pytest.raises(EngineDeadError, match="failed"):
                engine.stream([1, 2, 3], SHORT)
            with pytest.raises(EngineDeadError):
                await engine.generate("Hello", SHORT)
            with pytest.raises(EngineDeadError):
                engine.chat([{"role": "user", "content": "Hi"}], SHORT)
            with pytest.raises(EngineDeadError):
                await engine.wait_idle()
            engine.abort("running0")  # a no-op, not an error
            assert isinstance(engine.stats(), dict)
        # shutdown of a dead engine is clean (no exception out of `async with`), the thread is gone
        assert engine_threads() == []
        await engine.shutdown()  # idempotent


# ---- a consumer's own bug costs only its own request ----------------------------------------------
class AppBug(Exception):
    pass


async def test_exception_in_one_consumer_aborts_only_its_request(tiny_qwen3):
    results = {}
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
            finishes = record_finishes(engine)
            reference = await engine.generate([5, 6, 7, 8], SHORT)

            async def healthy(name: str) -> None:
                results[name] = await engine.generate([5, 6, 7, 8], SHORT)

            # three ways an app writes its loop; each raises from its own code after the first item
            async def buggy_inline() -> None:
                async for out in engine.stream([1, 2, 3], LONG, request_id="inline"):
                    raise AppBug(f"bug after {len(out.token_ids)} tokens")

            async def buggy_local() -> None:
                stream = engine.stream([1, 2, 3], LONG, request_id="local")
                async for _ in stream:
                    raise AppBug("bug")

            async def buggy_with() -> None:
                async with engine.stream([1, 2, 3], LONG, request_id="with") as stream:
                    async for _ in stream:
                        raise AppBug("bug")

            async def guarded(fn) -> None:
                # a web framework's per-request handler: the error is reported, not kept
                try:
                    await fn()
                except AppBug as e:
                    results[fn.__name__] = str(e)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(healthy, f"healthy{i}")
                for fn in (buggy_inline, buggy_local, buggy_with):
                    tg.start_soon(guarded, fn)
            await assert_idle_and_free(engine)

    for fn in ("buggy_inline", "buggy_local", "buggy_with"):
        assert results[fn].startswith("bug"), results
    for i in range(3):  # the others were unaffected: the same output as alone
        result = results[f"healthy{i}"]
        assert result.finish_reason == "length" and result.token_ids == reference.token_ids
    # each buggy request was aborted by the engine right away, far from its 400 tokens
    aborted = {rid: n for rid, reason, n in finishes if reason == "abort"}
    assert set(aborted) == {"inline", "local", "with"}, finishes
    assert all(n < 100 for n in aborted.values()), aborted


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
async def test_consumer_that_never_reads_does_not_block_others(tiny_qwen3, overlap):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW, overlap_scheduling=overlap) as engine:
            unread = engine.stream([9, 8, 7, 6], params)  # referenced, never iterated (yet)
            results = []

            async def reader(i: int) -> None:
                results.append(await engine.generate([i + 1, i + 2, i + 3], params))

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(reader, i)
            assert [(r.finish_reason, len(r.token_ids)) for r in results] == [("length", 30)] * 4
            # the unread request ran to its end without its consumer; its blocks are free already
            await assert_idle_and_free(engine)
            assert unread.finish_reason is None  # nothing read yet
            # its tokens piled up in its channel and come out merged in one item
            items = [out async for out in unread]
            assert len(items) == 1 and items[0].finish_reason == "length"
            assert len(items[0].token_ids) == 30 and unread.token_ids == items[0].token_ids
            assert items[0].text == unread.text
            alone = await engine.generate([9, 8, 7, 6], params)
            assert alone.token_ids == unread.token_ids


# ---- shutdown while streams are active ------------------------------------------------------------
# trio with steps overlapped: shutdown with a step in flight
@pytest.mark.parametrize("anyio_backend, overlap", [("asyncio", False), ("trio", True)])
async def test_shutdown_while_streaming_ends_every_stream(tiny_qwen3, anyio_backend, overlap):
    ends = {}
    with anyio.fail_after(TIMEOUT):
        engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW, overlap_scheduling=overlap)
        await engine.start()
        try:
            async def consume(name: str, stream, first: anyio.Event) -> None:
                items = []
                async for out in stream:
                    items.append(out)
                    first.set()
                ends[name] = (stream.finish_reason, items[-1].finish_reason, len(stream.token_ids))

            unread = engine.stream([4, 4, 4], LONG)
            async with anyio.create_task_group() as tg:
                firsts = [anyio.Event() for _ in range(3)]
                for i, first in enumerate(firsts):
                    tg.start_soon(consume, f"s{i}", engine.stream([i + 1] * 5, LONG), first)
                for first in firsts:
                    await first.wait()

                async def stopper() -> None:
                    await engine.shutdown()  # from another task, while the readers wait
                tg.start_soon(stopper)
            assert engine_threads() == []
            unread_items = [out async for out in unread]
        finally:
            await engine.shutdown()
    assert sorted(ends) == ["s0", "s1", "s2"]
    for name, (finish, last_item_finish, count) in ends.items():
        assert finish == last_item_finish == "abort" and 1 <= count < 400, (name, ends[name])
    assert unread_items[-1].finish_reason == "abort" and unread.finish_reason == "abort"
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.stream([1, 2, 3], SHORT)


# ---- the sync LLM ----------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [RuntimeError("device lost"), KeyboardInterrupt()], ids=["RuntimeError", "Ctrl-C"])
def test_sync_generate_fault_propagates_and_frees_everything(tiny_qwen3, error, monkeypatch):
    llm = LLM(tiny_qwen3, **ENGINE_KW)
    prompts = ["Hello, my name is", [11, 22, 33, 44, 55, 66, 77] * 5, "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = llm.generate(prompts, params, use_tqdm=False)
    model = llm.core.runner.model
    forward = model.forward
    calls = []

    def faulty_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # mid-generation: prompts prefilled, some decodes done
            raise error
        return forward(*args, **kwargs)
    monkeypatch.setattr(model, "forward", faulty_forward)
    with pytest.raises(type(error)):
        llm.generate(prompts, params, use_tqdm=False)
    assert len(calls) == 4
    assert_all_blocks_free(llm)
    assert llm.core.requests == {} and not llm.core.has_unfinished()
    # the fault removed, the same LLM works, and the prefix cache left by the failed run is sound
    monkeypatch.setattr(model, "forward", forward)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert again == reference
    assert_all_blocks_free(llm)
    del llm
    gc.collect()
