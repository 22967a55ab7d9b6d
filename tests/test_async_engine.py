"""AsyncLLMEngine on the tiny random-weight Qwen3 checkpoint (CPU), on asyncio and trio.

Every test body runs under anyio.fail_after, so a hang fails the test instead of stalling the suite;
nothing waits on a sleep except engine.wait_idle()'s own polling.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import threading

import anyio
import pytest

from asyncllm import startup
from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.engine_thread import AddRequest
from asyncllm.errors import EngineDeadError, QueueFullError
from asyncllm.llm import LLM
from asyncllm.outputs import FinishReason
from asyncllm.sampling_params import SamplingParams
from helpers import anyio_asyncio_and_trio, engine_threads  # noqa: F401 - a fixture: both event loops

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ENGINE_KW = dict(num_kvcache_blocks=256, kvcache_block_size=16)
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", [11, 22, 33, 44, 55, 66, 77], "日本語のテキスト 🌍"]
TIMEOUT = 60


# every test runs with steps one after another and overlapped (step N+1 launched before step N's
# tokens are read); on CPU overlap brings no speed, but its logic must hold all the same
@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlap"])
def make_engine(tiny_qwen3, request):
    def make(**overrides) -> AsyncLLMEngine:
        return AsyncLLMEngine(tiny_qwen3, **{**ENGINE_KW, "overlap_scheduling": request.param, **overrides})
    return make


@pytest.fixture(scope="module")
def sync_reference(tiny_qwen3):
    llm = LLM(tiny_qwen3, **ENGINE_KW)
    outputs = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    prompt_ids = [llm.core.encode_prompt(p) for p in PROMPTS]
    return outputs, prompt_ids


async def assert_idle(engine: AsyncLLMEngine) -> dict:
    await engine.wait_idle()
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return stats


def record_scheduled(monkeypatch, engine: AsyncLLMEngine) -> list:
    """Wrap the (running) engine's scheduler: a list of (request_id, num_tokens) per scheduled item."""
    scheduled = []
    schedule = engine._core.scheduler.schedule

    def recording_schedule():
        out = schedule()
        scheduled.extend((item.seq.request_id, item.num_tokens) for item in out.scheduled)
        return out
    monkeypatch.setattr(engine._core.scheduler, "schedule", recording_schedule)
    return scheduled


# ---- streamed output == the sync LLM's ---------------------------------------------------------
async def test_stream_and_generate_match_sync_llm(make_engine, sync_reference):
    reference, prompt_ids = sync_reference
    params = SamplingParams(**GREEDY)
    streamed, generated = {}, {}
    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            async def consume(i):
                stream = engine.stream(PROMPTS[i], params)
                items = [out async for out in stream]
                streamed[i] = (stream, items)

            async def generate(i):
                generated[i] = await engine.generate(PROMPTS[i], params)

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(consume, i)
                    tg.start_soon(generate, i)
            await assert_idle(engine)

    for i, ref in enumerate(reference):
        assert len(ref["token_ids"]) == 12 and ref["finish_reason"] == "length"
        stream, items = streamed[i]
        assert [out.token_ids for out in items if not out.token_ids] == []  # every item carries tokens
        assert [out.finish_reason for out in items] == [None] * (len(items) - 1) + ["length"]
        assert {out.request_id for out in items} == {stream.request_id}
        assert [t for out in items for t in out.token_ids] == ref["token_ids"] == stream.token_ids
        assert "".join(out.text for out in items) == ref["text"] == stream.text
        assert stream.prompt_token_ids == prompt_ids[i]

        result = generated[i]
        assert result.token_ids == ref["token_ids"]
        assert result.text == ref["text"]
        assert result.finish_reason == "length"
        assert result.prompt_token_ids == prompt_ids[i]
        m = result.metrics
        assert m.time_to_first_token > 0
        assert m.queue_time is not None and 0 <= m.queue_time <= m.time_to_first_token
        assert m.num_prompt_tokens == len(prompt_ids[i])
        assert m.num_completion_tokens == 12
        assert 1 <= len(m.inter_token_latencies) <= 11
        assert all(gap >= 0 for gap in m.inter_token_latencies)
        assert m.e2e_latency >= m.time_to_first_token
    assert len({result.request_id for result in generated.values()}
               | {s.request_id for s, _ in streamed.values()}) == 2 * len(PROMPTS)


