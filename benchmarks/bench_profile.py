"""Where the time of one engine step goes: host work against GPU work, and the kernels of each.

    python benchmarks/bench_profile.py [--shape 0.6b] [--backend triton] [--json PATH]

For three steps of the engine (a batch-1 decode, a batch-1 prefill of --prefill-len tokens, and a
decode of --batch sequences with --context tokens each) it reports, as medians over --reps steps:
- wall: the whole step, run serially (launched, then resolved);
- host parts: schedule; launch (inputs built and uploaded, forward and sampling queued); the wait
  for the sampled ids; resolve (finish checks and token bookkeeping);
- gpu: the device time from the step's first copy to the sampled ids (CUDA events);
- for decode with CUDA graphs, the replay of the graph alone in a tight loop: the device floor of
  the forward with no host work at all.
Then a torch.profiler table per step: kernels by device time and their count per step. Last, the
whole throughput workload through EngineCore.step as configured (overlapped or not): its wall time
against the device time of its steps; wall - gpu is host time the device waited for. With
--workload-features plain,logprobs,... the workload runs once per feature set, to tell whether a
feature's cost is the device's or the host's (json: a constrained step's sampling is queued after
the step's end event, once its mask is filled, so its device time leaves the sampling out). A step is
host-bound when wall >> gpu, launch-bound when the kernel count times a few microseconds is near
gpu, and bandwidth-bound when gpu is near (bytes read / copy bandwidth).
"""
from __future__ import annotations

import dataclasses
import random
import time

import torch
from common import (HostWaits, Report, add_engine_args, bench_requests, checkpoint_from_args, engine_kwargs,
                    format_table, make_parser, median, parse_args, random_prompt, release_memory, with_features)

from asyncllm import LLM, SamplingParams


def timed_step(core, device: str) -> dict:
    """One step, run serially (launched, then resolved), split into its parts."""
    core.drain()  # a step still in flight (overlap) is resolved first, outside the timing
    cuda = device == "cuda"
    t0 = time.perf_counter()
    sched = core.scheduler.schedule()
    t1 = time.perf_counter()
    if cuda:
        gpu_start, gpu_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu_start.record()
    launched = core._launch(sched)  # inputs built and uploaded, forward and sampling queued
    if cuda:
        gpu_end.record()
    t2 = time.perf_counter()
    launched.token_ids()
    t3 = time.perf_counter()
    core._resolve(launched)  # finish checks, token bookkeeping (reads the ids already on the host)
    t4 = time.perf_counter()
    return {"wall": t4 - t0, "schedule": t1 - t0, "launch": t2 - t1, "wait": t3 - t2, "resolve": t4 - t3,
            "gpu": gpu_start.elapsed_time(gpu_end) / 1e3 if cuda else None,
            "num_seqs": len(sched.scheduled), "num_tokens": sched.num_batched_tokens}


def graph_replay_time(runner, batch_size: int, context: int, iters: int = 50) -> float | None:
    """Device seconds of one replay of the decode graph a step of batch_size sequences of up to
    `context` tokens takes, on the metadata its buffers hold from the last step."""
    graphs = runner.graph_runner
    if graphs is None:
        return None
    bs = next(s for s in graphs.batch_sizes if s >= batch_size)
    bound = next(b for b in graphs.context_bounds[bs] if b >= context)
    return graphs.replay_ms(("decode", bs, bound), iters) / 1e3


def sorted_replay_ms(runner, batch_size: int, context: int, reps: int = 5, iters: int = 100) -> list[float]:
    """graph_replay_time in ms, reps times over iters replays each, ascending (median: [reps // 2])."""
    return sorted(graph_replay_time(runner, batch_size, context, iters) * 1e3 for _ in range(reps))


def recapture_graphs(runner) -> None:
    """Captures the runner's CUDA graphs again, and the sampler graphs over their new outputs: after
    a benchmark changed what the forward launches (a kernel choice, a patched module)."""
    runner.graph_runner._capture_all()
    if runner.sampler_graphs is not None:
        runner.sampler_graphs._capture_all()


