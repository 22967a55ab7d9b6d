"""Every sampling field with every odd value, through the async engine and through the server;
every argument of AsyncLLMEngine's and LLM's public methods with every odd value; and concurrent
misuse: two readers of one stream, two threads in LLM.generate, concurrent start() calls, a cancelled
shutdown.

For each (field, value) pair of ODD_VALUES x SAMPLING_FIELDS: SamplingParams either accepts it or
raises ValueError/TypeError naming `SamplingParams.<field>`, nothing else; an accepted one is run
through a live AsyncLLMEngine while a reference stream decodes, and the engine never dies (a
timeout too short for a step ends with RequestTimeoutError); the same value sent as JSON to the
server gets 200 or an OpenAI-shaped 400 (408 for such a timeout), never a 500. The counts are
printed (docs/RELIABILITY.md quotes them): zero engine deaths, hangs or 500s is the outcome.
"""
from __future__ import annotations

import json
import math
import threading

import anyio
import pytest

from asyncllm import engine_thread
from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.errors import EngineDeadError, RequestTimeoutError
from asyncllm.llm import LLM
from asyncllm.sampling_params import SamplingParams
from helpers import assert_all_blocks_free, engine_threads

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

SAMPLING_FIELDS = ["temperature", "top_k", "top_p", "min_p", "max_tokens", "ignore_eos", "stop_token_ids", "stop",
                   "include_stop_str_in_output", "seed", "timeout"]
ODD_VALUES = [None, True, False, 0, 1, -1, 2, 0.5, -0.5, 1e-9, 1e300, -1e300, math.nan, math.inf, -math.inf,
              2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30, 10 ** 400, -(10 ** 400), "", "0.7", "5", "stop",
              "\ud800", [], [None], [-1], [1.5], ["a", 3], [2 ** 70], ["x" * 5000], ["y"] * 200, {}, {"a": 1},
              (1, 2), b"bytes", object()]
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def build(field: str, value):
    """SamplingParams with field=value on short, cheap defaults; None when refused as it must be."""
    base = dict(temperature=0.0, max_tokens=2, ignore_eos=True)
    try:
        return SamplingParams(**{**base, field: value})
    except (ValueError, TypeError) as e:
        assert f"SamplingParams.{field}" in str(e), (field, value, e)
        assert len(str(e)) < 500, "a huge value must not be printed whole"
        return None


