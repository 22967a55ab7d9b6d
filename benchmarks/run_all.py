"""Every benchmark in one command, within a fixed time budget (9 minutes; 6.5 used on an H200).

    python benchmarks/run_all.py --out DIR [--quick] [--skip-8b] [--device cpu]

Builds random-weight Qwen3 checkpoints (0.6B, and 8B unless --skip-8b) in a temporary directory,
then runs each benchmark as a subprocess with its own timeout, most important first; a step that
runs out of time is killed and reported as "skipped: timeout" (whatever it finished is kept: the
scripts rewrite their JSON after every result). Writes DIR/<step>.json, DIR/logs/<step>.log,
DIR/serving.png, and DIR/summary.md (the headline figures against their targets, then every
benchmark's table), and prints the headline table last. On CPU it runs the tiny shape with tiny
sizes and skips the 8B model and the kernel benchmark.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from common import format_table

HERE = os.path.dirname(os.path.abspath(__file__))

# per-benchmark size arguments: full GPU run, --quick GPU run, CPU smoke run
SIZES = {
    "throughput": {"full": [], "quick": ["--num-requests", "64"],
                   "cpu": ["--num-requests", "8", "--max-input", "64", "--max-output", "16"]},
    "latency": {"full": [], "quick": ["--reps", "5", "--tpot-reps", "2"],
                "cpu": ["--reps", "3", "--tpot-tokens", "16", "--tpot-reps", "2"]},
    "serving": {"full": [], "quick": ["--concurrency", "1,16,64", "--rates", "40", "--requests-per-rate", "32"],
                "cpu": ["--concurrency", "1,4", "--rates", "20", "--requests-per-rate", "8", "--input-len", "64",
                        "--output-len", "8"]},
    "profile": {"full": [], "quick": ["--reps", "5", "--workload", "64"],
                "cpu": ["--reps", "2", "--batch", "4", "--context", "32", "--workload", "4"]},
    "embed": {"full": [], "quick": ["--num-texts", "256", "--streams", "16"],
              "cpu": ["--num-texts", "8", "--text-len", "32", "--streams", "2", "--stream-tokens", "8"]},
    "spec": {"full": [], "quick": ["--batches", "1,8", "--output-len", "128", "--reps", "2"],
             "cpu": ["--batches", "1", "--output-len", "16", "--reps", "1"]},
    "hf": {"full": ["--max-output", "512", "--tpot-tokens", "64", "--tpot-reps", "1", "--compile"],
           "quick": ["--num-requests", "8", "--max-output", "256", "--reps", "3", "--compile"],
           "cpu": ["--num-requests", "4", "--max-input", "64", "--max-output", "16", "--reps", "3",
                   "--tpot-tokens", "16"]},
}


@dataclass
class Step:
    name: str
    argv: list[str]  # script and its arguments, run with this Python
    budget_s: float
    needs: str | None = None  # the checkpoint step this one depends on
    status: str = "not run"
    seconds: float = 0.0


def fa4_installed() -> bool:
    """flash_attn.cute present, found without importing it (its import can take seconds and touch the GPU)."""
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and any(os.path.isdir(os.path.join(p, "cute"))
                                    for p in spec.submodule_search_locations or [])


def plan(args, ckpt: dict[str, str]) -> list[Step]:
    size = "cpu" if args.device == "cpu" else ("quick" if args.quick else "full")
    small = args.small
    out = args.out

    scale = 2 if args.device == "cpu" else 1  # per-step budgets below are for the GPU

    def bench(name: str, kind: str, shape: str, budget: float, *extra: str) -> Step:
        argv = [os.path.join(HERE, f"bench_{kind}.py"), "--device", args.device, "--shape", shape,
                "--model-dir", ckpt[shape], "--json", os.path.join(out, f"{name}.json"), *SIZES[kind][size], *extra]
        return Step(name, argv, budget * scale, needs=f"build-{shape}")

    def build(shape: str, budget: float) -> Step:
        return Step(f"build-{shape}", [os.path.join(HERE, "common.py"), "--shape", shape, "--out", ckpt[shape],
                                       "--device", args.device], budget * scale)

    backend = "triton" if args.device == "cuda" else "torch"
    # the engine's defaults (a bounded step time) against throughput first, on the same workload
    serving_budget = ["--target-step-ms", "default,none"]
    steps = [build(small, 90),
             # sync, stream and generate, overlapped and not: six processes, one after another
             bench(f"throughput-{small}", "throughput", small, 200, "--backends", backend, "--mode", "all",
                   "--overlap", "both"),
             # the same offline workload with n-gram speculation beside none (issue 46: no loss), sync
             bench(f"throughput-{small}-ngram", "throughput", small, 80, "--backends", backend, "--mode", "sync",
                   "--spec-modes", "none,ngram"),
             bench(f"latency-{small}", "latency", small, 60, "--backend", backend),
             bench(f"serving-{small}", "serving", small, 90, "--backend", backend, *serving_budget,
                   "--plot", os.path.join(out, "serving.png")),
             bench(f"embed-{small}", "embed", small, 60, "--backend", backend)]
    if args.device == "cuda" and fa4_installed():
        # the FA4 backend on workloads 1-3, smaller: the comparison, not every point again
        steps += [bench(f"throughput-{small}-fa4", "throughput", small, 60, "--backends", "fa4", "--mode", "sync"),
                  bench(f"latency-{small}-fa4", "latency", small, 40, "--backend", "fa4", "--reps", "5"),
                  bench(f"serving-{small}-fa4", "serving", small, 60, "--backend", "fa4", *serving_budget,
                        *SIZES["serving"]["quick"])]
    if args.big:
        steps += [build("8b", 120), bench("latency-8b", "latency", "8b", 75, "--backend", backend)]
    if not args.skip_hf:
        steps.append(bench(f"hf-{small}", "hf", small, 140))
    if args.big:
        steps.append(bench("throughput-8b", "throughput", "8b", 90, "--backends", backend, "--mode", "sync"))
    if args.big and args.tensor_parallel > 1:
        # the 8B sharded over N GPUs beside the one-GPU figures above (sync and async)
        tp = ["--tensor-parallel-size", str(args.tensor_parallel)]
        steps += [bench(f"latency-8b-tp{args.tensor_parallel}", "latency", "8b", 90, "--backend", backend, *tp),
                  bench(f"throughput-8b-tp{args.tensor_parallel}", "throughput", "8b", 120, "--backends", backend,
                        "--mode", "sync,generate", *tp)]
    # where the time of a step goes (host parts, device time, kernels): the "why" behind the figures
    steps.append(bench(f"profile-{small}", "profile", small, 70, "--backend", backend))
    # speculative decoding on the SmolLM2 copy task (the shipped weights, not a shape's checkpoint)
    steps.append(Step("spec-smollm2", [os.path.join(HERE, "bench_spec.py"), "--device", args.device,
                                       "--json", os.path.join(out, "spec-smollm2.json"), *SIZES["spec"][size]],
                      220 * scale))  # five modes: plain, ngram, draft = target, random draft, oracle
    kernels = os.path.join(HERE, "bench_kernels.py")
    if args.device == "cuda" and os.path.exists(kernels) and not args.skip_kernels:
        with open(kernels) as f:
            budget_flag = ["--budget-s", "30"] if "--budget-s" in f.read() else []
        steps.append(Step("kernels", [kernels, "--json", os.path.join(out, "kernels.json"), *budget_flag], 75))
    return steps


def run_step(step: Step, deadline: float, log_dir: str, failed: set[str]) -> None:
    timeout = min(step.budget_s, deadline - time.monotonic())
    if step.needs in failed:
        step.status = f"skipped: {step.needs} failed"
    elif timeout < 15:
        step.status = "skipped: no time left"
    if step.status != "not run":
        failed.add(step.name)
        print(f"[{step.status}] {step.name}", flush=True)
        return
    log_path = os.path.join(log_dir, f"{step.name}.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *step.argv], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            step.status = "ok" if rc == 0 else f"error (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the benchmark and anything it started
            proc.wait()
            step.status = "skipped: timeout"
    step.seconds = time.monotonic() - start
    if step.status != "ok":
        failed.add(step.name)
    print(f"[{step.status}] {step.name} ({step.seconds:.0f} s of {timeout:.0f})", flush=True)
    if step.status.startswith("error"):
        with open(log_path) as f:
            print("".join(f.readlines()[-8:]), end="", flush=True)


# ---- the summary ----------------------------------------------------------------------------------------
def load_results(out: str) -> dict[str, dict]:
    results = {}
    for name in os.listdir(out):
        if name.endswith(".json"):
            try:
                with open(os.path.join(out, name)) as f:
                    results[name[:-5]] = json.load(f)
            except (OSError, json.JSONDecodeError):
                pass
    return results


def pick(results: dict, step: str, key: str, **match):
    """results[step]'s first row matching `match`, its `key`; None when absent."""
    for row in results.get(step, {}).get("results", []):
        if all(row.get(k) == v for k, v in match.items()) and row.get(key) is not None:
            return row[key]
    return None


