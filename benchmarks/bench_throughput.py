"""Offline throughput on nano-vllm's bench.py workload (random weights, random token ids).

    python benchmarks/bench_throughput.py [--backends triton,fa4] [--mode sync,stream,generate|all]
                                          [--overlap auto|on|off|both] [--json PATH]
                                          [--features plain,penalties+logprobs]
                                          [--spec-modes none,ngram] [--speculative-config JSON]

256 requests, prompts of 100..1024 random tokens, 100..1024 output tokens each (EOS ignored),
temperature 0.6. nano-vllm's one short warm-up request, plus --warmup-requests short ones of
assorted sizes (so that no Triton JIT compile is timed; the "JIT compiles" column checks that),
then the whole batch is timed; throughput is sum(max_tokens) / wall time, as nano-vllm reports it.

Modes: sync: one LLM.generate call. stream: every request submitted at once to an AsyncLLMEngine
and read by its own `async for out in engine.stream(...)` task, which reads out.text and counts
out.token_ids -- the path apps take. generate: the same with `await engine.generate(...)` (woken
once per request). Each row also says how busy the device was (the steps' device time over the wall
time), how long the engine thread waited for the device, and the event loop thread's CPU time: a
device under 100 % busy with short host waits is a run the host held back. With more than one mode
or overlap setting, each runs in its own process, one after another, and the table gives each row's
ratio to sync with the same overlap setting.

Features: each comma-separated item is one run whose requests all use the '+'-joined sampling
features: plain (none), penalties (presence 0.5, frequency 0.5, repetition 1.1), logprobs (5 top
alternatives per token), json (every request, warm-up ones too so that the grammar compile is not
timed, held to a JSON schema whose first field is a string of at least 20,000 characters: on random
weights every request still runs to its max_tokens, and every step fills a dense mask, the common
case inside a JSON string). The "/ plain" column is each row's ratio to the plain run of the same
backend, mode and overlap setting (e.g. --features plain,penalties+logprobs --mode sync).

Speculative decoding: each of --spec-modes is one run: none (off), ngram (prompt lookup, NGRAM below)
or config (--speculative-config's JSON, as `asyncllm serve` takes it). Its rows name it and its
config, give the drafts proposed and accepted, the acceptance rate and the speculating share (decoding
rows' steps that verified drafts: past MAX_SPECULATING_DECODES decoding rows a step speculates for
none, so on this workload only its tail may), and "/ no spec", the ratio to the none run of the same
backend, mode, overlap setting and features (issue 46's target for this workload: no loss).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

from common import (HostWaits, Report, add_engine_args, add_ratios, bench_requests, checkpoint_from_args,
                    engine_kwargs, host_report, jit_compiled_since, make_parser, parse_args, release_memory,
                    speculation_report, strip_options, synchronize, timed, warmup_requests, with_features)

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.kernels import compiled_variants

WARMUP_PROMPT = "Benchmark: "  # nano-vllm's warm-up request
MODES = ["sync", "stream", "generate"]
# --spec-modes "ngram": bench_spec.py's prompt lookup (k 4, n-grams of 2..4 tokens)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SPEC_MODES = ("none", "ngram", "config")


def run_sync(model_dir: str, kwargs: dict, prompts, params, warmup, device: str) -> dict:
    llm = LLM(model_dir, **kwargs)
    llm.generate([WARMUP_PROMPT], SamplingParams(), use_tqdm=False)
    if warmup[0]:
        llm.generate(*warmup, use_tqdm=False)
    before, compiled_before = llm.core.stats(), compiled_variants()
    with HostWaits() as waits:
        outputs, elapsed = timed(lambda: llm.generate(prompts, params, use_tqdm=False), device)
    after = llm.core.stats()
    compiled = jit_compiled_since(compiled_before)
    llm = None  # noqa: F841 - freed before the next engine starts
    release_memory()
    return dict(elapsed_s=elapsed, generated_tokens=sum(len(o["token_ids"]) for o in outputs),
                num_preemptions=after["num_preemptions"] - before["num_preemptions"],
                num_steps=after["num_steps"] - before["num_steps"], jit_compiles=compiled,
                **host_report(before, after, elapsed, waits), **speculation_report(before, after))


async def _stream_one(engine: AsyncLLMEngine, prompt, params) -> int:
    num_tokens, num_chars = 0, 0
    async for out in engine.stream(prompt, params):
        num_chars += len(out.text)  # what an app shows
        num_tokens += len(out.token_ids)
    return num_tokens


async def _generate_one(engine: AsyncLLMEngine, prompt, params) -> int:
    return len((await engine.generate(prompt, params)).token_ids)


def loop_profile(profiler, num_tokens: int, rows: int = 14) -> str:
    """Python time over the timed run, per token: the event loop's thread only on Python 3.11; on 3.12,
    whose cProfile sees every thread, the engine thread's too (each function names its side)."""
    import io
    import pstats
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    # time blocked in the selector is the loop waiting for a wake-up, not work
    idle = sum(tt for (_, _, name), (_, _, tt, _, _) in stats.stats.items() if "poll" in name or "select" in name)
    busy = stats.total_tt - idle
    stats.sort_stats("tottime").print_stats(rows)
    return (f"profiled threads: {busy:.3f} s of work ({idle:.2f} s waiting), {busy / num_tokens * 1e6:.1f} us per "
            f"token (cProfile's own overhead included)\n" + text.getvalue().strip())


