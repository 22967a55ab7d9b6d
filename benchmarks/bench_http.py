"""The serving workloads through `asyncllm serve`, each beside its in-process twin (issue 45).

    python benchmarks/bench_http.py [--workloads burst,closed,poisson] [--paths in-process,httpx,openai]
        [--client-processes 4] [--num-requests 256] [--concurrency 64] [--rate 53.5] [--temperature 0.6]
        [--api-server-counts 1,2] [--json PATH]

Workloads (random token-id prompts, EOS ignored, --temperature, --seed):
  burst    nano-vllm's bench.py requests (--num-requests, prompts of 100..--max-input tokens, max_tokens
           100..--max-output), all sent at once: the offline workload as one burst
  closed   --concurrency closed-loop clients, max(3C, 16) requests of --input-len / --output-len tokens
           (bench_serving.py's closed loop)
  poisson  --requests-per-rate requests of the same lengths, Poisson arrivals at --rate req/s
Paths, each a row per workload:
  in-process  AsyncLLMEngine.stream in a process of its own (one event loop), the engine's defaults
  httpx       `asyncllm serve` in a subprocess (same engine options, --log-level warning: no access log),
              clients in --client-processes processes (benchmarks/load_clients.py: each its own asyncio
              loop and httpx.AsyncClient) reading server-sent events from /v1/completions, the prompt sent
              as token ids; request i goes to process i % K, a closed loop's clients are split among them
  openai      the same clients through the official openai package's AsyncOpenAI (stream=True)
Each path gets --warmup-requests short requests first, so that no Triton JIT compile is timed.

Per request, as the client sees it: TTFT (request sent -> first chunk with text), ITL (every gap
between such chunks, pooled), TPOT, E2E (p50, p99); output tokens from the usage chunk
(stream_options.include_usage); output tok/s = all tokens / (the last request's end - the common
start). The in-process twin counts a stream item when it has text, as the server sends a chunk.
"/ in-process" columns: each row's output tok/s, TTFT p50 and ITL p99 over its twin's.
CPU per output token (Linux, from /proc) of the process that serves the row, while it runs: "loop" is
its main thread, which runs the event loop (the twin's stream reads and detokenizing; the server's
HTTP, JSON and SSE framing too), "process" all its threads (the engine thread's too), "front-ends" its
child processes' (--api-server-counts 1,2: a server each; with N >= 2 front-ends the HTTP work is
theirs, and the loop column is the engine process's relay of the streams). The loop column's
difference between a server row and its twin is the server's own per-token host cost.

On CPU, that cost shows with a model whose steps are cheap (clients, server and engine share the
CPU cores, so tok/s there says little):
    OMP_NUM_THREADS=1 python benchmarks/bench_http.py --device cpu --shape tiny-v16k --temperature 0
        --workloads closed --paths in-process,httpx --client-processes 2 --concurrency 64 --input-len 128
        --output-len 256 --warmup-requests 4

On the GPU image (no registry there) starlette, uvicorn and openai (with distro, jiter, pydantic,
pydantic-core, annotated-types, typing-inspection, sniffio) travel as wheels in .whl/
(scripts/gpu_suite.sh); a path whose package is missing gives a row with its error.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from bench_serving import summarize
from common import (REPO_ROOT, Report, add_engine_args, add_ratios, bench_requests, checkpoint_from_args, child_env,
                    engine_kwargs, make_parser, parse_args, random_prompt, serve_options, stream_timings,
                    strip_options, warmup_requests)
from load_clients import close_client, drive, make_client

from asyncllm import AsyncLLMEngine, SamplingParams

sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))  # tests/helpers.py: how the tests start and stop a server
from helpers import free_port, serve_command, stop_process, wait_healthy  # noqa: E402

LOAD_CLIENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "load_clients.py")
WORKLOADS = ("burst", "closed", "poisson")
PATHS = ("in-process", "httpx", "openai")
MODEL_NAME = "bench"


def workloads(args) -> dict[str, tuple[list[tuple[list[int], int]], list[float] | None, int]]:
    """name -> (requests as (prompt, max_tokens), start offsets in s or None for a closed loop, concurrency)."""
    out = {}
    if "burst" in args.workloads:
        prompts, params = bench_requests(args.num_requests, args.seed, args.max_input, args.max_output)
        out["burst"] = ([(p, sp.max_tokens) for p, sp in zip(prompts, params)], [0.0] * len(prompts), 0)
    rng = random.Random(args.seed + 2)
    if "closed" in args.workloads:
        num = max(3 * args.concurrency, 16)
        out["closed"] = ([(random_prompt(rng, args.input_len), args.output_len) for _ in range(num)], None,
                         args.concurrency)
    if "poisson" in args.workloads:
        requests = [(random_prompt(rng, args.input_len), args.output_len) for _ in range(args.requests_per_rate)]
        offsets, t = [], 0.0
        for _ in requests:
            offsets.append(t)
            t += rng.expovariate(args.rate)
        out["poisson"] = (requests, offsets, 0)
    return out


def workload_label(name: str, args) -> str:
    return {"burst": f"burst of {args.num_requests} (nano-vllm)", "closed": f"{args.concurrency} closed-loop clients",
            "poisson": f"Poisson {args.rate:g} req/s"}[name]


def cpu_seconds(pid: int) -> dict[str, float] | None:
    """A live process's CPU seconds (user + system): its main thread's ("loop": the event loop runs
    there) and all its threads' ("process"); None where /proc cannot tell (not Linux)."""
    def read(path: str) -> float:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    try:
        return dict(loop=read(f"/proc/{pid}/task/{pid}/stat"), process=read(f"/proc/{pid}/stat"))
    except (OSError, ValueError, IndexError):
        return None


