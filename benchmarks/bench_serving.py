"""Streaming under load through AsyncLLMEngine, measured by the consumer.

    python benchmarks/bench_serving.py [--concurrency 1,16,64,256] [--rates auto|20,50,70]
        [--target-step-ms default,none,12] [--offline] [--plot PATH] [--json PATH]

Requests: --input-len random token ids, --output-len tokens each (EOS ignored), temperature 0.6,
after 32 short warm-up requests (so that no Triton JIT compile is timed). Closed loop: for each
concurrency C, max(3C, 16) requests with C always in flight (64 clients: issue 17's 192 requests).
Open loop: --requests-per-rate requests with Poisson arrivals at each rate (req/s); "auto" takes
30 %, 70 % and 95 % of the request rate the highest closed-loop level sustained. Per request, from
the consumer's side: TTFT (submission -> first non-empty chunk), ITL (every gap between chunks,
pooled over requests), TPOT ((E2E - TTFT) / (tokens - 1)) and E2E; p50 and p99 of each, and
output tokens per second of the whole level.

Each --target-step-ms config runs every level in its own engine: "default" is AsyncLLMEngine's own
default (latency-bounded steps), "none" is throughput first (as LLM), a number is the target in ms.
--offline adds LLM.generate's throughput on the same requests for each config ("default" there is
LLM's default), to show the policy costs offline throughput nothing.
"""
from __future__ import annotations

import asyncio
import random
import time

from common import (Report, add_engine_args, checkpoint_from_args, engine_kwargs, jit_compiled_since, make_parser,
                    ms, parse_args, percentile, random_prompt, release_memory, stream_timings,
                    warmup_requests)

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.engine.step_budget import STREAMING_TARGET_STEP_MS
from asyncllm.kernels import compiled_variants


async def closed_loop(engine, prompts, params, concurrency: int) -> list[dict]:
    pending = iter(prompts)
    results = []

    async def client():
        for prompt in pending:  # shared iterator: each client takes the next request when it is free
            results.append(await stream_timings(engine, prompt, params))

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(client())
    return results


