"""Soak: thousands of streaming requests through one AsyncLLMEngine on the tiny CPU model.

Mixed prompt lengths (strings, token ids, a shared prefix for prefix-cache hits), random sampling
settings and stop strings, 64 streams in flight over a small KV cache (so preemption happens), and
about 30% of the requests ended early by every cancellation route: cancelling the reading task's
cancel scope, `break`, `aclose()`, a timeout (anyio.move_on_after) and `engine.abort(request_id)`.

Afterwards: every block is free, the engine holds no request, every stream has a finish_reason,
every cancellation route really aborted requests inside the engine, and the process's RSS did not
keep growing (end vs. after the first 20% of the requests).

The default run is short (ASYNCLLM_SOAK_REQUESTS, default 200). The full run is marked slow:

    ASYNCLLM_SOAK_REPORT=soak.json pytest -m slow -s tests/test_soak.py

(ASYNCLLM_SOAK_FULL_REQUESTS overrides its 2,000 requests; the report file is optional.)
"""
from __future__ import annotations

import gc
import json
import os
import random
import time
from dataclasses import dataclass, field

import anyio
import pytest

from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

CI_REQUESTS = int(os.environ.get("ASYNCLLM_SOAK_REQUESTS", "200"))
FULL_REQUESTS = int(os.environ.get("ASYNCLLM_SOAK_FULL_REQUESTS", "2000"))
IN_FLIGHT = 64
# 96 blocks of 16 tokens: 64 streams of up to ~150 tokens do not all fit, so the scheduler preempts
ENGINE_KW = dict(num_kvcache_blocks=96, kvcache_block_size=16, max_num_seqs=IN_FLIGHT,
                 max_num_batched_tokens=512, max_model_len=512)
ROUTES = ["cancel_scope", "break", "aclose", "timeout", "engine_abort"]
CANCEL_FRACTION = 0.3
TEXTS = ["Hello, my name is", "The capital of France is", "你好，世界。今天的天气", "🌍🚀 emoji and text",
         "naïve café résumé", "def fibonacci(n):\n    return", "한국어 텍스트를 생성합니다", "Once upon a time, "]
SYSTEM = "You are a helpful assistant. Answer briefly and precisely, in plain words. "
FILTER_WINDOW = 200
STOPS = ["e", "the", ".", "\n", "，", "ing", "a b", "🚀"]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@dataclass
class Req:
    index: int
    request_id: str
    prompt: object
    params: SamplingParams
    route: str | None  # None: read to the end
    k: int  # cancel after this many items
    timeout: float
    items: list = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    token_ids: list = field(default_factory=list)
    cancelled: bool = False  # the consumer ended it early, before its last item


