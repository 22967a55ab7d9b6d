"""Build-model and load-weights time, the checkpoint read two ways (issue 45's start-up).

    python benchmarks/bench_loading.py --model-dir /tmp/ck06 [--device cpu] [--runs 3]

("python benchmarks/common.py --shape 0.6b --device cpu --out /tmp/ck06" builds a 0.6B-shaped random
checkpoint.) Each run is a fresh process, as an engine's start-up is, and the readers alternate:
"mmap" takes each tensor from safetensors' memory map (the loader on CPU, and on CUDA before the staged
reads), "staged" reads them with large reads into reused buffers, pinned on CUDA (models/staged_reads.py). Both
feed the same load_weights into a model built as ModelRunner builds it. Prints the median of each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as `python benchmarks/x.py` without installing the package
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from asyncllm.models.checkpoint import iter_safetensors, load_hf_config, load_weights  # noqa: E402
from asyncllm.models.registry import create_model  # noqa: E402
from asyncllm.models.staged_reads import StagingBuffers  # noqa: E402


def one_run(model_dir: str, reader: str, device: str) -> dict:
    hf = load_hf_config(model_dir)
    dev = torch.device(device)
    start = time.perf_counter()
    with torch.device(dev):
        model = create_model(hf, dtype=torch.bfloat16)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    built = time.perf_counter()
    staging = StagingBuffers(pin=dev.type == "cuda") if reader == "staged" else None
    weights = iter_safetensors(model_dir, staging)
    load_weights(model, weights)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"reader": reader, "build_s": built - start, "load_s": time.perf_counter() - built}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--runs", type=int, default=3, help="runs of each reader, alternated")
    parser.add_argument("--child", default=None, choices=["mmap", "staged"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.model_dir, args.child, args.device)))
        return
    results = {"mmap": [], "staged": []}
    for run in range(args.runs):
        for reader in results:
            out = subprocess.run([sys.executable, __file__, "--model-dir", args.model_dir, "--device", args.device,
                                  "--child", reader], check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            results[reader].append(row)
            print(f"run {run} {reader:6s} build model {row['build_s']:.3f} s  load weights {row['load_s']:.3f} s",
                  flush=True)
    for reader, rows in results.items():
        print(f"median {reader:6s} build model {statistics.median(r['build_s'] for r in rows):.3f} s  "
              f"load weights {statistics.median(r['load_s'] for r in rows):.3f} s  ({len(rows)} runs, {args.device})")


if __name__ == "__main__":
    main()
