"""Offline throughput on nano-vllm's bench.py workload (random weights, random token ids).

    python benchmarks/bench_throughput.py [--backends triton,fa4] [--mode sync|async|both] [--json PATH]

256 requests, prompts of 100..1024 random tokens, 100..1024 output tokens each (EOS ignored),
temperature 0.6. nano-vllm's one short warm-up request, plus --warmup-requests short ones of
assorted sizes (so that no Triton JIT compile is timed; the "JIT compiles" column checks that),
then the whole batch is timed; throughput is sum(max_tokens) / wall time, as nano-vllm reports
it. sync: one LLM.generate call. async: all requests submitted at once to an AsyncLLMEngine, each
consumed with engine.generate in a task group.
"""
from __future__ import annotations

import asyncio
import time

from common import (Report, add_engine_args, bench_requests, checkpoint_from_args, engine_kwargs, jit_compiled_since,
                    make_parser, parse_args, release_memory, synchronize, timed, warmup_requests)

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.kernels import compiled_variants

WARMUP_PROMPT = "Benchmark: "  # nano-vllm's warm-up request


def run_sync(model_dir: str, kwargs: dict, prompts, params, warmup, device: str) -> dict:
    llm = LLM(model_dir, **kwargs)
    llm.generate([WARMUP_PROMPT], SamplingParams(), use_tqdm=False)
    if warmup[0]:
        llm.generate(*warmup, use_tqdm=False)
    before, compiled_before = llm.core.stats(), compiled_variants()
    outputs, elapsed = timed(lambda: llm.generate(prompts, params, use_tqdm=False), device)
    after = llm.core.stats()
    compiled = jit_compiled_since(compiled_before)
    llm = None  # noqa: F841 - freed before the next engine starts
    release_memory()
    return dict(elapsed_s=elapsed, generated_tokens=sum(len(o["token_ids"]) for o in outputs),
                num_preemptions=after["num_preemptions"] - before["num_preemptions"],
                num_steps=after["num_steps"] - before["num_steps"], jit_compiles=compiled)


async def _run_async(model_dir: str, kwargs: dict, prompts, params, warmup, device: str) -> dict:
    async with AsyncLLMEngine(model_dir, **kwargs) as engine:
        await engine.generate(WARMUP_PROMPT, SamplingParams())
        await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(*warmup)))
        await engine.wait_idle()
        before, compiled_before = engine.stats(), compiled_variants()
        synchronize(device)
        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(engine.generate(p, sp)) for p, sp in zip(prompts, params)]
        synchronize(device)
        elapsed = time.perf_counter() - start
        await engine.wait_idle()  # the engine publishes its counters just after the last step
        after = engine.stats()
    return dict(elapsed_s=elapsed, generated_tokens=sum(len(t.result().token_ids) for t in tasks),
                num_preemptions=after["num_preemptions"] - before["num_preemptions"],
                num_steps=after["num_steps"] - before["num_steps"], jit_compiles=jit_compiled_since(compiled_before))


def run_async(model_dir: str, kwargs: dict, prompts, params, warmup, device: str) -> dict:
    result = asyncio.run(_run_async(model_dir, kwargs, prompts, params, warmup, device))
    release_memory()
    return result


RUNNERS = {"sync": run_sync, "async": run_async}
COLUMNS = [("backend", "backend"), ("TP", "tensor_parallel_size"), ("mode", "mode"), ("requests", "num_requests"),
           ("output tokens", "total_tokens"), ("time (s)", "elapsed_s", "{:.2f}"),
           ("throughput (tok/s)", "throughput_tok_s", "{:,.0f}"), ("async/sync", "async_sync_ratio", "{:.3f}"),
           ("preemptions", "num_preemptions"), ("steps", "num_steps"), ("JIT compiles", "jit_compiles"),
           ("error", "error")]


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser, multi_backend=True)
    parser.add_argument("--mode", default="both", choices=["sync", "async", "both"], help="default: both")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input", type=int, default=1024, help="longest prompt (shortest: 100)")
    parser.add_argument("--max-output", type=int, default=1024, help="largest max_tokens (smallest: 100)")
    parser.add_argument("--warmup-requests", type=int, default=64,
                        help="short requests run before timing (0: only nano-vllm's single warm-up prompt)")
    args = parse_args(parser, argv)
    modes = ["sync", "async"] if args.mode == "both" else [args.mode]
    prompts, params = bench_requests(args.num_requests, args.seed, args.max_input, args.max_output)
    total_tokens = sum(p.max_tokens for p in params)
    warmup = warmup_requests(args.warmup_requests, args.max_input, args.seed + 1)
    report = Report("throughput", args)
    with checkpoint_from_args(args) as model_dir:
        for backend in args.backends:
            by_mode = {}
            for mode in modes:
                try:
                    stats = RUNNERS[mode](model_dir, engine_kwargs(args, backend), prompts, params, warmup,
                                          args.device)
                except Exception as exc:  # one failing backend (e.g. FA4 not built here) must not end the run
                    report.add(dict(backend=backend, mode=mode, error=f"{type(exc).__name__}: {exc}"))
                    print(f"{backend} {mode}: FAILED {type(exc).__name__}: {exc}")
                    release_memory()
                    continue
                row = dict(backend=backend, mode=mode, shape=args.shape, tensor_parallel_size=args.tensor_parallel_size,
                           num_requests=len(prompts),
                           total_tokens=total_tokens, throughput_tok_s=total_tokens / stats["elapsed_s"], **stats)
                if mode == "async" and "sync" in by_mode:
                    row["async_sync_ratio"] = row["throughput_tok_s"] / by_mode["sync"]["throughput_tok_s"]
                by_mode[mode] = row
                report.add(row)
                print(f"{backend} {mode}: {row['throughput_tok_s']:,.0f} tok/s in {row['elapsed_s']:.2f} s", flush=True)
    report.finish(f"Throughput, {args.shape}, nano-vllm workload ({len(prompts)} requests)", COLUMNS)
    return report.data


if __name__ == "__main__":
    main()