def headline(results: dict, small: str, big: bool) -> list[dict]:
    """The key figures. The targets are for the 0.6B and 8B models on an H200; a tiny CPU run shows none."""
    rows = []

    def add(metric, value, target=None, fmt="{:.2f}", note=""):
        target = target if small == "0.6b" else None
        check = "-"
        if target is not None and value is not None:
            op, bound = target
            check = "PASS" if (value >= bound if op == ">=" else value <= bound) else "MISS"
        rows.append(dict(metric=metric, value=None if value is None else fmt.format(value),
                         target="" if target is None else f"{target[0]} {target[1]:,}", check=check, note=note))

    spec_step = f"throughput-{small}-ngram"  # its own headline rows, below
    for name in sorted(n for n in results if n.startswith(f"throughput-{small}") and n != spec_step):
        for row in results[name]["results"]:
            overlap = row.get("overlap", "auto")
            metric = f"{small} throughput, {row['backend']}, {row['mode']}, overlap {overlap} (tok/s)"
            if "error" in row:
                add(metric, None, note=row["error"][:80])
                continue
            headline_row = row["backend"] == "triton" and overlap != "off"
            target = (">=", 24000) if headline_row and row["mode"] == "sync" else None
            add(metric, row["throughput_tok_s"], target, "{:,.0f}",
                f"{row['num_requests']} req, {row['num_preemptions']} preemptions")
            if row.get("sync_ratio") is not None and row["mode"] != "sync":
                ratio_target = {"stream": (">=", 0.95), "generate": (">=", 0.97)}.get(row["mode"]) if headline_row \
                    else None
                add(f"{row['mode']}/sync, {row['backend']}, overlap {overlap}", row["sync_ratio"], ratio_target,
                    "{:.3f}")
    ngram_tok_s = pick(results, spec_step, "throughput_tok_s", spec="ngram")
    share = pick(results, spec_step, "speculating_share", spec="ngram")
    # "no loss", read as within one run's noise (~2 %)
    add(f"{small} throughput, sync, n-gram speculation / none (offline workload)",
        pick(results, spec_step, "spec_ratio", spec="ngram"), (">=", 0.98), "{:.3f}",
        ", ".join(x for x in ("" if ngram_tok_s is None else f"{ngram_tok_s:,.0f} tok/s",
                              "" if share is None else f"speculating share {share:.3f}") if x))
    shapes = [(small, 1.0)] + ([("8b", 4.0)] if big else [])
    if big:
        add("8b throughput, sync (tok/s)", pick(results, "throughput-8b", "throughput_tok_s", mode="sync"), None,
            "{:,.0f}")
    tp1_throughput = pick(results, "throughput-8b", "throughput_tok_s", mode="sync")
    tp1_tpot = pick(results, "latency-8b", "median_ms", metric="TPOT")
    for name in sorted(n for n in results if n.startswith("throughput-8b-tp")):
        for row in results[name]["results"]:
            value = row.get("throughput_tok_s")
            add(f"8b throughput, TP={row.get('tensor_parallel_size')}, {row['mode']} (tok/s)", value, None, "{:,.0f}",
                row.get("error", "")[:80] or (f"{value / tp1_throughput:.2f}x TP=1 sync" if value and tp1_throughput else ""))
    for name in sorted(n for n in results if n.startswith("latency-8b-tp")):
        tp_size = name.rsplit("tp", 1)[1]
        tpot = pick(results, name, "median_ms", metric="TPOT")
        util = pick(results, name, "bandwidth_util", metric="TPOT")
        add(f"TPOT batch 1, 8b, TP={tp_size} (ms)", tpot, None, "{:.3f}",
            ", ".join(x for x in ("" if util is None else f"{util:.0%} of copy bandwidth per GPU",
                                  f"{tp1_tpot / tpot:.2f}x TP=1" if tpot and tp1_tpot else "") if x))
        for prompt_len in (128, 1024):
            add(f"TTFT {prompt_len}-token prompt, 8b, TP={tp_size} (ms)",
                pick(results, name, "median_ms", metric="TTFT", prompt_len=prompt_len))
    for shape, bound in shapes:
        util = pick(results, f"latency-{shape}", "bandwidth_util", metric="TPOT")
        add(f"TPOT batch 1, {shape} (ms)", pick(results, f"latency-{shape}", "median_ms", metric="TPOT"),
            ("<=", bound), "{:.3f}", "" if util is None else f"{util:.0%} of copy bandwidth")
    sync_tpot = pick(results, f"latency-{small}", "median_ms", metric="TPOT")
    stream_tpot = pick(results, f"latency-{small}", "median_ms", metric="TPOT (stream)")
    add(f"TPOT batch 1 through stream(), {small} (ms)", stream_tpot, None, "{:.3f}",
        "" if None in (sync_tpot, stream_tpot) else f"{stream_tpot - sync_tpot:+.3f} ms vs LLM.generate (target <= +0.05)")
    for shape, _ in shapes:
        for prompt_len, target in ((128, ("<=", 12) if shape == small else None), (1024, None)):
            add(f"TTFT {prompt_len}-token prompt, {shape} (ms)",
                pick(results, f"latency-{shape}", "median_ms", metric="TTFT", prompt_len=prompt_len), target)
    add(f"embeddings, {small}, LLM.embed, last pooling (tok/s)",
        pick(results, f"embed-{small}", "embed_tokens_s", row="sync", pooling="last"), (">=", 50000), "{:,.0f}")
    alone = pick(results, f"embed-{small}", "itl_p99_ms", row="streams", pooling="last")
    add("ITL p99 of streams beside AsyncLLMEngine.embed (ms)",
        pick(results, f"embed-{small}", "itl_p99_ms", row="async+streams", pooling="last"), None, "{:.2f}",
        "" if alone is None else f"{alone:.2f} alone")
    add("ITL p99 at concurrency 64 (ms)",
        pick(results, f"serving-{small}", "itl_p99_ms", load="concurrency", level=64), ("<=", 10))
    hf_requests = pick(results, f"hf-{small}", "num_requests", part="generate_batch")
    add("HF continuous batching (tok/s)", pick(results, f"hf-{small}", "output_tok_s", part="generate_batch"), None,
        "{:,.0f}", f"{hf_requests} req, for scale" if hf_requests else "for scale")
    add("HF generate TPOT batch 1 (ms)", pick(results, f"hf-{small}", "tpot_ms", part="generate batch 1"), None,
        "{:.2f}", "for scale")
    same = pick(results, "spec-smollm2", "same_text", mode="ngram", batch=1)
    add("speculative decoding (n-gram), SmolLM2 copy task, batch 1: speedup over plain",
        pick(results, "spec-smollm2", "speedup", mode="ngram", batch=1), (">=", 2.0), "{:.2f}x",
        "" if same is None else f"same text: {same}")
    same = pick(results, "spec-smollm2", "same_text", mode="oracle", batch=1)
    acceptance = pick(results, "spec-smollm2", "acceptance_rate", mode="oracle", batch=1)
    # every proposal accepted at no proposing cost: what the issue's "draft equal to the target" row meant
    add("speculative decoding, oracle proposer (the mechanism's ceiling), SmolLM2 copy task, batch 1: speedup",
        pick(results, "spec-smollm2", "speedup", mode="oracle", batch=1), (">=", 3.0), "{:.2f}x",
        ", ".join(x for x in ("" if acceptance is None else f"acceptance {acceptance:.2f}",
                              "" if same is None else f"same text: {same}") if x))
    add("HF generate TPOT batch 1, static cache + torch.compile (ms)",
        pick(results, f"hf-{small}", "tpot_ms", part="generate batch 1, static cache, torch.compile"), None, "{:.2f}",
        "the torch.compile baseline")
    return rows


