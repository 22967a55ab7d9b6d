"""Top-k / top-p / min-p: the sort-free cutoff kernels against sorting, on Qwen3's vocabulary. CUDA only.

    python benchmarks/bench_filters.py [--batches 1,64,256] [--dtype bf16] [--sweep] [--json PATH]

Each row times one call with triton.testing.do_bench (median, cold L2) on (3 * randn) logits, as
benchmarks/bench_sampler.py draws them, at temperature 0.6 unless the case says otherwise:
- sort-based: the sampler's path (logits / T, layers/sampler._apply_top_k_top_p, min-p on the
  softmax), when the sampler still has it;
- reference: layers/sampling_filters.filter_cutoffs_reference (sorts the filtered rows);
- kernels: kernels/sampling_filters.filter_cutoffs (two launches), and the same captured in a CUDA
  graph (do_bench_cudagraph: no host launch cost);
- whole rows: how many rows did not find their cutoff among the cached candidates and searched
  their whole row (the slow path; "flat" is a case made to take it).
--sweep also times the kernels for other (CHUNK, PER_CHUNK) settings.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncllm.kernels import sampling_filters as kernels  # noqa: E402
from asyncllm.layers import sampler  # noqa: E402
from asyncllm.layers.sampling_filters import filter_cutoffs_reference  # noqa: E402

VOCAB = 151936
SWEEP = [(1024, 16), (2048, 32), (2048, 64), (4096, 64)]


def cases(batch: int, device: torch.device):
    """(name, temperatures, top_ks, top_ps, min_ps)."""
    def full(value, dtype=torch.float32):
        return torch.full((batch,), value, dtype=dtype, device=device)
    yield "top-k 50 + top-p 0.9", full(0.6), full(50, torch.int64), full(0.9), None
    yield "top-p 0.95", full(0.6), None, full(0.95), None
    yield "min-p 0.05", full(0.6), None, None, full(0.05)
    yield "top-k 50", full(0.6), full(50, torch.int64), None, None
    yield "flat: T 1.5, top-p 0.95", full(1.5), None, full(0.95), None


def sort_based(logits, temperatures, top_ks, top_ps, min_ps):
    z = logits.float() / temperatures.unsqueeze(1)
    if top_ks is not None or top_ps is not None:
        z = sampler._apply_top_k_top_p(z, top_ks, top_ps)
    if min_ps is not None:
        probs = z.softmax(dim=-1)
        z = z.masked_fill(probs < min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return z


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


def time_kernels(logits, limits):
    """(ms, ms in a CUDA graph, rows that searched their whole row)."""
    workspace = kernels.filter_workspace(*logits.shape, logits.device)
    out = torch.empty(len(logits), device=logits.device)

    def call():
        kernels.filter_cutoffs(logits, *limits, out=out, workspace=workspace)
    call()
    whole = int(kernels.searched_whole_rows(workspace).sum())
    ms = median_ms(call)
    graph_ms = triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median")
    return ms, graph_ms, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--sweep", action="store_true", help="also time other (CHUNK, PER_CHUNK) settings")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    has_sort_path = hasattr(sampler, "_apply_top_k_top_p")
    default = kernels.CHUNK, kernels.PER_CHUNK
    results = []
    torch.manual_seed(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        logits = (3 * torch.randn(batch, VOCAB, device=device)).to(dtype)
        for name, *limits in cases(batch, device):
            row = dict(batch=batch, case=name)
            with torch.inference_mode():
                if has_sort_path:
                    row["sort_ms"] = median_ms(lambda: sort_based(logits, *limits))
                row["reference_ms"] = median_ms(lambda: filter_cutoffs_reference(logits, *limits))
                for chunk, per_chunk in [default] + (SWEEP if args.sweep else []):
                    kernels.CHUNK, kernels.PER_CHUNK = chunk, per_chunk
                    key = "" if (chunk, per_chunk) == default else f"@{chunk}/{per_chunk}"
                    row["kernels_ms" + key], row["graph_ms" + key], row["whole_rows" + key] = time_kernels(
                        logits, limits)
                kernels.CHUNK, kernels.PER_CHUNK = default
            results.append(row)
            print(f"batch {batch:4d}  {name:28s} " + "  ".join(
                f"{k} {v * 1000:.1f} us" if k.endswith("_ms") or "_ms@" in k else f"{k} {v}"
                for k, v in row.items() if k not in ("batch", "case")), flush=True)
    columns = [k for k in results[0] if k not in ("batch", "case")]
    print(f"\nlogits {args.dtype}, vocabulary {VOCAB}; times in us (median); whole rows: of the batch\n")
    print("| case | batch | " + " | ".join(c.replace("_ms", " (us)") for c in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for r in results:
        print(f"| {r['case']} | {r['batch']} | " + " | ".join(
            f"{r[c] * 1000:.1f}" if "_ms" in c else str(r[c]) for c in columns) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
