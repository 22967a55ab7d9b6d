"""Batch-1 latency through LLM.generate: time to first token and time per output token.

    python benchmarks/bench_latency.py [--shape 0.6b|8b] [--backend triton] [--skinny-gemm on|off|both]
                                       [--json PATH]

TTFT: wall time of generate([prompt], max_tokens=1, greedy) for 128- and 1024-token prompts,
median of --reps after a warm-up. TPOT: (time of max_tokens=N+1 - time of max_tokens=1) / N for a
--tpot-prompt-len prompt, median of --tpot-reps, at each of --temperatures (greedy and sampled at
0.6 by default: sampling runs after the CUDA graph). On CUDA, the batch-1 decode graph's replay
alone (bench_profile.graph_replay_time): the step's device time without sampling or host work.
Every run uses a fresh random prompt, so the prefix cache never serves one. Bandwidth utilisation: the bytes a decode step must read (weights
except the embedding table, plus the lm_head; K and V of the average context) / TPOT, over the
measured device-to-device copy bandwidth. With --tensor-parallel-size N the bytes are one rank's
shard (each GPU reads its own), so the utilisation is per GPU.

TPOT (stream): the same prompt length and N through one `async for out in engine.stream(...)` of an
AsyncLLMEngine (started after the LLM is gone): (time of the last item - time of the first) / the
tokens after the first -- what a chat app's single user sees; at each temperature too.

--skinny-gemm: decode's linear layers through the skinny-GEMM kernel where it beats cuBLAS (on, the
engine's default), or cuBLAS only (off: ASYNCLLM_SKINNY_GEMM=0); both runs each setting in its own
process, one after the other, on one checkpoint, and the table gives each row's ratio to off's.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from bench_profile import graph_replay_time
from common import (Report, add_engine_args, add_ratios, checkpoint_from_args, engine_kwargs, make_parser,
                    measure_copy_bandwidth, median, ms, parse_args, random_prompt, release_memory, strip_options,
                    timed)

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.layers import skinny_linear


def weight_bytes_per_step(model) -> int:
    """Parameter bytes a decode step reads: all of them but the embedding table (a lookup reads a few
    rows), with the lm_head counted, once, even when it shares the embedding's tensor."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.model.embed_tokens.weight
    lm_head = getattr(getattr(model, "lm_head", None), "weight", None)
    if lm_head is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(runner) -> int:
    return 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * runner.dtype.itemsize


def generate_time(llm: LLM, rng: random.Random, prompt_len: int, max_tokens: int, device: str,
                  temperature: float = 0.0) -> float:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    prompt = random_prompt(rng, prompt_len)
    return timed(lambda: llm.generate([prompt], params, use_tqdm=False), device)[1]


async def stream_tpots(model_dir: str, kwargs: dict, rng: random.Random, prompt_len: int, num_tokens: int,
                       reps: int, temperatures: list[float]) -> dict[float, list[float]]:
    async with AsyncLLMEngine(model_dir, **kwargs) as engine:
        await engine.generate(random_prompt(rng, prompt_len), SamplingParams(max_tokens=8, ignore_eos=True))
        return {t: await stream_tpot_runs(engine, rng, prompt_len, num_tokens, reps, t) for t in temperatures}


async def stream_tpot_runs(engine: AsyncLLMEngine, rng: random.Random, prompt_len: int, num_tokens: int, reps: int,
                           temperature: float) -> list[float]:
    params = SamplingParams(temperature=temperature, max_tokens=num_tokens + 1, ignore_eos=True)
    tpots = []
    for _ in range(reps):
        first = last = None
        count = 0
        async for out in engine.stream(random_prompt(rng, prompt_len), params):
            last = time.perf_counter()
            if first is None:
                first, count = last, len(out.token_ids) - 1
            else:
                count += len(out.token_ids)
        tpots.append((last - first) / count)
    return tpots