async def start_reference(engine) -> tuple:
    """(PROMPT's greedy output alone, a stream of the same request that decodes while the odd calls come)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = await engine.generate(PROMPT, params)
    reference = engine.stream(PROMPT, params)
    await reference.__anext__()
    return alone, reference


async def assert_reference_untouched(alone, reference) -> None:
    async for _ in reference:
        pass
    assert reference.token_ids == alone.token_ids and reference.finish_reason == "length"


async def test_every_sampling_field_with_every_odd_value(tiny_qwen3):
    counts = {"tried": 0, "refused": 0, "ran": 0, "timed_out": 0, "engine_deaths": 0}
    with anyio.fail_after(240):
        async with AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=128, kvcache_block_size=16) as engine:
            alone, reference = await start_reference(engine)
            for field in SAMPLING_FIELDS:
                for value in ODD_VALUES:
                    counts["tried"] += 1
                    params = build(field, value)
                    if params is None:
                        counts["refused"] += 1
                        continue
                    try:
                        stream = engine.stream(PROMPT, params)
                    except (ValueError, TypeError):  # refused at submission: checked against the model (token ids)
                        counts["refused"] += 1
                        continue
                    try:
                        async for _ in stream:
                            break  # one item is enough: the step that made it took this request
                        await stream.aclose()
                        counts["ran"] += 1
                    except RequestTimeoutError:  # a timeout too short for a step (1e-9 s): no token
                        counts["timed_out"] += 1
                    except EngineDeadError:
                        counts["engine_deaths"] += 1
                        raise
            await assert_reference_untouched(alone, reference)
            await engine.wait_idle()
            stats = engine.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
    print(f"\nodd sampling values through the engine: {counts}")
    assert counts["tried"] >= 400 and counts["engine_deaths"] == 0 and counts["ran"] > 0


async def test_every_sampling_field_with_every_odd_json_value_is_never_a_500(tiny_qwen3):
    httpx = pytest.importorskip("httpx")
    from asyncllm.server import create_app
    counts: dict[int, int] = {}
    with anyio.fail_after(240):
        async with AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=128, kvcache_block_size=16) as engine:
            app = create_app(engine, "tiny", manage_engine=False, max_tokens_limit=4)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                for field in SAMPLING_FIELDS + ["n", "logit_bias", "stream", "user"]:
                    for value in ODD_VALUES:
                        try:
                            body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0, field: value})
                        except (TypeError, ValueError):
                            continue  # not expressible as JSON
                        response = await client.post("/v1/completions", content=body,
                                                     headers={"content-type": "application/json"})
                        counts[response.status_code] = counts.get(response.status_code, 0) + 1
                        # 408: a timeout too short for a step (1e-9 s)
                        assert response.status_code in (200, 400) or response.status_code == 408 and \
                            field == "timeout", (field, value, response.status_code, response.text)
                        if response.status_code == 400:
                            error = response.json()["error"]
                            assert error["type"] == "invalid_request_error" and error["message"], error
                            assert error["param"] in (field, "max_tokens"), (field, value, error)
            await engine.wait_idle()
            stats = engine.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
    print(f"\nodd JSON values through the server, by HTTP status: {counts}")
    assert sum(counts.values()) >= 400 and 500 not in counts


# ---- every public method of AsyncLLMEngine and LLM, each argument with every odd value (issue 52) ----
ODD_ARGUMENTS = ODD_VALUES + [{"a", "b"}, frozenset()]  # sets too: abort({"id"}) killed the engine thread
SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
MSG = [{"role": "user", "content": "Hi"}]
CHAT_KEYWORDS = ["add_generation_prompt", "continue_final_message", "chat_template", "tools", "documents",
                 "enable_thinking"]
# (method, argument, call): a call returns a stream to read, an awaitable, or nothing. The wait and
# the shutdown come last: the first waits for the reference stream, the second ends the engine.
ENGINE_CALLS = [
    ("stream", "prompt", lambda e, v: e.stream(v, SHORT)),
    ("stream", "sampling_params", lambda e, v: e.stream(PROMPT, v)),
    ("stream", "request_id", lambda e, v: e.stream(PROMPT, SHORT, request_id=v)),
    ("generate", "prompt", lambda e, v: e.generate(v, SHORT)),
    ("generate", "sampling_params", lambda e, v: e.generate(PROMPT, v)),
    ("generate", "request_id", lambda e, v: e.generate(PROMPT, SHORT, request_id=v)),
    ("chat", "messages", lambda e, v: e.chat(v, SHORT)),
    ("chat", "sampling_params", lambda e, v: e.chat(MSG, v)),
    ("chat", "request_id", lambda e, v: e.chat(MSG, SHORT, request_id=v)),
    *[("chat", name, lambda e, v, name=name: e.chat(MSG, SHORT, **{name: v})) for name in CHAT_KEYWORDS],
    ("apply_chat_template", "messages", lambda e, v: e.apply_chat_template(v)),
    ("embed", "prompts", lambda e, v: e.embed(v)),
    ("embed", "pooling", lambda e, v: e.embed(PROMPT, pooling=v)),
    ("embed", "normalize", lambda e, v: e.embed(PROMPT, normalize=v)),
    ("embed", "dimensions", lambda e, v: e.embed(PROMPT, dimensions=v)),
    ("encode", "prompt", lambda e, v: e.encode(v)),
    ("encode", "argument", lambda e, v: e.encode(PROMPT, v)),
    ("abort", "request_id", lambda e, v: e.abort(v)),
    ("wait_idle", "poll_interval", lambda e, v: e.wait_idle(v)),
    ("shutdown", "drain", lambda e, v: e.shutdown(v)),
]


# arguments whose accepted values must all be of one type (the others are refused, never passed on);
# request_id None: an id of the engine's (abort refuses it)
ACCEPTS_ONLY = {"request_id": (str, type(None)), "argument": str, "drain": bool, "use_tqdm": bool, "add_generation_prompt": bool,
                "poll_interval": (int, float), "pooling": str, "normalize": bool, "dimensions": (int, type(None))}


def named(argument: str, message: str) -> bool:
    """Whether a refusal's message names the argument (a field of SamplingParams names the field)."""
    return argument in message or (argument == "sampling_params" and "SamplingParams." in message)