async def test_generate_is_woken_once_a_stream_as_tokens_come(make_engine, monkeypatch):
    """generate() without stop strings wants only the whole answer, so its task is woken once, at
    the end, not on every step (hundreds of such wake-ups per step cost the event loop more than
    the engine's own work); a stream, or generate() with stop strings, is woken as tokens come."""
    from asyncllm import streams
    handed: dict[str, int] = {}
    put_quietly = streams.RequestChannel.put_quietly

    def counting(self, *args, **kwargs):
        waiter = put_quietly(self, *args, **kwargs)
        if waiter is not None:
            handed[self.request_id] = handed.get(self.request_id, 0) + 1
        return waiter

    monkeypatch.setattr(streams.RequestChannel, "put_quietly", counting)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results, items = {}, []
    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            async def generate(request_id, p):
                results[request_id] = await engine.generate(PROMPTS[0], p, request_id=request_id)

            async def stream():
                items.extend([out async for out in engine.stream(PROMPTS[1], params, request_id="streamed")])

            async with anyio.create_task_group() as tg:
                tg.start_soon(generate, "plain", params)
                tg.start_soon(generate, "with-stops",
                              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["never-seen"]))
                tg.start_soon(stream)
            await assert_idle(engine)
    assert len(results["plain"].token_ids) == 24 and results["plain"].finish_reason == "length"
    assert results["with-stops"].token_ids == results["plain"].token_ids
    assert results["plain"].text == results["with-stops"].text
    assert handed.get("plain", 0) <= 1
    assert handed["with-stops"] > 1 and handed["streamed"] > 1 and len(items) > 1


# ---- cancellation by every route ---------------------------------------------------------------
class Run:
    def __init__(self, request_id, route, max_tokens, k):
        self.request_id, self.route, self.max_tokens, self.k = request_id, route, max_tokens, k
        self.tokens: list[int] = []
        self.text = ""
        self.items = 0
        self.finish: str | None = None
        self.cancelled = False

    def take(self, out) -> None:
        assert self.finish is None, "an item after the last one"
        self.items += 1
        self.tokens += out.token_ids
        self.text += out.text
        self.finish = out.finish_reason