def kernel_table(core, device: str, rows: int) -> tuple[str, int]:
    """One profiled step: kernels by device time, and how many kernels the step launched."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        core.step()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    if device == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels.sort(key=lambda e: e.device_time_total, reverse=True)
        count = sum(e.count for e in kernels)
        total = sum(e.device_time_total for e in kernels)
        lines = ["| kernel | calls | device us | share |", "|---|---|---|---|"]
        for e in kernels[:rows]:
            lines.append(f"| `{e.key[:70]}` | {e.count} | {e.device_time_total:.0f} | "
                         f"{e.device_time_total / max(total, 1e-9):.0%} |")
        lines.append(f"| all {count} kernels | {count} | {total:.0f} | 100% |")
        return "\n".join(lines), count
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    lines = ["| op | calls | self cpu us |", "|---|---|---|"]
    lines += [f"| `{e.key[:70]}` | {e.count} | {e.self_cpu_time_total:.0f} |" for e in cpu]
    return "\n".join(lines), 0


def python_profile(core, setup, reps: int, rows: int) -> str:
    """Host time by Python function over `reps` steps (setup excluded), as cProfile sees it."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    for _ in range(reps):
        setup()
        profiler.enable()
        core.step()
        profiler.disable()
        drain(core)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows * 2)
    return f"cProfile over {reps} steps, by own time:\n```\n{text.getvalue().strip()}\n```"


def start_requests(core, rng, num: int, prompt_len: int, max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(num):
        core.add_request(random_prompt(rng, prompt_len), params)


def run_to_decode(core) -> None:
    """Step until every running request has its prompt computed (the next steps are decodes)."""
    while core.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens - 1
                                        for s in core.scheduler.running):
        core.step()
    core.step()


def drain(core) -> None:
    for request_id in list(core.requests):
        core.finish_request(request_id)


def profile_workload(core, num_requests: int, device: str, features: str = "plain", cprofile_rows: int = 0
                     ) -> list[dict]:
    """The throughput benchmark's workload through EngineCore.step, as the engine is configured
    (overlapped or not), its requests with the sampling features given (common.FEATURES): wall
    time against the device time of each launched step (CUDA events from before its inputs' copy
    to after its sampling), summed by kind of step. A step's device time includes any wait for the
    host to queue its own kernels, so wall - gpu is the least host time the device sat idle for. host
    waits: the time the engine thread sat blocked on the device's results (LaunchedStep._on_host);
    near 0 means the host is the bottleneck (the device's work is done before the host asks for
    it), near wall the device. cprofile_rows: also print the engine thread's Python functions over
    the run by own time (the host work a feature adds), this many of them."""
    prompts, params = bench_requests(num_requests)
    params = with_features(params, features)
    if features != "plain":  # untimed: a grammar's compile, the features' first kernels
        core.add_request(prompts[0][:16], dataclasses.replace(params[0], max_tokens=4))
        while core.has_unfinished():
            core.step()
    for prompt, p in zip(prompts, params):
        core.add_request(prompt, p)
    cuda = device == "cuda"
    launched_steps = []
    launch = core.runner.launch

    def timed_launch(plan, prev, **kwargs):
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        launched = launch(plan, prev, **kwargs)
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            end.record()
        decode_only = plan.num_tokens == len(plan.query_lens)
        launched_steps.append(("decode only" if decode_only else "with prefill", plan.num_tokens, start, end))
        return launched
    core.runner.launch = timed_launch
    profiler = None
    if cprofile_rows:
        import cProfile
        profiler = cProfile.Profile()
    try:
        with HostWaits() as waits:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            while core.has_unfinished():
                core.step()
            if profiler is not None:
                profiler.disable()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        del core.runner.launch  # the bound method again
    if profiler is not None:
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(cprofile_rows)
        print(f"\n#### cProfile of the workload ({features}, {len(launched_steps)} steps; wall {wall:.3f} s "
              f"with the profiler on)\n```\n{text.getvalue().strip()}\n```", flush=True)
    totals: dict[str, dict] = {}
    for kind, num_tokens, start, end in launched_steps:
        row = totals.setdefault(kind, {"kind": kind, "steps": 0, "tokens": 0, "gpu": 0.0})
        row["steps"] += 1
        row["tokens"] += num_tokens
        row["gpu"] += start.elapsed_time(end) / 1e3 if cuda else 0.0
    rows = list(totals.values())
    gpu = sum(r["gpu"] for r in rows)
    for row in rows:
        row["features"] = features
    return rows + [{"kind": f"all (overlap {'on' if core.overlap else 'off'})", "features": features,
                    "steps": len(launched_steps),
                    "tokens": sum(r["tokens"] for r in rows), "gpu": gpu, "wall": wall,
                    "host_idle": wall - gpu if cuda else None, "host_waits": waits.seconds}]