async def test_every_public_method_with_every_odd_argument(tiny_qwen3):
    counts = {"tried": 0, "refused": 0, "accepted": 0, "engine_deaths": 0}
    with anyio.fail_after(240):
        async with AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=128, kvcache_block_size=16) as engine:
            alone, reference = await start_reference(engine)
            for method, argument, call in ENGINE_CALLS:
                if method == "wait_idle":  # the reference must be read to its end first: wait_idle waits for it
                    await assert_reference_untouched(alone, reference)
                for value in ODD_ARGUMENTS:
                    counts["tried"] += 1
                    try:
                        with anyio.move_on_after(10):  # wait_idle(1e300): a wait of that long is accepted
                            result = call(engine, value)
                            if hasattr(result, "__aiter__"):
                                async for _ in result:
                                    break
                                await result.aclose()
                            elif hasattr(result, "__await__"):
                                await result
                    except EngineDeadError:
                        counts["engine_deaths"] += 1
                        raise
                    except (ValueError, TypeError) as e:
                        assert named(argument, str(e)), (method, argument, value, e)
                        assert len(str(e)) < 500, "a huge value must not be printed whole"
                        counts["refused"] += 1
                        continue
                    assert isinstance(value, ACCEPTS_ONLY.get(argument, object)), (method, argument, value)
                    counts["accepted"] += 1
            assert engine_threads() == []  # the last accepted shutdown stopped it
    print(f"\nodd arguments to AsyncLLMEngine's public methods: {counts}")
    assert counts["tried"] == len(ENGINE_CALLS) * len(ODD_ARGUMENTS) and counts["accepted"] > 0


def test_every_llm_generate_argument_with_every_odd_value(tiny_qwen3):
    counts = {"tried": 0, "refused": 0, "accepted": 0}
    llm = LLM(tiny_qwen3, num_kvcache_blocks=128, kvcache_block_size=16)
    reference = llm.generate([PROMPT], SHORT, use_tqdm=False)
    calls = [("prompts", lambda v: llm.generate(v, SHORT, use_tqdm=False)),
             ("sampling_params", lambda v: llm.generate([PROMPT], v, use_tqdm=False)),
             ("use_tqdm", lambda v: llm.generate([PROMPT], SHORT, use_tqdm=v))]
    for argument, call in calls:
        for value in ODD_ARGUMENTS:
            counts["tried"] += 1
            try:
                call(value)
            except (ValueError, TypeError) as e:
                assert named(argument, str(e)), (argument, value, e)
                counts["refused"] += 1
                continue
            assert isinstance(value, ACCEPTS_ONLY.get(argument, object)), (argument, value)
            counts["accepted"] += 1
            assert llm.core.requests == {} and not llm.core.has_unfinished()
    assert llm.generate([PROMPT], SHORT, use_tqdm=False) == reference
    assert_all_blocks_free(llm)
    print(f"\nodd arguments to LLM.generate: {counts}")
    assert counts["tried"] == 3 * len(ODD_ARGUMENTS) and counts["accepted"] > 0


# ---- concurrent misuse (issue 52) -----------------------------------------------------------------
ENGINE_KW = dict(num_kvcache_blocks=128, kvcache_block_size=16)
LONG = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)  # seconds on CPU: only ever cut short


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_second_task_reading_a_stream_gets_an_error_and_the_first_reads_on(tiny_qwen3):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    errors, read = [], {}
    with anyio.fail_after(120):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
            alone = await engine.generate(PROMPT, params)
            stream = engine.stream(PROMPT, params)

            async def reader(name: str) -> None:
                read[name] = 0
                try:
                    async for out in stream:
                        read[name] += len(out.token_ids)
                except RuntimeError as e:
                    errors.append(str(e))

            async with anyio.create_task_group() as tg:
                tg.start_soon(reader, "a")
                tg.start_soon(reader, "b")
            # whichever came second while the other waited was refused; the other read on to the end
            assert len(errors) == 1 and "already being read by another task" in errors[0], errors
            assert stream.finish_reason == "length" and stream.token_ids == alone.token_ids
            assert sum(read.values()) == len(alone.token_ids)
            await engine.wait_idle()
            assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