def write_summary(args, steps: list[Step], results: dict, table: str) -> None:
    env = next((r["env"] for r in results.values() if "env" in r), {})
    step_rows = [dict(step=s.name, status=s.status, seconds=round(s.seconds)) for s in steps]
    parts = ["# asyncllm benchmarks", "", ", ".join(f"{k} {v}" for k, v in env.items()), "", "## Headline", "", table,
             "", "## Steps", "", format_table(step_rows, [("step", "step"), ("status", "status"), ("s", "seconds")])]
    order = ["throughput", "latency", "serving", "embed", "hf", "kernels"]  # then the rest, by name
    for name in sorted(results, key=lambda n: (next((i for i, k in enumerate(order) if n.startswith(k)), 99), n)):
        data = results[name]
        if data.get("table"):
            parts += ["", data["table"]]
        elif data.get("results"):  # a benchmark that keeps no table of its own (bench_kernels.py)
            keys = list(data["results"][0])
            parts += ["", f"### {name}", "", format_table(data["results"], [(k, k, "{:.4g}") for k in keys])]
    if os.path.exists(os.path.join(args.out, "serving.png")):
        parts += ["", "![TTFT and ITL against concurrency](serving.png)"]
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(parts) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSON files, logs, plot and summary.md")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (always on, and tinier, on CPU)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--skip-8b", action="store_true", help="no 8B checkpoint, latency or throughput")
    parser.add_argument("--skip-hf", action="store_true", help="no Hugging Face comparison")
    parser.add_argument("--skip-kernels", action="store_true", help="do not run bench_kernels.py")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="N > 1: also the 8B latency and throughput sharded over N GPUs (steps latency-8b-tpN, "
                             "throughput-8b-tpN)")
    parser.add_argument("--total-budget-s", type=float, default=None,
                        help="stop starting steps past this many seconds (default 540 on CUDA, 900 on CPU)")
    parser.add_argument("--checkpoints", default=None,
                        help="where to build (or find) the checkpoints; default: a temp dir, removed at the end")
    parser.add_argument("--only", default=None,
                        help="comma-separated step names to run (and the checkpoint builds they need), e.g. "
                             "latency-8b,kernels; the summary also reads the JSON already in --out")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = args.total_budget_s or (540.0 if args.device == "cuda" else 900.0)
    deadline = time.monotonic() + budget
    args.out = os.path.abspath(args.out)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    root = os.path.abspath(args.checkpoints or tempfile.mkdtemp(prefix="asyncllm-ckpt-"))
    args.small = small = "tiny" if args.device == "cpu" else "0.6b"  # the model most steps use
    args.big = args.device == "cuda" and not args.skip_8b  # and the 8B
    ckpt = {shape: os.path.join(root, shape) for shape in (small, "8b")}
    steps = plan(args, ckpt)
    if args.only:
        wanted = set(args.only.split(","))
        needed = {s.needs for s in steps if s.name in wanted}
        steps = [s for s in steps if s.name in wanted or s.name in needed]
    print(f"{len(steps)} steps, {budget:.0f} s budget, device {args.device}, checkpoints in {root}", flush=True)
    for step in steps:  # no stale figures from an earlier run in the same directory
        stale = os.path.join(args.out, f"{step.name}.json")
        if os.path.exists(stale):
            os.remove(stale)
    failed: set[str] = set()
    try:
        for step in steps:
            run_step(step, deadline, os.path.join(args.out, "logs"), failed)
    finally:
        if args.checkpoints is None:
            shutil.rmtree(root, ignore_errors=True)
    results = load_results(args.out)
    columns = [("metric", "metric"), ("value", "value"), ("target", "target"), ("check", "check"), ("note", "note")]
    table = format_table(headline(results, small, args.big), columns)
    write_summary(args, steps, results, table)
    print("\nsteps: " + ", ".join(f"{s.name} {s.status}" for s in steps))
    print(f"results in {args.out} (summary.md, *.json, logs/)\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