async def test_concurrent_streams_cancelled_by_every_route(make_engine, monkeypatch, anyio_backend):
    rng = random.Random(20240607)
    routes = ["full", "cancel_scope", "break", "aclose", "fail_after", "move_on_after", "engine_abort",
              "wait_for" if anyio_backend == "asyncio" else "move_on_after"]
    runs: list[Run] = []
    seqs = {}
    kept = []  # streams stay referenced: ending them must abort at once, not when they are collected

    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            add_request = engine._core.add_checked_request

            def recording_add_request(prompt_token_ids, params, request_id=None, submitted_at=None):
                seq = add_request(prompt_token_ids, params, request_id, submitted_at)
                seqs[request_id] = seq
                return seq
            monkeypatch.setattr(engine._core, "add_checked_request", recording_add_request)

            async def consume(stream, run, on_kth=None):
                async for out in stream:
                    run.take(out)
                    if run.items == run.k + 1 and on_kth is not None:
                        on_kth()

            async def one(run: Run, prompt: list[int], timeout: float):
                params = SamplingParams(temperature=0, max_tokens=run.max_tokens, ignore_eos=True)
                route = run.route
                if route == "break":
                    # no reference kept: leaving the loop drops the stream, which aborts it
                    async for out in engine.stream(prompt, params, request_id=run.request_id):
                        run.take(out)
                        if run.items == run.k + 1 and out.finish_reason is None:
                            run.cancelled = True
                            break
                    return
                stream = engine.stream(prompt, params, request_id=run.request_id)
                kept.append(stream)
                if route == "full":
                    await consume(stream, run)
                elif route == "engine_abort":
                    await consume(stream, run, lambda: engine.abort(run.request_id))
                elif route == "cancel_scope":
                    reached = anyio.Event()
                    scope = anyio.CancelScope()
                    async with anyio.create_task_group() as tg:
                        async def canceller():
                            await reached.wait()
                            scope.cancel()
                        tg.start_soon(canceller)
                        with scope:
                            await consume(stream, run, reached.set)
                        reached.set()
                    run.cancelled = scope.cancelled_caught
                elif route == "aclose":
                    async for out in stream:
                        run.take(out)
                        if run.items == run.k + 1:
                            break
                    await stream.aclose()
                    if run.finish is None:
                        run.cancelled = True
                        assert stream.finish_reason == "abort"
                        assert [out async for out in stream] == []
                elif route == "fail_after":
                    try:
                        with anyio.fail_after(timeout):
                            await consume(stream, run)
                    except TimeoutError:
                        run.cancelled = True
                elif route == "move_on_after":
                    with anyio.move_on_after(timeout) as scope:
                        await consume(stream, run)
                    run.cancelled = scope.cancelled_caught
                elif route == "wait_for":
                    try:
                        await asyncio.wait_for(consume(stream, run), timeout)
                    except (TimeoutError, asyncio.TimeoutError):
                        run.cancelled = True
                if run.cancelled:
                    assert run.finish is None and stream.finish_reason == "abort"
                else:
                    assert stream.finish_reason == run.finish

            async with anyio.create_task_group() as tg:
                for i in range(64):
                    max_tokens = rng.randint(5, 40)
                    run = Run(f"r{i}", routes[i % len(routes)], max_tokens, k=rng.randint(0, max_tokens // 2))
                    prompt = [rng.randrange(100, 150000) for _ in range(rng.randint(3, 24))]
                    runs.append(run)
                    tg.start_soon(one, run, prompt, rng.uniform(0.02, 0.6))

            stats = await assert_idle(engine)
            assert stats["num_inbox"] == 0
            assert engine._core.requests == {} and engine._engine_thread.channels == {}

    assert len(seqs) == 64 and all(seq.is_finished for seq in seqs.values())
    aborted_by_route = {}
    for run in runs:
        seq = seqs[run.request_id]
        if run.cancelled:
            # ended early by the consumer: the engine aborted it (or it had just finished anyway)
            assert run.finish is None
            assert seq.finish_reason in ("abort", "length")
            if seq.finish_reason == "length":
                assert seq.num_completion_tokens == run.max_tokens
            aborted_by_route.setdefault(run.route, []).append(seq.finish_reason == "abort")
            continue
        allowed = {"abort", "length"} if run.route == "engine_abort" else {"stop", "length"}
        assert run.finish in allowed, (run.route, run.finish)
        assert run.finish == seq.finish_reason
        assert (run.finish == "length") == (len(run.tokens) == run.max_tokens)
        assert run.tokens == seq.completion_token_ids[:len(run.tokens)]
        if run.route == "engine_abort" and run.finish == "abort":
            aborted_by_route.setdefault(run.route, []).append(True)
    # each route really ended some requests early in the engine (else cancellation leaks work)
    for route in ("cancel_scope", "break", "aclose", "engine_abort"):
        assert any(aborted_by_route.get(route, [])), (route, aborted_by_route)
    timeout_routes = [r for r in routes if r in ("fail_after", "move_on_after", "wait_for")]
    assert any(a for r in timeout_routes for a in aborted_by_route.get(r, [])), aborted_by_route


# ---- cancelled while queued: never prefilled -----------------------------------------------------
async def test_request_cancelled_while_queued_is_never_scheduled(make_engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with anyio.fail_after(TIMEOUT):
        async with make_engine(max_num_seqs=1) as engine:
            scheduled = record_scheduled(monkeypatch, engine)
            a = engine.stream([1, 2, 3, 4], params, request_id="A")
            a_items = [await a.__anext__()]  # A is running; with max_num_seqs=1 all else queues behind it
            b = engine.stream([5, 6, 7, 8], params, request_id="B")
            engine.stream([9, 10, 11], params, request_id="dropped")  # never referenced: dropped at once
            c = engine.stream([12, 13, 14], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                              request_id="C")
            async for out in a:  # driven by A's tokens: wait until B and C sit in the scheduler's queue
                a_items.append(out)
                assert out.finish_reason is None, "A ended before B was queued"
                if engine.stats()["num_waiting"] >= 2:
                    break
            await b.aclose()
            async for out in a:
                a_items.append(out)
            c_items = [out async for out in c]
            assert [out async for out in b] == [] and b.finish_reason == "abort"

            assert a.finish_reason == "length" and len(a.token_ids) == 40
            assert c.finish_reason == "length" and len(c.token_ids) == 2 and c_items[-1].finish_reason == "length"
            ids = {request_id for request_id, _ in scheduled}
            assert {"A", "C"} <= ids
            assert "B" not in ids and "dropped" not in ids

            # aborting unknown and finished requests is a no-op; the engine still serves
            engine.abort("no-such-request")
            engine.abort("A")
            engine.abort("B")
            result = await engine.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            assert result.finish_reason == "length" and len(result.token_ids) == 3
            # a finished request's id can be used again
            again = await engine.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                          request_id="A")
            assert again.token_ids == result.token_ids and again.finish_reason == "length"

            # a request_id in use is refused (on its stream) without touching the request that has it
            original = engine.stream([1, 2, 3], params, request_id="dup")
            await original.__anext__()
            await engine.stream([4, 5, 6], params, request_id="dup").aclose()  # must not end the original
            duplicate = engine.stream([4, 5, 6], params, request_id="dup")
            with pytest.raises(ValueError, match="already in use"):
                await duplicate.__anext__()
            del duplicate  # dropping it must not end the original either
            async for _ in original:
                pass
            assert original.finish_reason == "length" and len(original.token_ids) == 40
            await assert_idle(engine)


# ---- dynamic admission: a late short request overtakes a long one; no stall during its prefill ----
async def test_late_short_request_finishes_first_and_long_stream_keeps_flowing(make_engine, monkeypatch):
    rng = random.Random(7)
    long_prompt_ids = [rng.randrange(100, 150000) for _ in range(600)]
    with anyio.fail_after(TIMEOUT):
        async with make_engine(max_num_batched_tokens=64) as engine:
            scheduled = record_scheduled(monkeypatch, engine)
            long = engine.stream([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                                 request_id="long")
            long_times: list[float] = []
            long_started = anyio.Event()
            seen = {}

            async def read_long():
                async for out in long:
                    if out.token_ids:
                        long_times.append(anyio.current_time())
                    if len(long.token_ids) >= 3:
                        long_started.set()
                seen["long_finish"] = long.finish_reason

            async def run_short():
                await long_started.wait()
                seen["items_at_submit"] = len(long_times)
                t_submit = anyio.current_time()
                short = engine.stream(long_prompt_ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                      request_id="short")
                async for out in short:
                    if out.token_ids and "items_at_first" not in seen:
                        seen["items_at_first"] = len(long_times)
                        seen["t_first"] = anyio.current_time()
                seen["t_submit"] = t_submit
                seen["short"] = (short.finish_reason, len(short.token_ids))
                seen["long_at_short_end"] = (long.finish_reason, len(long.token_ids))
                await long.aclose()  # from another task, while read_long waits on it

            async with anyio.create_task_group() as tg:
                tg.start_soon(read_long)
                tg.start_soon(run_short)
            await assert_idle(engine)

    assert seen["short"] == ("length", 3)
    long_finish, long_count = seen["long_at_short_end"]
    assert long_finish is None and long_count < 300  # the short one finished while the long one decoded
    assert seen["long_finish"] == "abort"
    # the 600-token prompt was prefilled in chunks, interleaved with the long request's decodes
    short_chunks = [n for rid, n in scheduled if rid == "short" and n > 1]
    assert len(short_chunks) >= 9 and max(short_chunks) <= 63
    assert seen["items_at_first"] - seen["items_at_submit"] >= 2
    during = [t for t in long_times if seen["t_submit"] <= t <= seen["t_first"]]
    assert len(during) >= 2


# ---- multibyte text through the engine ---------------------------------------------------------
async def test_streamed_text_deltas_are_whole_characters(make_engine):
    prompts = ["你好，世界", "🌍🚀 emoji", "naïve café", "한국어 텍스트"]
    streams = {}
    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            tokenizer = engine.tokenizer

            async def consume(i):
                stream = engine.stream(prompts[i], SamplingParams(temperature=1.0, seed=i, max_tokens=20))
                streams[i] = (stream, [out.text async for out in stream])

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(consume, i)
            await assert_idle(engine)

    non_ascii = 0
    for stream, deltas in streams.values():
        final = tokenizer.decode(stream.token_ids, skip_special_tokens=True)
        assert "".join(deltas) == final == stream.text
        if "\ufffd" not in final:
            assert not any("\ufffd" in d for d in deltas)
        non_ascii += sum(ord(ch) > 127 for ch in final)
    assert non_ascii > 10  # the random model's output really is multibyte text


# ---- stop strings through the engine -----------------------------------------------------------
async def test_stop_string_ends_the_stream_and_frees_blocks(make_engine):
    prompt = "Hello, my name is"
    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            reference = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            text = reference.text
            assert len(text) >= 12 and "\ufffd" not in text
            stop = text[5:12]
            index = text.find(stop)
            results = {}

            async def consume(include):
                stream = engine.stream(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                              include_stop_str_in_output=include))
                items = [out async for out in stream]
                results[include] = (stream, items)

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, False)
                tg.start_soon(consume, True)
            await assert_idle(engine)

    for include, expected in ((False, text[:index]), (True, text[:index + len(stop)])):
        stream, items = results[include]
        assert items[-1].finish_reason == "stop" and stream.finish_reason == "stop"
        assert all(out.finish_reason is None for out in items[:-1])
        assert "".join(out.text for out in items) == expected == stream.text
        # the engine ended the request once the stop string showed up, long before max_tokens
        assert stream.metrics.num_completion_tokens < 40


async def test_finish_reasons_are_typed_and_read_as_plain_strings(make_engine, sync_reference):
    """Every finish reason the engine hands out is a FinishReason, which users, JSON and f-strings
    read as its plain value: "stop" (a stop string, a stop token), "length" and "abort"."""
    prompt = "Hello, my name is"
    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            length = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            by_string = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                                     stop=[length.text[5:12]]))
            by_token = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                                    stop_token_ids=[length.token_ids[3]]))
            stream = engine.stream(prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            await stream.__anext__()
            await stream.aclose()
            engine.abort("nobody")  # an unknown id: a no-op
            await assert_idle(engine)
    outputs, _ = sync_reference
    reasons = {"length": [length.finish_reason, outputs[0]["finish_reason"]],
               "stop": [by_string.finish_reason, by_token.finish_reason], "abort": [stream.finish_reason]}
    for value, found in reasons.items():
        for reason in found:
            assert isinstance(reason, FinishReason) and reason is FinishReason(value)
            assert reason == value and hash(reason) == hash(value) and {value: 1}[reason] == 1
            assert (str(reason), f"{reason}", "%s" % reason, json.dumps({"r": reason})) == \
                (value, value, value, json.dumps({"r": value}))


async def test_a_reader_that_falls_behind_gets_no_tokens_past_a_stop_string(make_engine):
    """A consumer that reads late gets several steps' tokens in one item; where a stop string ends in
    one of them, the tokens after it (generated before the stop was seen) are not output: not in the
    item, the result's token_ids, its logprobs or the completion count, as for a prompt reader."""
    prompt = "Hello, my name is"
    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            reference = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            tokenizer = engine.tokenizer
            text, ids = reference.text, reference.token_ids
            # a stop string that first shows up with token number keep, mid-answer: the output keeps
            # the tokens up to that one
            keep, stop = next((k, tokenizer.decode(ids[:k])[-3:]) for k in range(6, 16)
                              if tokenizer.decode(ids[:k])[-3:].strip() and "\ufffd" not in tokenizer.decode(ids[:k])
                              and tokenizer.decode(ids[:k])[-3:] not in tokenizer.decode(ids[:k - 1]))
            stream = engine.stream(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                          logprobs=1))
            await assert_idle(engine)  # nobody read: the engine ran to max_tokens
            items = [out async for out in stream]
    token_ids = [t for out in items for t in out.token_ids]
    assert token_ids == ids[:keep]
    assert sum(len(out.logprobs) for out in items) == keep
    assert stream.num_completion_tokens == keep and len(stream.result(0, "").token_ids) == keep
    assert items[-1].finish_reason == "stop" and "".join(out.text for out in items) == text[:text.find(stop)]