PARTS = ["wall", "gpu", "schedule", "launch", "wait", "resolve", "graph_replay"]
COLUMNS = [("step", "step"), ("seqs", "num_seqs"), ("tokens", "num_tokens"), ("kernels", "kernels")] + \
    [(f"{p} (ms)", p, "{:.3f}") for p in PARTS]


WORKLOAD_COLUMNS = [("features", "features"), ("steps", "kind"), ("count", "steps"), ("tokens", "tokens"), ("wall (s)", "wall", "{:.3f}"),
                    ("gpu (s)", "gpu", "{:.3f}"), ("wall - gpu (s)", "host_idle", "{:.3f}"),
                    ("host waits (s)", "host_waits", "{:.3f}")]


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--prefill-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=12, help="kernels listed per profiled step")
    parser.add_argument("--workload", type=int, default=256, metavar="N",
                        help="also time every step of the nano-vllm bench workload of N requests (0: skip)")
    parser.add_argument("--workload-features", default="plain",
                        help="comma-separated runs of the workload, each with the '+'-joined sampling features of "
                             "common.FEATURES (e.g. plain,logprobs,penalties+logprobs,json): device against host time")
    parser.add_argument("--cprofile", action="store_true",
                        help="also print the Python functions that take the host time of each step, and of each "
                             "workload run (cProfile; the workload's wall time is then the profiled one)")
    args = parse_args(parser, argv)
    rng = random.Random(args.seed)
    report = Report("profile", args)
    tables = []
    with checkpoint_from_args(args) as model_dir:
        llm = LLM(model_dir, **engine_kwargs(args, args.backend))
        core = llm.core

        def measure(name: str, setup, reps: int):
            results = []
            for _ in range(reps):
                setup()
                results.append(timed_step(core, args.device))
                drain(core)
            setup()
            table, count = kernel_table(core, args.device, args.rows)
            drain(core)
            if args.cprofile:
                table += "\n\n" + python_profile(core, setup, reps, args.rows)
            row = {"step": name, "num_seqs": results[0]["num_seqs"], "num_tokens": results[0]["num_tokens"],
                   "kernels": count}
            for part in PARTS[:-1]:
                values = [r[part] for r in results if r[part] is not None]
                row[part] = median(values) * 1e3 if values else None
            return row, table

        def decode_setup(batch: int, context: int):
            def setup():
                start_requests(core, rng, batch, context, 64)
                run_to_decode(core)
            return setup

        def prefill_setup():
            start_requests(core, rng, 1, args.prefill_len, 2)

        for setup in (decode_setup(1, 128), prefill_setup, decode_setup(args.batch, args.context)):  # warm-up
            setup()
            timed_step(core, args.device)
            drain(core)
        for name, setup, reps, batch, context in (
                ("decode b=1 ctx=128", decode_setup(1, 128), args.reps, 1, 128),
                (f"prefill {args.prefill_len}", prefill_setup, args.reps, None, None),
                (f"decode b={args.batch} ctx={args.context}", decode_setup(args.batch, args.context),
                 max(3, args.reps // 4), args.batch, args.context)):
            row, table = measure(name, setup, reps)
            if batch is not None and args.device == "cuda":
                replay = graph_replay_time(core.runner, batch, context + 1)  # + the decoded token
                row["graph_replay"] = None if replay is None else replay * 1e3
            report.add(row)
            tables.append(f"#### {name}\n\n{table}")
            print(f"\n#### {name}\n\n{table}", flush=True)
        if args.workload:
            workload_rows = [row for features in args.workload_features.split(",")
                             for row in profile_workload(core, args.workload, args.device, features,
                                                         args.rows * 3 if args.cprofile else 0)]
            report.set("workload", workload_rows)
            print("\n" + format_table(workload_rows, WORKLOAD_COLUMNS), flush=True)
            tables.append(f"#### nano-vllm workload, {args.workload} requests\n\n"
                          + format_table(workload_rows, WORKLOAD_COLUMNS))
        assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks
        llm = core = None  # noqa: F841
        release_memory()
    report.set("kernel_tables", tables)
    table = report.finish(f"Step profile, {args.shape}, {args.backend}", COLUMNS)
    if report.data.get("workload"):  # the summary shows each benchmark's "table": the workload's too
        report.set("table", f"{table}\n\nEvery step of the throughput workload ({args.workload} requests), "
                            f"summed by kind (s):\n\n{format_table(report.data['workload'], WORKLOAD_COLUMNS)}")
    return report.data


if __name__ == "__main__":
    main()