def make_request(rng: random.Random, index: int) -> Req:
    kind = rng.random()
    if kind < 0.4:
        prompt = rng.choice(TEXTS) * rng.randint(1, 4)
    elif kind < 0.6:
        prompt = SYSTEM + rng.choice(TEXTS)  # shared prefix: prefix-cache hits
    else:
        prompt = [rng.randrange(100, 150_000) for _ in range(rng.choice([1, 2, 5, 17, 40, 90, 150]))]
    # top-k / top-p / min-p make the sampler sort the whole batch's logits over the 152k vocabulary
    # (~25 ms a row here), so they come in windows of the request order: outside them a step only
    # pays for temperature sampling
    filtered = index % FILTER_WINDOW < FILTER_WINDOW * 3 // 10
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.2]), max_tokens=rng.randint(1, 24),
        top_k=rng.choice([-1, 1, 20, 200]) if filtered else -1,
        top_p=rng.choice([1.0, 0.9, 0.5]) if filtered else 1.0,
        min_p=rng.choice([0.0, 0.05, 0.3]) if filtered else 0.0,
        seed=rng.choice([None, None, rng.randrange(2**31)]),
        stop=rng.sample(STOPS, rng.choice([0, 0, 1, 2])), include_stop_str_in_output=rng.random() < 0.3,
        ignore_eos=rng.random() < 0.5)
    route = rng.choice(ROUTES) if rng.random() < CANCEL_FRACTION else None
    k = rng.randint(0, max(0, params.max_tokens // 2))
    return Req(index, f"soak-{index}", prompt, params, route, k, rng.uniform(0.01, 1.0))


async def run_one(engine: AsyncLLMEngine, req: Req) -> None:
    def take(out) -> None:
        assert req.finish_reason is None, "an item after the last one"
        assert out.request_id == req.request_id
        req.items.append(out.finish_reason)
        req.text += out.text
        req.token_ids += out.token_ids
        req.finish_reason = out.finish_reason

    route = req.route
    if route == "break":
        # no reference kept: leaving the loop drops the stream, which aborts the request at once
        async for out in engine.stream(req.prompt, req.params, request_id=req.request_id):
            take(out)
            if len(req.items) > req.k and out.finish_reason is None:
                req.cancelled = True
                break
        if req.cancelled:
            req.finish_reason = "abort"
        return
    stream = engine.stream(req.prompt, req.params, request_id=req.request_id)
    if route is None:
        async for out in stream:
            take(out)
    elif route == "cancel_scope":
        reached = anyio.Event()

        async def reader(scope: anyio.CancelScope) -> None:
            with scope:
                async for out in stream:
                    take(out)
                    if len(req.items) > req.k:
                        reached.set()
            reached.set()

        scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader, scope)
            await reached.wait()
            scope.cancel()
        req.cancelled = scope.cancelled_caught
    elif route == "aclose":
        async for out in stream:
            take(out)
            if len(req.items) > req.k:
                break
        await stream.aclose()
        req.cancelled = req.finish_reason is None
        assert [out async for out in stream] == []
    elif route == "timeout":
        with anyio.move_on_after(req.timeout) as scope:
            async for out in stream:
                take(out)
        req.cancelled = scope.cancelled_caught
    elif route == "engine_abort":
        async for out in stream:
            take(out)
            if len(req.items) == req.k + 1 and out.finish_reason is None:
                engine.abort(req.request_id)
    if req.cancelled:
        assert req.finish_reason is None and stream.finish_reason == "abort"
        req.finish_reason = "abort"
    else:
        assert stream.finish_reason == req.finish_reason is not None
        assert stream.token_ids == req.token_ids and stream.text == req.text


async def soak(model: str, num_requests: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    requests = [make_request(rng, i) for i in range(num_requests)]
    engine_finishes: list[tuple[str, str]] = []  # (request_id, reason) of every end the engine applied
    done = 0
    rss = {}
    rss_series: list[float] = []  # every 10% of the requests
    next_index = iter(range(num_requests))
    start = time.monotonic()
    async with AsyncLLMEngine(model, **ENGINE_KW) as engine:
        tokenizer = engine.tokenizer
        finish_request = engine._core.finish_request

        def recording_finish_request(request_id, reason="abort", index=None):
            seq = finish_request(request_id, reason, index)
            if seq is not None:
                engine_finishes.append((request_id, reason))
            return seq
        engine._core.finish_request = recording_finish_request  # the engine thread calls it
        max_seq_len = engine._core.max_seq_len
        rss["start"] = rss_mb()

        async def worker() -> None:
            nonlocal done
            for i in next_index:
                await run_one(engine, requests[i])
                done += 1
                if done % max(1, num_requests // 10) == 0:
                    rss_series.append(round(rss_mb(), 1))
                if done == num_requests // 5:
                    gc.collect()
                    rss["at_20pct"] = rss_mb()

        async with anyio.create_task_group() as tg:
            for _ in range(IN_FLIGHT):
                tg.start_soon(worker)
        await engine.wait_idle()
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        assert stats["num_running"] == stats["num_waiting"] == stats["num_inbox"] == 0
        assert engine._core.requests == {} and engine._engine_thread.channels == {}
        assert engine._core.scheduler.num_unfinished == 0
        assert all(b.ref_count == 0 for b in engine._core.block_manager.blocks)
        prompt_lens = {r.request_id: len(r.prompt) if isinstance(r.prompt, list) else
                       len(tokenizer.encode(r.prompt)) for r in requests}
    wall = time.monotonic() - start
    gc.collect()
    rss["end"] = rss_mb()

    # every request ended, and the way it ended is consistent with how it was read
    aborted_in_engine = {rid for rid, reason in engine_finishes if reason == "abort"}
    by_route: dict[str, int] = {}
    for r in requests:
        assert r.finish_reason in ("stop", "length", "abort"), (r.request_id, r.route, r.finish_reason)
        if r.items:
            assert all(reason is None for reason in r.items[:-1]), r.items
        if r.cancelled:
            by_route[r.route] = by_route.get(r.route, 0) + (r.request_id in aborted_in_engine)
            continue
        assert r.items and r.items[-1] == r.finish_reason
        assert len(r.token_ids) <= r.params.max_tokens
        if r.finish_reason == "abort":
            assert r.route == "engine_abort" and r.request_id in aborted_in_engine
            by_route["engine_abort"] = by_route.get("engine_abort", 0) + 1
        elif r.finish_reason == "length":
            assert len(r.token_ids) == r.params.max_tokens or \
                prompt_lens[r.request_id] + len(r.token_ids) >= max_seq_len, r
        if not r.params.include_stop_str_in_output:
            assert not any(s in r.text for s in r.params.stop), (r.text, r.params.stop)
        full_text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
        assert full_text == r.text if not r.params.stop else full_text.startswith(r.text), (r.text, full_text)
    if num_requests >= 100:
        # every route really aborted requests inside the engine (cancellation does not leak work)
        for route in ROUTES:
            assert by_route.get(route, 0) > 0, (route, by_route)
    cancelled = sum(1 for r in requests if r.finish_reason == "abort")
    report = {
        "requests": num_requests, "cancelled": cancelled,
        "cancelled_by_route": {route: sum(1 for r in requests if r.route == route and r.finish_reason == "abort")
                               for route in ROUTES},
        "finish_reasons": {reason: sum(1 for r in requests if r.finish_reason == reason)
                           for reason in ("stop", "length", "abort")},
        "completion_tokens": sum(len(r.token_ids) for r in requests),
        "wall_s": round(wall, 1), "steps": stats["num_steps"], "preemptions": stats["num_preemptions"],
        "prefix_cache_hit_rate": round(stats["prefix_cache_hit_rate"], 3),
        "blocks_free_end": f"{stats['num_free_blocks']}/{stats['num_total_blocks']}",
        "rss_mb": {key: round(value, 1) for key, value in rss.items()}, "rss_mb_every_10pct": rss_series,
    }
    return report


def check_memory(report: dict) -> None:
    rss = report["rss_mb"]
    base = rss.get("at_20pct", rss["start"])
    growth = rss["end"] - base
    assert growth < 100 or rss["end"] < 1.2 * base, f"RSS grew by {growth:.0f} MB: {rss}"


def emit(report: dict) -> None:
    print("\nSOAK " + json.dumps(report))
    path = os.environ.get("ASYNCLLM_SOAK_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


@pytest.mark.timeout(300)
async def test_soak_short(tiny_qwen3):
    with anyio.fail_after(240):
        report = await soak(tiny_qwen3, CI_REQUESTS, seed=1)
    emit(report)
    assert report["cancelled"] >= CI_REQUESTS // 10
    assert report["prefix_cache_hit_rate"] > 0  # the shared-prefix prompts hit the prefix cache
    check_memory(report)


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_soak_full(tiny_qwen3):
    with anyio.fail_after(1500):
        report = await soak(tiny_qwen3, FULL_REQUESTS, seed=2)
    emit(report)
    assert report["cancelled"] >= FULL_REQUESTS // 10
    check_memory(report)