async def _run_async(consume, model_dir: str, kwargs: dict, prompts, params, warmup, device: str,
                     profile: bool = False) -> dict:
    async with AsyncLLMEngine(model_dir, **kwargs) as engine:
        await consume(engine, WARMUP_PROMPT, SamplingParams())
        await asyncio.gather(*(consume(engine, p, sp) for p, sp in zip(*warmup)))
        await engine.wait_idle()
        before, compiled_before = engine.stats(), compiled_variants()
        synchronize(device)
        profiler = None
        if profile:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        with HostWaits() as waits:
            start, loop_cpu = time.perf_counter(), time.thread_time()  # this thread runs the event loop
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(consume(engine, p, sp)) for p, sp in zip(prompts, params)]
            synchronize(device)
            elapsed, loop_cpu = time.perf_counter() - start, time.thread_time() - loop_cpu
        if profiler is not None:
            profiler.disable()
            print(loop_profile(profiler, sum(t.result() for t in tasks)), flush=True)
        await engine.wait_idle()  # the engine publishes its counters just after the last step
        after = engine.stats()
    return dict(elapsed_s=elapsed, generated_tokens=sum(t.result() for t in tasks),
                num_preemptions=after["num_preemptions"] - before["num_preemptions"],
                num_steps=after["num_steps"] - before["num_steps"], jit_compiles=jit_compiled_since(compiled_before),
                **host_report(before, after, elapsed, waits, loop_cpu), **speculation_report(before, after))


def run_stream(*args, profile: bool = False) -> dict:
    result = asyncio.run(_run_async(_stream_one, *args, profile=profile))
    release_memory()
    return result


def run_generate(*args, profile: bool = False) -> dict:
    result = asyncio.run(_run_async(_generate_one, *args, profile=profile))
    release_memory()
    return result


RUNNERS = {"sync": run_sync, "stream": run_stream, "generate": run_generate}
COLUMNS = [("backend", "backend"), ("TP", "tensor_parallel_size"), ("mode", "mode"), ("overlap", "overlap"),
           ("features", "features"), ("spec", "spec"),
           ("requests", "num_requests"), ("output tokens", "total_tokens"), ("time (s)", "elapsed_s", "{:.2f}"),
           ("throughput (tok/s)", "throughput_tok_s", "{:,.0f}"), ("/ sync", "sync_ratio", "{:.3f}"),
           ("/ plain", "plain_ratio", "{:.3f}"), ("/ no spec", "spec_ratio", "{:.3f}"),
           ("drafts proposed", "spec_proposed"), ("accepted", "spec_accepted"),
           ("spec share", "speculating_share", "{:.3f}"),
           ("device busy", "device_busy", "{:.1%}"), ("host waits (s)", "host_waits_s", "{:.2f}"),
           ("loop CPU (s)", "loop_cpu_s", "{:.2f}"),
           ("preemptions", "num_preemptions"), ("steps", "num_steps"), ("JIT compiles", "jit_compiles"),
           ("error", "error")]