@pytest.mark.parametrize("n, reason, index", [(1, "abort", None), (3, "stop", 1)], ids=["abort", "n3-stop"])
async def test_a_finish_after_the_core_ended_the_request_keeps_its_last_tokens(make_engine, monkeypatch, n, reason,
                                                                               index):
    """With overlap a step's events go out after the next launch, and the commands that came in are
    applied before it: an abort, or a stop string a consumer found in one of n sequences, can reach
    the engine after the core ended the whole request in the step resolved last. The events not yet
    delivered end the stream, with every token and the request's own finish reasons (the channel
    was dropped with them: the last tokens were lost, and an n > 1 stream waited forever)."""
    params = SamplingParams(temperature=0.8, seed=3, n=n, max_tokens=6, ignore_eos=True)
    with anyio.fail_after(TIMEOUT):
        async with make_engine() as engine:
            core = engine._core
            resolve, posted = core.resolve_step, []

            def resolve_then_finish():
                events = resolve()
                for event in events:
                    request_id = event.seq.request_id
                    if event.request_finished and request_id == "late-finish" and not posted:
                        # what a consumer or engine.abort() posts from another thread, at the worst moment
                        engine._finish(request_id, reason, engine._engine_thread.channels[request_id], index)
                        posted.append(request_id)
                return events
            monkeypatch.setattr(core, "resolve_step", resolve_then_finish)
            stream = engine.stream([5, 6, 7, 8], params, request_id="late-finish")
            items = [out async for out in stream]
            assert posted
            await assert_idle(engine)
    for i in range(n):
        ends = [out.finish_reason for out in items if out.index == i and out.finish_reason is not None]
        assert ends == ["length"]
        assert sum(len(out.token_ids) for out in items if out.index == i) == 6
    assert stream.finish_reason == "length"