COLUMNS = [("metric", "metric"), ("skinny GEMM", "skinny_gemm"), ("temperature", "temperature"),
           ("prompt tokens", "prompt_len"),
           ("median (ms)", "median_ms", "{:.3f}"), ("min (ms)", "min_ms", "{:.3f}"), ("/ off", "off_ratio", "{:.3f}"),
           ("runs", "runs"), ("GB/s", "achieved_gb_s", "{:.0f}"), ("bandwidth util.", "bandwidth_util", "{:.1%}")]


def run_in_child(argv: list[str], setting: str, model_dir: str) -> dict:
    """This script with one --skinny-gemm setting, in a fresh process: the setting holds from the
    start (tensor-parallel workers read it from the environment), and no state of one run colours
    the next."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--skinny-gemm", setting,
                        "--model-dir", model_dir, "--json", out], check=False)
        if not os.path.exists(out):
            return dict(results=[dict(metric="-", skinny_gemm=setting, error="the child process wrote no result")])
        with open(out) as f:
            return json.load(f)


def compare_skinny_gemm(raw_argv: list[str], args, report: Report) -> None:
    """--skinny-gemm both: off then on, each in its own process, on one checkpoint."""
    child_argv = strip_options(raw_argv, ("--skinny-gemm", "--model-dir", "--json"))
    model_dir = args.model_dir or tempfile.mkdtemp(prefix=f"asyncllm-bench-{args.shape}-")
    try:
        for setting in ("off", "on"):
            data = run_in_child(child_argv, setting, model_dir)
            if "copy_bandwidth_gb_s" in data:
                report.set("copy_bandwidth_gb_s", data["copy_bandwidth_gb_s"])
            for row in data["results"]:
                report.add(row)
    finally:
        if not args.model_dir:
            shutil.rmtree(model_dir, ignore_errors=True)
    add_ratios(report.data["results"], "off_ratio", "median_ms", {"skinny_gemm": "off"},
               ("metric", "prompt_len", "temperature"))


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--ttft-prompt-lens", default="128,1024", help="comma-separated prompt lengths")
    parser.add_argument("--reps", type=int, default=10, help="TTFT runs per prompt length")
    parser.add_argument("--tpot-tokens", type=int, default=128, help="N: output tokens timed for TPOT")
    parser.add_argument("--tpot-prompt-len", type=int, default=128)
    parser.add_argument("--tpot-reps", type=int, default=3)
    parser.add_argument("--temperatures", default="0,0.6",
                        help="comma-separated sampling temperatures of the TPOT rows (0: greedy)")
    parser.add_argument("--skinny-gemm", default="on", choices=["on", "off", "both"],
                        help="decode's linear layers through the skinny-GEMM kernel where it is faster (on), cuBLAS "
                             "only (off), or each in its own process (both)")
    parser.add_argument("--skinny-choices", default=None, metavar="JSON",
                        help="take the skinny-GEMM tilings another run chose (its --json's skinny_gemm_choices, or "
                             "that mapping alone), settled: nothing timed or tuned for those shapes (bf16)")
    parser.set_defaults(max_num_seqs=8)  # batch 1 only: fewer CUDA graphs to capture at start-up
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(parser, raw_argv)
    report = Report("latency", args)
    tp = f", TP={args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    if args.skinny_gemm == "both":
        compare_skinny_gemm(raw_argv, args, report)
        copy_gb_s = report.data.get("copy_bandwidth_gb_s", 0)
        report.finish(f"Batch-1 latency, {args.shape}, {args.backend}{tp}, skinny GEMM off and on "
                      f"(copy bandwidth {copy_gb_s:,.0f} GB/s)", COLUMNS)
        return report.data
    os.environ["ASYNCLLM_SKINNY_GEMM"] = "1" if args.skinny_gemm == "on" else "0"  # for tensor-parallel workers
    skinny_linear.set_enabled(args.skinny_gemm == "on")
    if args.skinny_choices:  # e.g. whether one tree's batch-1 time is its code or its start-up's timed choices
        with open(args.skinny_choices) as f:
            described = json.load(f)
        described = described.get("skinny_gemm_choices", described)
        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)  # x.device's form
        pinned = skinny_linear.pin_choices(described, device, torch.bfloat16)
        print(f"skinny GEMM: {pinned} choices taken from {args.skinny_choices}", flush=True)
    measure(args, report)
    report.finish(f"Batch-1 latency, {args.shape}, {args.backend}{tp}, skinny GEMM {args.skinny_gemm} "
                  f"(copy bandwidth {report.data['copy_bandwidth_gb_s']:,.0f} GB/s)", COLUMNS)
    return report.data


def measure(args, report: Report) -> None:
    prompt_lens = [int(n) for n in args.ttft_prompt_lens.split(",")]
    rng = random.Random(args.seed)
    copy_bw = measure_copy_bandwidth(args.device)
    report.set("copy_bandwidth_gb_s", copy_bw / 1e9)
    setting = dict(skinny_gemm=args.skinny_gemm)
    with checkpoint_from_args(args) as model_dir:
        llm = LLM(model_dir, **engine_kwargs(args, args.backend))
        for n in sorted(set(prompt_lens + [args.tpot_prompt_len])):  # warm-up: every shape, and decode steps
            generate_time(llm, rng, n, 8, args.device)
        report.set("skinny_gemm_choices", skinny_linear.describe_choices())  # rank 0's, made at start-up
        for n in prompt_lens:
            times = [generate_time(llm, rng, n, 1, args.device) for _ in range(args.reps)]
            report.add(dict(metric="TTFT", **setting, prompt_len=n, median_ms=ms(median(times)),
                            min_ms=ms(min(times)), runs=len(times)))
        n = args.tpot_tokens
        temperatures = [float(t) for t in args.temperatures.split(",")]
        runner = llm.core.runner
        weights = weight_bytes_per_step(runner.model)
        kv = kv_bytes_per_token(runner) * (args.tpot_prompt_len + n / 2)  # the average context of the N steps
        for temperature in temperatures:
            tpots = [(generate_time(llm, rng, args.tpot_prompt_len, n + 1, args.device, temperature)
                      - generate_time(llm, rng, args.tpot_prompt_len, 1, args.device, temperature)) / n
                     for _ in range(args.tpot_reps)]
            tpot = median(tpots)
            achieved = (weights + kv) / tpot
            report.add(dict(metric="TPOT", **setting, temperature=temperature, prompt_len=args.tpot_prompt_len,
                            median_ms=ms(tpot), min_ms=ms(min(tpots)), runs=len(tpots), output_tokens=n,
                            weight_bytes=weights, kv_bytes=kv, achieved_gb_s=achieved / 1e9,
                            bandwidth_util=achieved / copy_bw))
        # the graph of the last TPOT run's context
        replay = graph_replay_time(runner, 1, args.tpot_prompt_len + n) if args.device == "cuda" else None
        if replay is not None:  # the batch-1 forward's device time alone: the floor TPOT is held to
            report.add(dict(metric="decode graph replay (device)", **setting, median_ms=ms(replay), runs=1))
        llm = runner = None  # noqa: F841 - the async engine below sizes its KV cache from the memory left
        release_memory()
        streams = asyncio.run(stream_tpots(model_dir, engine_kwargs(args, args.backend), rng, args.tpot_prompt_len, n,
                                           args.tpot_reps, temperatures))
        for temperature, stream in streams.items():
            report.add(dict(metric="TPOT (stream)", **setting, temperature=temperature, prompt_len=args.tpot_prompt_len,
                            median_ms=ms(median(stream)), min_ms=ms(min(stream)), runs=len(stream), output_tokens=n))
        release_memory()


if __name__ == "__main__":
    main()