def frontends_cpu_seconds(pid: int) -> float | None:
    """The CPU seconds of a server's child processes (its --api-server-count front-ends)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        if not children:
            return None
        return sum(cpu["process"] for cpu in map(cpu_seconds, children) if cpu is not None)
    except (OSError, ValueError):
        return None


def server_cpu(pid: int) -> dict | None:
    cpu = cpu_seconds(pid)
    if cpu is not None:
        cpu["frontends"] = frontends_cpu_seconds(pid)
    return cpu


def make_row(name: str, args, path: str, processes: int, results: list[dict], wall: float,
             cpu_before: dict | None = None, cpu_after: dict | None = None) -> dict:
    """cpu_before, cpu_after: cpu_seconds() of the serving process around the row."""
    failed = [r for r in results if r.get("error") or r.get("ttft") is None]
    done = [r for r in results if r not in failed]
    row = dict(workload=workload_label(name, args), path=path, processes=processes, errors=len(failed),
               output_tokens=sum(r["tokens"] for r in done), **summarize(done, wall))
    if cpu_before is not None and cpu_after is not None and row["output_tokens"]:
        for part in ("loop", "process", "frontends"):
            if cpu_before.get(part) is not None and cpu_after.get(part) is not None:
                row[f"{part}_cpu_us_per_token"] = (cpu_after[part] - cpu_before[part]) / row["output_tokens"] * 1e6
    if failed:
        row["error"] = failed[0].get("error") or "no chunk with text"
    return row


# ---- in process ---------------------------------------------------------------------------------------------
async def run_in_process(args, model_dir: str, work: dict, report: Report) -> None:
    async with AsyncLLMEngine(model_dir, **engine_kwargs(args, args.backend)) as engine:
        warmup = warmup_requests(args.warmup_requests, args.input_len, args.seed + 1)
        await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(*warmup)))

        async def send(prompt: list[int], max_tokens: int) -> dict:
            params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=max_tokens)
            return await stream_timings(engine, prompt, params, count="text")
        for name, (requests, offsets, concurrency) in work.items():
            start, cpu_before = time.perf_counter(), cpu_seconds(os.getpid())
            results = await drive(send, requests, offsets, concurrency)
            report.add(make_row(name, args, "in-process", 1, results, time.perf_counter() - start, cpu_before,
                                cpu_seconds(os.getpid())))
            print_row(report.data["results"][-1])


def in_process_child(raw_argv: list[str], model_dir: str) -> list[dict]:
    """This script with --paths in-process, in a fresh process: the engine alone there, as an app has it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = strip_options(raw_argv, ("--paths", "--model-dir", "--json"))
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--paths", "in-process", "--model-dir",
                        model_dir, "--json", out], check=False, env=child_env())
        if not os.path.exists(out):
            return [dict(path="in-process", error="the child process wrote no result")]
        with open(out) as f:
            return json.load(f)["results"]


# ---- through the server -------------------------------------------------------------------------------------
def start_server(args, model_dir: str, log_path: str, api_server_count: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [*serve_command(), "serve", model_dir, "--port", str(port), "--served-model-name", MODEL_NAME,
               "--log-level", "warning", "--api-server-count", str(api_server_count),
               *serve_options(engine_kwargs(args, args.backend))]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log_path, timeout=args.server_timeout_s)
    except BaseException:
        stop_process(proc)
        raise
    return proc, base


