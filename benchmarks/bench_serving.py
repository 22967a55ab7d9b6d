"""Streaming under load through AsyncLLMEngine, measured by the consumer.

    python benchmarks/bench_serving.py [--concurrency 1,16,64,256] [--rates 20,80] [--plot PATH] [--json PATH]

Requests: --input-len random token ids, --output-len tokens each (EOS ignored), temperature 0.6,
after 32 short warm-up requests (so that no Triton JIT compile is timed). Closed loop: for each
concurrency C, max(2C, 16) requests with C always in flight. Open loop: --requests-per-rate
requests with Poisson arrivals at each rate (req/s). Per request, from the
consumer's side: TTFT (submission -> first non-empty chunk), ITL (every gap between chunks,
pooled over requests), TPOT ((E2E - TTFT) / (tokens - 1)) and E2E; p50 and p99 of each, and
output tokens per second of the whole level.
"""
from __future__ import annotations

import asyncio
import random
import time

from common import (Report, add_engine_args, checkpoint_from_args, engine_kwargs, jit_compiled_since, make_parser,
                    ms, parse_args, percentile, random_prompt, warmup_requests)

from asyncllm import AsyncLLMEngine, SamplingParams
from asyncllm.kernels import compiled_variants


async def one_request(engine: AsyncLLMEngine, prompt: list[int], params: SamplingParams) -> dict:
    start = time.perf_counter()
    first = last = None
    gaps, num_tokens = [], 0
    async for out in engine.stream(prompt, params):
        if not out.token_ids:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
        num_tokens += len(out.token_ids)
    e2e = time.perf_counter() - start
    ttft = first - start
    tpot = (e2e - ttft) / (num_tokens - 1) if num_tokens > 1 else None
    return dict(ttft=ttft, itl=gaps, tpot=tpot, e2e=e2e, tokens=num_tokens)


async def closed_loop(engine, prompts, params, concurrency: int) -> list[dict]:
    pending = iter(prompts)
    results = []

    async def client():
        for prompt in pending:  # shared iterator: each client takes the next request when it is free
            results.append(await one_request(engine, prompt, params))

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(client())
    return results


async def poisson(engine, prompts, params, rate: float, rng: random.Random) -> list[dict]:
    async with asyncio.TaskGroup() as group:
        tasks = []
        for prompt in prompts:
            tasks.append(group.create_task(one_request(engine, prompt, params)))
            await asyncio.sleep(rng.expovariate(rate))
    return [t.result() for t in tasks]


def summarize(results: list[dict], wall: float) -> dict:
    row = dict(num_requests=len(results), wall_s=wall,
               output_tok_s=sum(r["tokens"] for r in results) / wall)
    pooled = dict(ttft=[r["ttft"] for r in results], itl=[g for r in results for g in r["itl"]],
                  tpot=[r["tpot"] for r in results if r["tpot"] is not None], e2e=[r["e2e"] for r in results])
    for name, values in pooled.items():
        for q in (50, 99):
            row[f"{name}_p{q}_ms"] = ms(percentile(values, q))
    return row


def save_plot(rows: list[dict], path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    rows = [r for r in rows if r["load"] == "concurrency"]
    x = [r["level"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("ttft", "itl")):
        for q, style in ((50, "o-"), (99, "s--")):
            ax.plot(x, [r[f"{name}_p{q}_ms"] for r in rows], style, label=f"p{q}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("ms")
        ax.set_title(name.upper())
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


COLUMNS = [("load", "load"), ("level", "level", "{:g}"), ("requests", "num_requests"),
           ("TTFT p50", "ttft_p50_ms", "{:.1f}"), ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
           ("ITL p50", "itl_p50_ms", "{:.2f}"), ("ITL p99", "itl_p99_ms", "{:.2f}"),
           ("TPOT p50", "tpot_p50_ms", "{:.2f}"), ("TPOT p99", "tpot_p99_ms", "{:.2f}"),
           ("E2E p50", "e2e_p50_ms", "{:.0f}"), ("E2E p99", "e2e_p99_ms", "{:.0f}"),
           ("output tok/s", "output_tok_s", "{:,.0f}"), ("JIT compiles", "jit_compiles")]


async def run(args, model_dir: str, report: Report) -> None:
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len)
    levels = [("concurrency", c, max(2 * c, 16)) for c in args.concurrency]
    levels += [("poisson req/s", r, args.requests_per_rate) for r in args.rates]
    async with AsyncLLMEngine(model_dir, **engine_kwargs(args, args.backend)) as engine:
        warmup = warmup_requests(32, args.input_len, args.seed + 1)
        await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(*warmup)))
        for load, level, num in levels:
            prompts = [random_prompt(rng, args.input_len) for _ in range(num)]
            compiled_before = compiled_variants()
            start = time.perf_counter()
            if load == "concurrency":
                results = await closed_loop(engine, prompts, params, level)
            else:
                results = await poisson(engine, prompts, params, level, rng)
            row = dict(load=load, level=level, **summarize(results, time.perf_counter() - start),
                       jit_compiles=jit_compiled_since(compiled_before))
            report.add(row)
            print(f"{load} {level}: TTFT p50 {row['ttft_p50_ms']:.1f} ms, ITL p99 {row['itl_p99_ms'] or 0:.2f} ms, "
                  f"{row['output_tok_s']:,.0f} tok/s", flush=True)


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated closed-loop levels")
    parser.add_argument("--rates", default="20,80", help="comma-separated Poisson arrival rates, req/s ('' for none)")
    parser.add_argument("--requests-per-rate", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--plot", default=None, metavar="PATH", help="save TTFT/ITL vs concurrency here (PNG)")
    args = parse_args(parser, argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    report = Report("serving", args)
    with checkpoint_from_args(args) as model_dir:
        asyncio.run(run(args, model_dir, report))
    budget = f", max_num_batched_tokens {args.max_num_batched_tokens}" if args.max_num_batched_tokens else ""
    report.finish(f"Serving, {args.shape}, {args.backend}, {args.input_len} in / {args.output_len} out{budget} "
                  "(latencies in ms)", COLUMNS)
    if args.plot:
        problem = save_plot(report.data["results"], args.plot)
        print(problem or f"plot: {args.plot}")
    return report.data


if __name__ == "__main__":
    main()
