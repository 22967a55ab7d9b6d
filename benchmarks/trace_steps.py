"""A per-step trace of bench_serving's closed loop: what the scheduler saw and did at every step.

    python benchmarks/trace_steps.py [--target-step-ms default|none|MS] [--concurrency 64]
                                     [--requests 192] [--input-len 1024] [--output-len 128] [--json PATH]

Each step's row: time since the loop began (ms, when the step was scheduled), decodes, prefill
tokens, prompts waiting and being prefilled (before the step was scheduled), the prefill budget, and the step-time model's
a / b / c and last measured step. Per request: its start and time to first token. The printout
shows every tenth step and the TTFT of every fourth request; the JSON holds all of it. This is
how the closed loop's waves were found (docs/BENCHMARKS_ARCHIVE.md, run G): a tool for tuning the step
budget (engine/step_budget.py), not a benchmark.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

from common import (add_engine_args, checkpoint_from_args, engine_kwargs, make_parser, parse_args, percentile,
                    random_prompt, warmup_requests)

from asyncllm import AsyncLLMEngine, SamplingParams


async def trace(model_dir: str, kwargs: dict, args) -> dict:
    steps, requests = [], []
    async with AsyncLLMEngine(model_dir, **kwargs) as engine:
        warmup = warmup_requests(32, args.input_len, args.seed + 1)
        await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(*warmup)))
        await engine.wait_idle()
        core = engine._core  # the engine thread's core: read, never changed, from its own thread
        scheduler, schedule = core.scheduler, core.scheduler.schedule
        start = time.perf_counter()

        def traced_schedule():
            num_waiting = len(scheduler.waiting)
            num_prefilling = sum(1 for s in scheduler.running if s.num_uncomputed_tokens > 1)
            out = schedule()
            model, budget = core.step_model, core.step_budget
            steps.append(dict(t_ms=(time.perf_counter() - start) * 1e3, decodes=out.num_decodes,
                              prefill=out.num_batched_tokens - out.num_decodes, waiting=num_waiting,
                              prefilling=num_prefilling,
                              budget=budget.last_budget if budget is not None else None,
                              a=model.a, b=model.b, c=model.c, last_step_ms=model.last_step_ms))
            return out
        scheduler.schedule = traced_schedule
        rng = random.Random(args.seed)
        prompts = iter([random_prompt(rng, args.input_len) for _ in range(args.requests)])
        params = SamplingParams(temperature=0.6, max_tokens=args.output_len, ignore_eos=True)

        async def client():
            for prompt in prompts:
                begun, first = time.perf_counter(), None
                async for out in engine.stream(prompt, params):
                    if out.token_ids and first is None:
                        first = time.perf_counter()
                requests.append(dict(start_ms=(begun - start) * 1e3, ttft_ms=(first - begun) * 1e3))
        async with asyncio.TaskGroup() as group:
            for _ in range(args.concurrency):
                group.create_task(client())
        scheduler.schedule = schedule
    return dict(steps=steps, requests=requests)


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--target-step-ms", default="default", help="default (AsyncLLMEngine's), none, or ms")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    args = parse_args(parser, argv)
    with checkpoint_from_args(args) as model_dir:
        result = asyncio.run(trace(model_dir, engine_kwargs(args, args.backend), args))
    for i, step in enumerate(result["steps"]):
        if i % 10 == 0:
            print(f"step {i:4d} t={step['t_ms']:8.1f} ms  decodes={step['decodes']:3d} prefill={step['prefill']:5d} "
                  f"waiting={step['waiting']:3d} prefilling={step['prefilling']:2d} budget={step['budget']} "
                  f"last step={step['last_step_ms'] or 0:.2f} ms")
    requests = sorted(result["requests"], key=lambda r: r["start_ms"])
    print("start:TTFT (ms) of every 4th request:", " ".join(f"{r['start_ms']:.0f}:{r['ttft_ms']:.0f}"
                                                         for r in requests[::4]))
    print(f"TTFT p50 {percentile([r['ttft_ms'] for r in requests], 50):.1f} ms over {len(requests)} requests, "
          f"{len(result['steps'])} steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
