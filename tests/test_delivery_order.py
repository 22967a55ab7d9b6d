"""When AsyncLLMEngine hands a step's tokens to the consumers, and the launch gate that keeps the
consumers' Python off the interpreter while the engine thread launches a step (CPU, tiny Qwen3).

With overlap (forced on here: on CPU it brings no speed, but the logic is the GPU's), a step's events
go out after the next step is launched, and the gate is clear from the moment a step's results are
on the host until that launch; without overlap events go out as soon as their step is resolved.
"""
from __future__ import annotations

import time

import anyio
import pytest

from asyncllm import streams
from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.errors import EngineDeadError
from asyncllm.sampling_params import SamplingParams
from helpers import anyio_asyncio_and_trio  # noqa: F401 - a fixture: both event loops

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ENGINE_KW = dict(num_kvcache_blocks=128, kvcache_block_size=16, target_step_ms=None)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[11, 22, 33, 44], [5, 6, 7], [101, 102, 103, 104, 105, 106]]


def record_loop(engine: AsyncLLMEngine, log: list) -> None:
    """Log the engine thread's launches (with the gate's state), resolves and deliveries, in order."""
    core, gate, engine_thread = engine._core, engine._launch_gate, engine._engine_thread
    launch, resolve, deliver = core.launch_step, core.resolve_step, engine_thread._deliver

    def logged_launch():
        log.append(("launch", gate.is_open))
        launch()

    def logged_resolve():
        events = resolve()
        log.append(("resolve", len(events)))
        return events

    def logged_deliver(events):
        log.append(("deliver", len(events)))
        deliver(events)
    core.launch_step, core.resolve_step, engine_thread._deliver = logged_launch, logged_resolve, logged_deliver


async def stream_tokens(engine: AsyncLLMEngine, prompt) -> list[int]:
    return await read_tokens(engine.stream(prompt, GREEDY))


async def read_tokens(stream) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
async def test_tokens_go_out_after_the_next_launch_with_overlap_at_once_without(tiny_qwen3, overlap):
    async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW, overlap_scheduling=overlap) as engine:
        log: list = []
        record_loop(engine, log)
        with anyio.fail_after(60):
            # submitted together, so the engine never goes idle between them (it opens the gate then)
            submitted = [engine.stream(prompt, GREEDY) for prompt in PROMPTS]
            async with anyio.create_task_group() as group:
                for stream in submitted:
                    group.start_soon(read_tokens, stream)
            await engine.wait_idle()
        assert engine._launch_gate.is_open  # idle: nobody's read may wait for a launch
    deliveries = [i for i, (kind, n) in enumerate(log) if kind == "deliver" and n]
    assert len(deliveries) >= GREEDY.max_tokens
    for i in deliveries:
        if overlap:
            # step N's events: resolved one turn earlier, sent right after step N+2's launch (at the
            # very end, with nothing left to launch, right after their resolve)
            resolved = log[i - 2] if log[i - 1][0] == "launch" else log[i - 1]
            assert resolved == ("resolve", log[i][1]), log[i - 3:i + 1]
        else:
            assert log[i - 1] == ("resolve", log[i][1]), log[i - 2:i + 1]
    if overlap:  # only the last step's events, once nothing is left to launch, skip the wait for a launch
        assert sum(log[i - 1][0] == "resolve" for i in deliveries) <= len(PROMPTS)
    first_resolve = next(i for i, (kind, _) in enumerate(log) if kind == "resolve")
    later_launches = [gate_open for kind, gate_open in log[first_resolve:] if kind == "launch"]
    assert later_launches
    # with overlap every launch after a resolve runs with the gate closed; without overlap, never
    assert all(gate_open is (not overlap) for gate_open in later_launches), later_launches


async def test_streams_give_the_serial_engine_tokens_with_the_gate_and_without(tiny_qwen3, monkeypatch):
    results = {}
    for gate in ("1", "0"):
        monkeypatch.setenv("ASYNCLLM_LAUNCH_GATE", gate)
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW, overlap_scheduling=True) as engine:
            assert engine._use_launch_gate is (gate == "1")
            with anyio.fail_after(60):
                results[gate] = [await stream_tokens(engine, p) for p in PROMPTS]
    async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW, overlap_scheduling=False) as engine:
        with anyio.fail_after(60):
            serial = [await stream_tokens(engine, p) for p in PROMPTS]
    assert results["1"] == results["0"] == serial


async def test_a_launch_that_never_ends_holds_the_loop_back_a_bounded_time(tiny_qwen3, monkeypatch):
    """A launch can take seconds (a kernel compiles): the gate then holds the event loop for at most
    LAUNCH_GATE_WAIT_S per launch, all streams' reads together, and the streams still complete."""
    monkeypatch.setattr(streams, "LAUNCH_GATE_WAIT_S", 0.05)
    monkeypatch.setattr(streams.LaunchGate, "open", lambda self: None)  # stuck closed from the first resolve on
    async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW, overlap_scheduling=True) as engine:
        gate = engine._launch_gate
        waits, closings = [], []
        wait, close = gate._open.wait, streams.LaunchGate.close

        def timed_wait(timeout=None):
            start = time.monotonic()
            result = wait(timeout)
            waits.append(time.monotonic() - start)
            return result
        gate._open.wait = timed_wait
        monkeypatch.setattr(streams.LaunchGate, "close", lambda self: (closings.append(1), close(self)))
        counts = []

        async def count_tokens(prompt):
            counts.append(len(await stream_tokens(engine, prompt)))
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for prompt in PROMPTS:
                    group.start_soon(count_tokens, prompt)
        assert counts == [GREEDY.max_tokens] * len(PROMPTS)
        assert waits  # reads did find it closed
        # one timed-out wait per closing at most, whichever stream's read ran into it
        assert len(waits) <= len(closings), (len(waits), len(closings))


async def test_a_failed_step_opens_the_gate(tiny_qwen3):
    async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW, overlap_scheduling=True) as engine:
        with anyio.fail_after(60):
            stream = engine.stream(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
            await stream.__anext__()  # decoding now, steps in flight

            def failing_launch():
                raise RuntimeError("injected launch failure")
            engine._core.launch_step = failing_launch
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        assert engine._launch_gate.is_open