async def poisson(engine, prompts, params, rate: float, rng: random.Random) -> list[dict]:
    async with asyncio.TaskGroup() as group:
        tasks = []
        for prompt in prompts:
            tasks.append(group.create_task(stream_timings(engine, prompt, params)))
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
    """TTFT and ITL (p50, p99) against concurrency, and against the Poisson rate where there is one;
    a line per config."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    loads = [(load, xlabel) for load, xlabel in (("concurrency", "concurrent requests"),
                                                 ("poisson req/s", "Poisson arrivals, req/s"))
             if any(r["load"] == load for r in rows)]
    if not loads:
        return "no plot: no closed- or open-loop rows"
    configs = list(dict.fromkeys(r.get("config", "") for r in rows))
    fig, axes = plt.subplots(len(loads), 2, figsize=(10, 4 * len(loads)), squeeze=False)
    for (load, xlabel), ax_row in zip(loads, axes):
        for ax, name in zip(ax_row, ("ttft", "itl")):
            for config in configs:
                picked = [r for r in rows if r["load"] == load and r.get("config", "") == config]
                x = [r["level"] for r in picked]
                for q, style in ((50, "o-"), (99, "s--")):
                    ax.plot(x, [r[f"{name}_p{q}_ms"] for r in picked], style,
                            label=f"p{q} {config}" if len(configs) > 1 else f"p{q}")
            if load == "concurrency":
                ax.set_xscale("log", base=2)
                levels = sorted({r["level"] for r in rows if r["load"] == load})
                ax.set_xticks(levels, [str(v) for v in levels])
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("ms")
            ax.set_title(name.upper())
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


COLUMNS = [("config", "config"), ("load", "load"), ("level", "level", "{:g}"), ("requests", "num_requests"),
           ("TTFT p50", "ttft_p50_ms", "{:.1f}"), ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
           ("ITL p50", "itl_p50_ms", "{:.2f}"), ("ITL p99", "itl_p99_ms", "{:.2f}"),
           ("TPOT p50", "tpot_p50_ms", "{:.2f}"), ("TPOT p99", "tpot_p99_ms", "{:.2f}"),
           ("E2E p50", "e2e_p50_ms", "{:.0f}"), ("E2E p99", "e2e_p99_ms", "{:.0f}"),
           ("output tok/s", "output_tok_s", "{:,.0f}"), ("prefill budget", "prefill_budget"),
           ("step ms", "step_ms", "{:.2f}"), ("JIT compiles", "jit_compiles")]


def target_kwargs(target: str) -> dict:
    """Engine options for one --target-step-ms config: "default" passes nothing."""
    if target == "default":
        return {}
    return {"target_step_ms": None if target == "none" else float(target)}


def config_label(target: str, args, offline: bool = False) -> str:
    if target == "default":
        value = "none" if offline else f"{STREAMING_TARGET_STEP_MS:g}"
        label = f"target_step_ms={value} (default)"
    else:
        label = f"target_step_ms={target}"
    budget = args.max_num_batched_tokens or "16384 (default)"
    return f"{label}, max_num_batched_tokens={budget}"


async def run_config(args, model_dir: str, report: Report, target: str) -> None:
    rng = random.Random(args.seed)  # every config gets the same prompts
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len)
    label = config_label(target, args)
    async with AsyncLLMEngine(model_dir, **engine_kwargs(args, args.backend), **target_kwargs(target)) as engine:
        warmup = warmup_requests(32, args.input_len, args.seed + 1)
        await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(*warmup)))
        sustained = None  # req/s of the last closed-loop level
        for concurrency in args.concurrency:
            prompts = [random_prompt(rng, args.input_len) for _ in range(max(3 * concurrency, 16))]
            row = await run_level(engine, report, label, "concurrency", concurrency, prompts, params, rng)
            sustained = row["num_requests"] / row["wall_s"]
        rates = args.rates
        if rates == "auto":  # low, ~70 % and ~95 % of the highest sustainable rate (issue 17)
            rates = [round(f * sustained, 1) for f in (0.3, 0.7, 0.95)] if sustained else []
        for rate in rates:
            prompts = [random_prompt(rng, args.input_len) for _ in range(args.requests_per_rate)]
            await run_level(engine, report, label, "poisson req/s", rate, prompts, params, rng)


async def run_level(engine, report: Report, label: str, load: str, level, prompts, params, rng) -> dict:
    compiled_before = compiled_variants()
    start = time.perf_counter()
    if load == "concurrency":
        results = await closed_loop(engine, prompts, params, level)
    else:
        results = await poisson(engine, prompts, params, level, rng)
    stats = engine.stats()
    row = dict(config=label, load=load, level=level, **summarize(results, time.perf_counter() - start),
               prefill_budget=stats.get("prefill_budget"), step_ms=stats.get("step_ms"),
               jit_compiles=jit_compiled_since(compiled_before))
    report.add(row)
    print(f"{label}, {load} {level}: TTFT p50 {row['ttft_p50_ms']:.1f} ms, ITL p99 {row['itl_p99_ms'] or 0:.2f} ms, "
          f"{row['output_tok_s']:,.0f} tok/s", flush=True)
    return row


def run_offline(args, model_dir: str, report: Report, target: str) -> None:
    """LLM.generate on the 64-client closed loop's requests, all at once."""
    rng = random.Random(args.seed)
    prompts = [random_prompt(rng, args.input_len) for _ in range(max(3 * max(args.concurrency, default=64), 16))]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len)
    with LLM(model_dir, **engine_kwargs(args, args.backend), **target_kwargs(target)) as llm:
        llm.generate(*warmup_requests(32, args.input_len, args.seed + 1), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        stats = llm.core.stats()
    report.add(dict(config=config_label(target, args, offline=True), load="offline", level=len(prompts),
                    num_requests=len(prompts), wall_s=wall,
                    output_tok_s=sum(len(o["token_ids"]) for o in outputs) / wall,
                    prefill_budget=stats.get("prefill_budget"), step_ms=stats.get("step_ms")))
    print(f"offline {report.data['results'][-1]['config']}: {report.data['results'][-1]['output_tok_s']:,.0f} tok/s",
          flush=True)


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated closed-loop levels")
    parser.add_argument("--rates", default="auto",
                        help="comma-separated Poisson arrival rates, req/s; 'auto': 30/70/95 %% of the rate the "
                             "highest closed-loop level sustained ('' for none)")
    parser.add_argument("--requests-per-rate", type=int, default=192)
    parser.add_argument("--target-step-ms", default="default",
                        help="comma-separated configs, each run in its own engine: 'default' (AsyncLLMEngine's "
                             f"{STREAMING_TARGET_STEP_MS:g} ms), 'none' (throughput first), or a target in ms")
    parser.add_argument("--offline", action="store_true",
                        help="also LLM.generate's output tok/s on the same requests, per config")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--plot", default=None, metavar="PATH", help="save TTFT/ITL vs concurrency here (PNG)")
    args = parse_args(parser, argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.rates = "auto" if args.rates == "auto" else [float(r) for r in args.rates.split(",") if r]
    targets = [t.strip() for t in args.target_step_ms.split(",") if t.strip()]
    for target in targets:
        if target not in ("default", "none"):
            try:
                float(target)
            except ValueError:
                parser.error(f"--target-step-ms: {target!r} is not 'default', 'none' or a number")
    report = Report("serving", args)
    with checkpoint_from_args(args) as model_dir:
        for target in targets:
            asyncio.run(run_config(args, model_dir, report, target))
            release_memory()  # the next engine sizes its KV cache from the memory left
        if args.offline:
            for target in targets:
                run_offline(args, model_dir, report, target)
                release_memory()
    report.finish(f"Serving, {args.shape}, {args.backend}, {args.input_len} in / {args.output_len} out "
                  "(latencies in ms)", COLUMNS)
    if args.plot:
        problem = save_plot(report.data["results"], args.plot)
        print(problem or f"plot: {args.plot}")
    return report.data


if __name__ == "__main__":
    main()