def warm_up_server(args, base: str) -> None:
    prompts, params = warmup_requests(args.warmup_requests, args.input_len, args.seed + 1)

    async def run():
        client, send = make_client("httpx", base, MODEL_NAME, args.temperature)
        results = await drive(send, [(p, sp.max_tokens) for p, sp in zip(prompts, params)], [0.0] * len(prompts), 0)
        await close_client(client)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(f"warm-up: {len(errors)} requests failed, first: {errors[0]}")
    asyncio.run(run())


def shares(requests: list, offsets: list[float] | None, concurrency: int, processes: int) -> list[dict]:
    """The workload split over client processes: request i to process i % K (of those with clients)."""
    if offsets is None:
        clients = [concurrency // processes + (k < concurrency % processes) for k in range(processes)]
        clients = [c for c in clients if c]
    else:
        clients = [0] * min(processes, len(requests))
    k = len(clients)
    return [dict(requests=requests[i::k], offsets=None if offsets is None else offsets[i::k], concurrency=c)
            for i, c in enumerate(clients)]


def run_clients(args, base: str, client: str, requests, offsets, concurrency: int, tmp: str) -> tuple[list, float]:
    """The workload from --client-processes processes, started together; (results, wall seconds)."""
    procs = []
    try:
        for k, share in enumerate(shares(requests, offsets, concurrency, args.client_processes)):
            spec, out = os.path.join(tmp, f"spec{k}.json"), os.path.join(tmp, f"out{k}.json")
            with open(spec, "w") as f:
                json.dump(dict(share, base=base, model=MODEL_NAME, client=client, temperature=args.temperature), f)
            procs.append((subprocess.Popen([sys.executable, LOAD_CLIENTS, spec, out], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, env=child_env()), out))
        for proc, _ in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {client} client process failed to start (exit {proc.wait()})")
        start_at = time.time() + 0.5  # every process has its client made: they start together
        for proc, _ in procs:
            proc.stdin.write(f"{start_at!r}\n")
            proc.stdin.close()
        results, end = [], start_at
        for proc, out in procs:
            if proc.wait(timeout=args.client_timeout_s) != 0 or not os.path.exists(out):
                raise RuntimeError(f"a {client} client process failed (exit {proc.returncode})")
            with open(out) as f:
                data = json.load(f)
            results += data["results"]
            end = max(end, data["end"])
        return results, end - start_at
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_server_paths(args, model_dir: str, work: dict, report: Report) -> None:
    for count in args.api_server_counts:
        run_server(args, model_dir, work, report, count)


def run_server(args, model_dir: str, work: dict, report: Report, api_server_count: int) -> None:
    clients = [p for p in args.paths if p != "in-process"]
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(args.log_dir or tmp, f"server-{api_server_count}.log")
        proc, base = start_server(args, model_dir, log_path, api_server_count)
        try:
            warm_up_server(args, base)
            for name, (requests, offsets, concurrency) in work.items():
                for client in clients:
                    path = client if api_server_count == 1 else f"{client}, {api_server_count} front-ends"
                    try:
                        cpu_before = server_cpu(proc.pid)  # `asyncllm serve` is a Python script: the server itself
                        results, wall = run_clients(args, base, client, requests, offsets, concurrency, tmp)
                        row = make_row(name, args, path, len(shares(requests, offsets, concurrency,
                                                                    args.client_processes)), results, wall,
                                       cpu_before, server_cpu(proc.pid))
                    except Exception as exc:  # noqa: BLE001 - e.g. openai not installed: the other rows still run
                        row = dict(workload=workload_label(name, args), path=path,
                                   error=f"{type(exc).__name__}: {exc}")
                    report.add(row)
                    print_row(row)
        finally:
            stop_process(proc)


# ---- report -------------------------------------------------------------------------------------------------
COLUMNS = [("workload", "workload"), ("path", "path"), ("procs", "processes"), ("requests", "num_requests"),
           ("errors", "errors"), ("TTFT p50", "ttft_p50_ms", "{:.1f}"), ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
           ("ITL p50", "itl_p50_ms", "{:.2f}"), ("ITL p99", "itl_p99_ms", "{:.2f}"),
           ("TPOT p50", "tpot_p50_ms", "{:.2f}"), ("E2E p50", "e2e_p50_ms", "{:.0f}"),
           ("E2E p99", "e2e_p99_ms", "{:.0f}"), ("output tok/s", "output_tok_s", "{:,.0f}"),
           ("tok/s / in-process", "tok_s_vs_in_process", "{:.3f}"),
           ("TTFT p50 / in-process", "ttft_p50_vs_in_process", "{:.2f}"),
           ("ITL p99 / in-process", "itl_p99_vs_in_process", "{:.2f}"),
           ("loop CPU us/tok", "loop_cpu_us_per_token", "{:.1f}"),
           ("process CPU us/tok", "process_cpu_us_per_token", "{:.0f}"),
           ("front-ends CPU us/tok", "frontends_cpu_us_per_token", "{:.0f}"), ("error", "error")]


def print_row(row: dict) -> None:
    if row.get("error") and not row.get("num_requests"):
        print(f"{row['workload']}, {row['path']}: FAILED {row['error']}", flush=True)
        return
    print(f"{row['workload']}, {row['path']}: TTFT p50 {row['ttft_p50_ms']:.1f} ms, ITL p99 "
          f"{row['itl_p99_ms'] or 0:.2f} ms, {row['output_tok_s']:,.0f} tok/s, {row['errors']} errors, loop CPU "
          f"{row.get('loop_cpu_us_per_token') or 0:.1f} us/token", flush=True)


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated of {', '.join(WORKLOADS)}")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated of {', '.join(PATHS)}")
    parser.add_argument("--client-processes", type=int, default=4, help="K: client processes per HTTP row")
    parser.add_argument("--num-requests", type=int, default=256, help="burst: requests")
    parser.add_argument("--max-input", type=int, default=1024, help="burst: longest prompt (shortest: 100)")
    parser.add_argument("--max-output", type=int, default=1024, help="burst: largest max_tokens (smallest: 100)")
    parser.add_argument("--concurrency", type=int, default=64, help="closed: clients")
    parser.add_argument("--rate", type=float, default=53.5, help="poisson: arrivals per second")
    parser.add_argument("--requests-per-rate", type=int, default=192, help="poisson: requests")
    parser.add_argument("--input-len", type=int, default=1024, help="closed, poisson: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="closed, poisson: output tokens")
    parser.add_argument("--temperature", type=float, default=0.6, help="every request's (0: greedy, cheap on CPU)")
    parser.add_argument("--warmup-requests", type=int, default=32)
    parser.add_argument("--server-timeout-s", type=float, default=600, help="longest wait for the server's /health")
    parser.add_argument("--client-timeout-s", type=float, default=1800, help="longest wait for a client process")
    parser.add_argument("--api-server-counts", default="1",
                        help="comma-separated `serve --api-server-count` values, a server (and rows) each")
    parser.add_argument("--log-dir", default=None, help="keep the server's log here (default: a temp dir)")
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(parser, raw_argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.paths = [p for p in args.paths.split(",") if p]
    for option, given, known in (("--workloads", args.workloads, WORKLOADS), ("--paths", args.paths, PATHS)):
        if set(given) - set(known):
            parser.error(f"{option}: unknown {sorted(set(given) - set(known))}; choose from {list(known)}")
    try:
        args.api_server_counts = [int(c) for c in args.api_server_counts.split(",") if c]
    except ValueError:
        parser.error(f"--api-server-counts: expected comma-separated integers, got {args.api_server_counts!r}")
    if not args.api_server_counts or min(args.api_server_counts) < 1:
        parser.error("--api-server-counts: each must be >= 1")
    if args.client_processes < 1:
        parser.error("--client-processes: must be >= 1")
    report = Report("http", args)
    work = workloads(args)
    with checkpoint_from_args(args) as model_dir:
        if args.paths == ["in-process"]:
            asyncio.run(run_in_process(args, model_dir, work, report))
        else:
            if "in-process" in args.paths:  # first, in its own process, gone before the server starts
                for row in in_process_child(raw_argv, model_dir):
                    report.add(row)
            run_server_paths(args, model_dir, work, report)
    rows = report.data["results"]
    for name, value in (("tok_s_vs_in_process", "output_tok_s"), ("ttft_p50_vs_in_process", "ttft_p50_ms"),
                        ("itl_p99_vs_in_process", "itl_p99_ms")):
        add_ratios(rows, name, value, {"path": "in-process"}, ("workload",))
    report.finish(f"Through the HTTP server, {args.shape}, {args.backend}, {args.client_processes} client processes "
                  "(latencies in ms)", COLUMNS)
    return report.data


if __name__ == "__main__":
    main()