# ---- engine failure ------------------------------------------------------------------------------
async def test_engine_failure_reaches_every_consumer(make_engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    errors = {}
    with anyio.fail_after(TIMEOUT):
        async with make_engine(max_num_seqs=2) as engine:
            armed, entered, release = threading.Event(), threading.Event(), threading.Event()
            launch = engine._core.runner.launch

            def failing_launch(plan, prev, **kwargs):
                if armed.is_set():
                    entered.set()
                    release.wait(TIMEOUT)
                    raise RuntimeError("boom: the device fell over")
                return launch(plan, prev, **kwargs)
            monkeypatch.setattr(engine._core.runner, "launch", failing_launch)

            async def consume(name, stream, first=None):
                try:
                    async for _ in stream:
                        if first is not None:
                            first.set()
                    errors[name] = None
                except EngineDeadError as e:
                    errors[name] = e

            async with anyio.create_task_group() as tg:
                firsts = [anyio.Event(), anyio.Event()]
                # two decoding (max_num_seqs=2), two queued in the scheduler
                for i in range(4):
                    tg.start_soon(consume, f"s{i}", engine.stream([i + 1] * 5, params), firsts[i] if i < 2 else None)
                for first in firsts:
                    await first.wait()
                armed.set()
                await anyio.to_thread.run_sync(entered.wait, TIMEOUT)
                assert entered.is_set()
                # submitted while the failing step runs: still in the engine's inbox when it dies
                tg.start_soon(consume, "late", engine.stream([7, 7, 7], params))
                release.set()

            assert sorted(errors) == ["late", "s0", "s1", "s2", "s3"]
            for name, error in errors.items():
                assert isinstance(error, EngineDeadError), name
                assert isinstance(error.__cause__, RuntimeError)
            with pytest.raises(EngineDeadError):
                engine.stream([1, 2, 3], params)
            with pytest.raises(EngineDeadError):
                await engine.wait_idle()
            # a request that slipped in between the caller's liveness check and the post
            stream = engine._submit([1, 2, 3], params, None)
            with pytest.raises(EngineDeadError):
                await stream.__anext__()
        # shutdown completed
        assert engine_threads() == []


# ---- invalid input, bounded queue ----------------------------------------------------------------
async def test_invalid_input_raises_before_queueing_and_queue_is_bounded(make_engine, monkeypatch):
    with anyio.fail_after(TIMEOUT):
        async with make_engine(max_num_seqs=1, max_queued_requests=2, max_model_len=256) as engine:
            posted = []
            post = engine._engine_thread.post

            def recording_post(command):
                posted.append(command)
                post(command)
            monkeypatch.setattr(engine._engine_thread, "post", recording_post)
            vocab = engine.config.hf_config.vocab_size
            ok = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            bad_prompts = [("", ValueError), ([], ValueError), ((), ValueError), ({"a": 1}, TypeError),
                           ([1.5], TypeError), ([1, "2"], TypeError), ([True], TypeError), (None, TypeError),
                           (b"bytes", TypeError), ([-1], ValueError), ([vocab], ValueError),
                           ([1] * 256, ValueError)]
            for prompt, error in bad_prompts:
                with pytest.raises(error):
                    engine.stream(prompt, ok)
            for params, error in (({"temperature": 0}, TypeError), ("greedy", TypeError), (0.5, TypeError)):
                with pytest.raises(error):
                    engine.stream([1, 2, 3], params)
            for request_id, error in (("", ValueError), (7, TypeError)):
                with pytest.raises(error, match="request_id"):
                    engine.stream([1, 2, 3], ok, request_id=request_id)
            with pytest.raises(ValueError):
                SamplingParams(temperature=-1.0)
            assert posted == []
            assert engine.stats()["num_steps"] == 0

            # the engine still serves; wait_idle waits for a request submitted just before it
            stream = engine.stream([1] * 255, ok)  # the longest prompt that fits max_model_len
            await engine.wait_idle()
            assert engine.stats()["num_steps"] >= 1
            items = [out async for out in stream]
            assert items[-1].finish_reason == "length" and len(stream.token_ids) == 1  # hit max_model_len
            result = await engine.generate([1, 2, 3], ok)
            assert result.finish_reason == "length" and len(result.token_ids) == 3

            # bounded queue: submissions without yielding to the event loop hit the limit
            before = len(posted)
            streams = []
            with pytest.raises(QueueFullError):
                for _ in range(50):
                    streams.append(engine.stream([4, 5, 6], SamplingParams(temperature=0, max_tokens=30,
                                                                           ignore_eos=True)))
            assert len(streams) >= 2
            # the refused one was not queued
            assert len(posted) - before == len(streams) and all(isinstance(c, AddRequest) for c in posted[before:])
            for s in streams:
                await s.aclose()
            await assert_idle(engine)
            result = await engine.generate([4, 5, 6], ok)
            assert result.finish_reason == "length"
            await assert_idle(engine)


# ---- lifecycle -------------------------------------------------------------------------------------
async def test_start_up_phases_are_timed_in_order_and_logged(make_engine, tiny_qwen3, caplog):
    caplog.set_level(logging.DEBUG, logger="asyncllm")
    with anyio.fail_after(TIMEOUT):
        engine = make_engine()
        assert list(engine.startup_timings) == [startup.CONFIG]  # made in the constructor; the rest at start()
        async with engine:
            async_timings = engine.startup_timings
    with LLM(tiny_qwen3, **ENGINE_KW) as llm:
        llm_timings = llm.startup_timings
    on_cpu = {startup.CONFIG, startup.HEAP_FREEZE, startup.TOKENIZER, startup.BUILD_MODEL, startup.LOAD_WEIGHTS,
              startup.SAMPLER, startup.MEMORY_PROBE, startup.KV_CACHE, startup.ATTENTION_BACKEND,
              startup.BLOCK_MANAGER, startup.STEP_BUDGET, startup.SCHEDULER, startup.REQUEST_INTAKE}
    for timings in (async_timings, llm_timings):
        assert list(timings) == [phase for phase in startup.STARTUP_PHASES if phase in timings]  # in order
        assert set(timings) == on_cpu  # one rank, no CUDA: no workers, graphs, tuning or calibration
        assert all(seconds >= 0 for seconds in timings.values())
    logged = [(record.startup_phase, record.startup_s) for record in caplog.records
              if hasattr(record, "startup_phase")]
    assert logged == [*async_timings.items(), *llm_timings.items()]
    assert all(record.getMessage().startswith(
        f"start-up: {startup.PHASE_ACTIONS.get(record.startup_phase, record.startup_phase)}: ")
        for record in caplog.records if hasattr(record, "startup_phase"))


def test_a_start_up_phase_out_of_order_or_unknown_is_refused():
    timings = startup.StartupTimings()
    with timings.phase(startup.TOKENIZER):
        pass
    with pytest.raises(RuntimeError, match="'config' runs after 'tokenizer'"):
        with timings.phase(startup.CONFIG):
            pass
    with pytest.raises(ValueError, match="not in STARTUP_PHASES"):
        with timings.phase("warm-up"):
            pass
    with pytest.raises(ZeroDivisionError):  # a phase that fails is not recorded
        with timings.phase(startup.BUILD_MODEL):
            1 / 0
    assert list(timings.seconds) == [startup.TOKENIZER]


async def test_drain_shutdown_and_chat(make_engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = {}
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg, make_engine() as engine:
            tokenizer = engine.tokenizer
            messages = [{"role": "user", "content": "Hi"}]
            for bad in ([], (), "Hi", None, ["Hi"], [{"role": "user"}], [{"content": "Hi"}],
                        [{"role": "", "content": "Hi"}], [{"role": "user", "content": 5}],
                        [{"role": "user", "content": "Hi"}, "oops"]):
                with pytest.raises((ValueError, TypeError)):
                    engine.chat(bad, params)

            chat = engine.chat(messages, params, enable_thinking=False)
            expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                     enable_thinking=False)
            assert chat.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
            assert tokenizer.decode(chat.prompt_token_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
            plain = engine.chat(messages, params)
            assert tokenizer.decode(plain.prompt_token_ids).endswith("<|im_start|>assistant\n")
            assert "<think>" not in tokenizer.decode(plain.prompt_token_ids)

            async def consume(name, stream, first):
                async for out in stream:
                    first.set()
                results[name] = (stream.finish_reason, len(stream.token_ids), stream.text)

            streams = {"chat": chat, "plain": plain, "a": engine.stream("Once upon a time", params),
                       "b": engine.stream([5, 6, 7], params)}
            firsts = []
            for name, stream in streams.items():
                firsts.append(anyio.Event())
                tg.start_soon(consume, name, stream, firsts[-1])
            for first in firsts:
                await first.wait()
            await engine.shutdown(drain=True)  # in-flight requests finish normally
            assert engine_threads() == []
            with pytest.raises(EngineDeadError):
                engine.stream([1, 2, 3], params)
            await engine.shutdown()  # idempotent
    assert sorted(results) == ["a", "b", "chat", "plain"]
    for name, (finish, count, text) in results.items():
        assert (finish, count) == ("length", 8), name
        assert isinstance(text, str) and text


async def test_exit_aborts_in_flight_streams(make_engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    results = {}
    with anyio.fail_after(TIMEOUT):
        async def consume(name, stream, first):
            async for out in stream:
                first.set()
            results[name] = (stream.finish_reason, len(stream.token_ids))

        async with anyio.create_task_group() as tg:
            async with make_engine() as engine:
                firsts = [anyio.Event() for _ in range(3)]
                for i, first in enumerate(firsts):
                    tg.start_soon(consume, f"s{i}", engine.stream([i + 1] * 4, params), first)
                unread = engine.stream([9, 8, 7], params)  # nobody reads it until the engine is gone
                for first in firsts:
                    await first.wait()
            assert engine_threads() == []
            unread_items = [out async for out in unread]
        assert unread_items[-1].finish_reason == "abort" and unread.finish_reason == "abort"
        assert len(unread.token_ids) < 200
    assert sorted(results) == ["s0", "s1", "s2"]
    for finish, count in results.values():
        assert finish == "abort" and count < 200
    with pytest.raises(EngineDeadError):
        engine.stream([1, 2, 3], params)
