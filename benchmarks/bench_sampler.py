"""The sampler's device time per step, by feature and batch size, on Qwen3's vocabulary. CUDA only.

    python benchmarks/bench_sampler.py [--batches 1,64,256] [--json PATH]

Each row times one Sampler call on bf16 logits (everything after the model's logits: the float cast,
adjustments, masks, temperature, top-k/p, the exponential race, log-probabilities) with
triton.testing.do_bench (median, cold L2). Rows: greedy; sampled (temperature 0.6) with the one-read
kernel (kernels/logits_ops.sample) and with the PyTorch race it replaces; sampled with top-k 50 +
top-p 0.9 (the cutoff kernels of kernels/sampling_filters.py, and the sort-based reference) and
with top-p 0.95 alone; with penalties (presence, frequency, repetition; the Triton kernel, and the PyTorch path);
with logprobs=5 (kernels/logits_ops.chunked_logprobs from ONE_READ_LOGPROBS_MIN_ROWS rows, the same at
any size, and log_softmax + torch.topk); with penalties and logprobs=5 together (issue 19's workload);
with a grammar's bitmask on every row (the Triton kernel, and the PyTorch unpacking). "PyTorch" rows
switch every logits kernel off.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from asyncllm.layers import logits_adjustments, sampler as sampler_module, sampling_filters
from asyncllm.layers.logits_adjustments import LogitsAdjustments, TokenCounts
from asyncllm.layers.sampler import Sampler, SamplingTensors, gather_logprobs, log_softmax_logprobs

VOCAB = 151936


def cases(batch: int, device: torch.device):
    ones = torch.ones(batch, device=device)
    rows = torch.arange(batch, device=device)

    def sampled(**extra):
        return SamplingTensors(temperatures=ones * 0.6, top_ks=None, top_ps=None, min_ps=None,
                               seeded_rows=[], all_greedy=False, keys=rows * 7919, **extra)

    counts = TokenCounts(VOCAB, device)
    slots = torch.tensor([counts.acquire(torch.randint(0, VOCAB, (512,)).tolist(),
                                         torch.randint(0, VOCAB, (256,)).tolist()) for _ in range(batch)], device=device)
    penalties = LogitsAdjustments(penalty_rows=rows, penalty_slots=slots, presence=ones * 0.5, frequency=ones * 0.5,
                                  repetition=ones * 1.1, token_counts=counts)
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, (VOCAB + 31) // 32), dtype=torch.int32, device=device)
    yield "greedy", SamplingTensors(None, None, None, None, [], True), None
    yield "sampled (one-read kernel)", sampled(), None
    yield "sampled (PyTorch race)", sampled(), "no-kernels"
    yield "sampled, top-k 50 + top-p 0.9 (kernels)", sampled(), dict(top_ks=(ones * 50).long(), top_ps=ones * 0.9)
    yield "sampled, top-k 50 + top-p 0.9 (PyTorch)", sampled(), dict(top_ks=(ones * 50).long(), top_ps=ones * 0.9,
                                                                     variant="no-kernels")
    yield "sampled, top-p 0.95 (kernels)", sampled(), dict(top_ps=ones * 0.95)
    yield "sampled + penalties (kernels)", sampled(adjustments=penalties), None
    yield "sampled + penalties (PyTorch)", sampled(adjustments=penalties), "no-kernels"
    yield "sampled + logprobs=5 (kernels)", sampled(logprob_rows=rows, num_top_logprobs=5), None
    yield "sampled + logprobs=5 (chunked_logprobs at any size)", sampled(logprob_rows=rows, num_top_logprobs=5), \
        "one-read-logprobs"
    yield "sampled + logprobs=5 (log_softmax + topk)", sampled(logprob_rows=rows, num_top_logprobs=5), \
        "torch-logprobs"
    yield "sampled + penalties + logprobs=5 (kernels)", sampled(adjustments=penalties, logprob_rows=rows,
                                                                num_top_logprobs=5), None
    yield "sampled + bitmask (kernel)", sampled(mask_rows=rows, token_bitmask=bitmask), None
    yield "sampled + bitmask (PyTorch)", sampled(mask_rows=rows, token_bitmask=bitmask), "no-kernels"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default="", help="comma-separated case names (substrings) to run under "
                        "torch.profiler: a table of host and device time per op, at each batch")
    args = parser.parse_args()
    device = torch.device("cuda")
    sampler = Sampler()
    results = []
    kernels_for = logits_adjustments.logits_ops_for
    one_read_min_rows = sampler_module.ONE_READ_LOGPROBS_MIN_ROWS
    for batch in [int(b) for b in args.batches.split(",")]:
        logits = (3 * torch.randn(batch, VOCAB, device=device)).to(torch.bfloat16)
        for name, params, variant in cases(batch, device):
            if isinstance(variant, dict):
                for key, value in variant.items():
                    if key != "variant":
                        setattr(params, key, value)
                variant = variant.get("variant")
            logits_adjustments.logits_ops_for = sampler_module.logits_ops_for = (
                (lambda x: None) if variant == "no-kernels" else kernels_for)
            sampler_module.filter_cutoffs = (sampling_filters.filter_cutoffs_reference if variant == "no-kernels"
                                             else sampling_filters.filter_cutoffs)
            sampler_module.gather_logprobs = log_softmax_logprobs if variant == "torch-logprobs" else gather_logprobs
            sampler_module.ONE_READ_LOGPROBS_MIN_ROWS = 1 if variant == "one-read-logprobs" else one_read_min_rows
            with torch.inference_mode():
                ms = triton.testing.do_bench(lambda: sampler(logits, params), warmup=20, rep=100, return_mode="median")
            results.append(dict(batch=batch, case=name, ms=ms))
            print(f"batch {batch:4d}  {name:48s} {ms * 1000:9.1f} us", flush=True)
            if any(part and part in name for part in args.profile.split(",")):
                profile(lambda: sampler(logits, params), f"batch {batch}, {name}")
    logits_adjustments.logits_ops_for = sampler_module.logits_ops_for = kernels_for
    sampler_module.filter_cutoffs = sampling_filters.filter_cutoffs
    sampler_module.gather_logprobs = gather_logprobs
    sampler_module.ONE_READ_LOGPROBS_MIN_ROWS = one_read_min_rows
    print("\n| case | " + " | ".join(f"batch {b} (us)" for b in args.batches.split(",")) + " |")
    print("|---|" + "---|" * len(args.batches.split(",")))
    for name in dict.fromkeys(r["case"] for r in results):
        print(f"| {name} | " + " | ".join(f"{r['ms'] * 1000:.1f}" for r in results if r["case"] == name) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def profile(fn, title: str, steps: int = 10) -> None:
    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
    print(f"\n#### {title}: {steps} calls")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))


if __name__ == "__main__":
    main()