def run_in_child(argv: list[str], backend: str, mode: str, overlap: str, features: str, spec: str) -> list[dict]:
    """This script for one backend, mode, overlap setting, feature set and spec mode, in a fresh
    process: no engine or allocator state of one run colours the next."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        child = [sys.executable, os.path.abspath(__file__), *argv, "--backends", backend, "--mode", mode,
                 "--overlap", overlap, "--features", features, "--spec-modes", spec, "--json", out]
        subprocess.run(child, check=False)
        if not os.path.exists(out):
            return [dict(backend=backend, mode=mode, overlap=overlap, features=features, spec=spec,
                         error="the child process wrote no result")]
        with open(out) as f:
            return json.load(f)["results"]


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser, multi_backend=True)
    parser.add_argument("--target-step-ms", default="default",
                        help="Config.target_step_ms: a number, none (throughput first), or default (each API's own: "
                             "LLM None, AsyncLLMEngine 8 ms)")
    parser.add_argument("--mode", default="all", help="comma-separated of sync, stream, generate; or all (default)")
    parser.add_argument("--features", default="plain",
                        help="comma-separated runs, each '+'-joined sampling features of plain, penalties, logprobs, "
                             "json (e.g. plain,penalties+logprobs,json)")
    parser.add_argument("--spec-modes", default=None,
                        help=f"comma-separated runs of {SPEC_MODES}: speculative decoding off, n-gram prompt lookup, "
                             f"or --speculative-config's (default: config if that is given, else none)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input", type=int, default=1024, help="longest prompt (shortest: 100)")
    parser.add_argument("--max-output", type=int, default=1024, help="largest max_tokens (smallest: 100)")
    parser.add_argument("--profile-loop", action="store_true",
                        help="stream/generate: print a cProfile of the event loop's thread over the timed run "
                             "(slows it: not for the throughput figures)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval for the run (the interpreter's default: 5 ms): how long a thread "
                             "that wants the interpreter waits for another that holds it before it asks for it")
    parser.add_argument("--warmup-requests", type=int, default=64,
                        help="short requests run before timing (0: only nano-vllm's single warm-up prompt)")
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(parser, raw_argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    modes = MODES if args.mode in ("all", "both") else args.mode.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"--mode: unknown {sorted(unknown)}; choose from {MODES}")
    overlaps = ["off", "on"] if args.overlap == "both" else [args.overlap]
    feature_sets = args.features.split(",")
    specs = (args.spec_modes or ("config" if args.speculative_config else "none")).split(",")
    if set(specs) - set(SPEC_MODES) or ("config" in specs and args.speculative_config is None):
        parser.error(f"--spec-modes: expected comma-separated names of {SPEC_MODES} (config: with "
                     f"--speculative-config), got {args.spec_modes!r}")
    settings = [(mode, overlap, features, spec) for overlap in overlaps for mode in modes for features in feature_sets
                for spec in specs]
    report = Report("throughput", args)
    prompts, params = bench_requests(args.num_requests, args.seed, args.max_input, args.max_output)
    total_tokens = sum(p.max_tokens for p in params)
    if len(settings) > 1 or len(args.backends) > 1:
        child_argv = strip_options(raw_argv, ("--backends", "--mode", "--overlap", "--features", "--spec-modes",
                                              "--json"))
        for backend in args.backends:
            for setting in settings:
                for row in run_in_child(child_argv, backend, *setting):
                    report.add(row)
    else:
        (mode, overlap, features, spec), backend = settings[0], args.backends[0]
        args.speculative_config = {"none": None, "ngram": NGRAM, "config": args.speculative_config}[spec]
        params = with_features(params, features)
        warmup_prompts, warmup_params = warmup_requests(args.warmup_requests, args.max_input, args.seed + 1)
        warmup = warmup_prompts, with_features(warmup_params, features)  # a grammar's compile is not timed
        with checkpoint_from_args(args) as model_dir:
            kwargs = engine_kwargs(args, backend)
            try:
                extra = {"profile": True} if args.profile_loop and mode != "sync" else {}
                stats = RUNNERS[mode](model_dir, kwargs, prompts, params, warmup, args.device, **extra)
                report.add(dict(backend=backend, mode=mode, overlap=overlap, features=features, spec=spec,
                                speculative_config=args.speculative_config, shape=args.shape,
                                tensor_parallel_size=args.tensor_parallel_size, num_requests=len(prompts),
                                total_tokens=total_tokens, throughput_tok_s=total_tokens / stats["elapsed_s"], **stats))
            except Exception as exc:  # one failing backend (e.g. FA4 not built here) must not end the run
                report.add(dict(backend=backend, mode=mode, overlap=overlap, features=features, spec=spec,
                                error=f"{type(exc).__name__}: {exc}"))
                print(f"{backend} {mode}: FAILED {type(exc).__name__}: {exc}")
    rows = report.data["results"]
    add_ratios(rows, "sync_ratio", "throughput_tok_s", {"mode": "sync"}, ("backend", "overlap", "features", "spec"))
    add_ratios(rows, "plain_ratio", "throughput_tok_s", {"features": "plain"}, ("backend", "overlap", "mode", "spec"))
    add_ratios(rows, "spec_ratio", "throughput_tok_s", {"spec": "none"}, ("backend", "overlap", "mode", "features"))
    report.finish(f"Throughput, {args.shape}, nano-vllm workload ({len(prompts)} requests)", COLUMNS)
    return report.data


if __name__ == "__main__":
    main()