def test_llm_generate_from_two_threads_at_once_serves_both(tiny_qwen3):
    llm = LLM(tiny_qwen3, **ENGINE_KW)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batches = {"a": [[5, 6, 7], "Hello there"], "b": [[8, 9], "Another prompt", [10, 11, 12, 13]]}
    alone = {name: llm.generate(prompts, params, use_tqdm=False) for name, prompts in batches.items()}
    for _ in range(3):
        barrier, results, failures = threading.Barrier(2), {}, []

        def run(name: str) -> None:
            barrier.wait()
            try:
                results[name] = llm.generate(batches[name], params, use_tqdm=False)
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)

        # daemon threads: without the lock one of them spun forever, and must not keep pytest alive
        threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), "a generate() call never returned"
        assert not failures and results == alone
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_concurrent_starts_all_return_once_the_engine_serves(tiny_qwen3):
    engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW)
    results = []

    async def start_and_use() -> None:
        await engine.start()
        results.append(await engine.generate(PROMPT, SHORT))  # raised "not started" after the second start()

    with anyio.fail_after(120):
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(start_and_use)
        finally:
            await engine.shutdown()
    assert [r.finish_reason for r in results] == ["length"] * 3
    assert not engine._engine_thread.thread.is_alive()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_concurrent_starts_all_raise_the_start_failure(tiny_qwen3, monkeypatch):
    def failing_core(config, **kwargs):
        raise RuntimeError("no device for you")
    monkeypatch.setattr(engine_thread, "EngineCore", failing_core)
    engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW)
    errors = []

    async def start() -> None:
        try:
            await engine.start()
        except EngineDeadError as e:
            errors.append(e)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(start)
    assert len(errors) == 3 and all("failed to start" in str(e) and "no device" in str(e) for e in errors)
    with pytest.raises(EngineDeadError):
        engine.stream(PROMPT, SHORT)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("then", ["exit", "shutdown"])
async def test_a_cancelled_drain_still_stops_the_engine(tiny_qwen3, then):
    with anyio.fail_after(120):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
            stream = engine.stream(PROMPT, LONG)
            await stream.__anext__()
            with anyio.move_on_after(0.2) as drain:  # a timeout around a drain
                await engine.shutdown(drain=True)
            assert drain.cancelled_caught
            with pytest.raises(EngineDeadError):  # closed to new requests from the first shutdown() on
                engine.stream(PROMPT, SHORT)
            if then == "shutdown":
                await engine.shutdown()
                assert not engine._engine_thread.thread.is_alive()
        # leaving `async with` (or the shutdown() before it) stopped the thread; it stepped on forever before
        assert not engine._engine_thread.thread.is_alive()
        items = [out async for out in stream]
        assert items[-1].finish_reason == "abort" and len(stream.token_ids) < LONG.max_tokens


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_shutdown_cancelled_while_waiting_for_the_thread_can_be_finished_later(tiny_qwen3):
    release = threading.Event()
    # the thread's last act waits for release; set by a timer too, so that a wait that cannot be
    # cancelled (as shutdown's was) ends and the test fails rather than hangs
    timer = threading.Timer(30, release.set)
    timer.start()
    try:
        with anyio.fail_after(120):
            engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW)
            await engine.start()
            close_core = engine._engine_thread._close_core

            def slow_close_core() -> None:
                release.wait()
                close_core()
            engine._engine_thread._close_core = slow_close_core
            with anyio.move_on_after(0.5) as wait:
                await engine.shutdown()
            assert wait.cancelled_caught, "the wait for the engine thread could not be cancelled"
            assert engine._engine_thread.thread.is_alive()  # stopping: blocked in its last act
            release.set()
            await engine.shutdown()  # waits for it this time
            assert not engine._engine_thread.thread.is_alive()
    finally:
        timer.cancel()
