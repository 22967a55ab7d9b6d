"""Decode's skinny GEMMs: our Triton kernel (asyncllm.kernels.skinny_gemm) against cuBLAS. CUDA only.

    python benchmarks/bench_gemm.py [--json results.json] [--rows 1,2,4,8,16] [--sweep] [--tiling-grid]

For each linear layer of Qwen3-0.6B and -8B at TP=1 and each row count: y = x @ W^T in bf16 by
F.linear (cuBLAS, torch's default BLAS), by F.linear with
torch.backends.cuda.preferred_blas_library("cublaslt"), and by ours with the tiling the engine
would pick (the fastest of the candidates it times, asyncllm.layers.skinny_linear). Timing is
triton.testing.do_bench's median, which zeroes a 256 MB buffer before every repetition, so each
call starts from a cold L2, as decode meets its weights; the "graph" columns time cuBLAS and our
best tiling as CUDA-graph replays (skinny_linear.time_calls, as the engine's choice does; decode
runs in graphs, where Triton's Python launch time is gone), also from a cold L2. TB/s counts the weight bytes only (x and
y are a few KB). "err" is the largest absolute difference from the fp32 product, ours and
cuBLAS's. With --sweep, every candidate tiling is timed and listed too (for tuning the rule); with
--tiling-grid, only cuBLAS against a wider grid of tilings than the rule proposes, the best listed.

With --fp8 (default rows 1..256, the 8B shapes): FP8 weights (layers/fp8_linear.py) against bf16, all as
CUDA-graph replays from a cold L2 (skinny_linear.time_calls): cuBLAS bf16, our bf16 skinny kernel (the
best of its first candidates, up to 16 rows), our FP8 weight-only kernel with per-channel and with
128-column group scales (the best of its first candidates, and the rule's first, which the layer
runs), torch._scaled_mm W8A8 with the activation's per-token quantization included (what the layer
runs above 16 rows with per-channel scales where it timed faster), and dequantize + cuBLAS with
per-channel scales (the other route there) and with group scales (the only one for those); "route"
is what fp8_linear.choose_route takes between the first two (the engine decides at start-up the same
way, per (N, K) and row bucket, ROUTE_BUCKETS). err: the largest difference from the fp32 product of
the dequantized weight, relative to that product's largest magnitude.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

# (model, layer, N = out features, K = in features) at TP=1
SHAPES = [("0.6B", "qkv", 4096, 1024), ("0.6B", "o_proj", 1024, 2048), ("0.6B", "gate_up", 6144, 1024),
          ("0.6B", "down", 1024, 3072), ("0.6B", "lm_head", 151936, 1024),
          ("8B", "qkv", 6144, 4096), ("8B", "o_proj", 4096, 4096), ("8B", "gate_up", 24576, 4096),
          ("8B", "down", 4096, 12288), ("8B", "lm_head", 151936, 4096)]
DTYPE = torch.bfloat16


def bench_cublas(x: torch.Tensor, weight: torch.Tensor, library: str) -> float:
    from triton.testing import do_bench
    torch.backends.cuda.preferred_blas_library(library)
    try:
        torch.nn.functional.linear(x, weight)  # any per-library set-up, untimed
        return do_bench(lambda: torch.nn.functional.linear(x, weight), warmup=5, rep=20, return_mode="median")
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def bench_shape(model: str, layer: str, n: int, k: int, rows: list[int], sweep: bool) -> list[dict]:
    from triton.testing import do_bench

    from asyncllm.kernels import skinny_gemm as kernels
    from asyncllm.layers.skinny_linear import MAX_CANDIDATES, choose_fastest, time_calls

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    weight = (torch.randn(n, k, device="cuda") / k ** 0.5).to(DTYPE)
    weight_bytes = weight.numel() * weight.element_size()
    results = []
    for num_rows in rows:
        x = torch.randn(num_rows, k, device="cuda").to(DTYPE)
        ref = x.float() @ weight.float().T
        candidates = kernels.candidate_configs(num_rows, n, k, num_sms)
        # the engine's pick among its first candidates; None (cuBLAS won there) still reports our best
        picked = choose_fastest(kernels, x, weight, None, candidates[:MAX_CANDIDATES])
        row = dict(model=model, layer=layer, n=n, k=k, rows=num_rows, weight_bytes=weight_bytes,
                   engine_picks="cuBLAS" if picked is None else picked.label())
        row["cublas_ms"] = bench_cublas(x, weight, "cublas")
        row["cublaslt_ms"] = bench_cublas(x, weight, "cublaslt")
        timed = candidates if sweep else candidates[:MAX_CANDIDATES]
        times = {c.label(): do_bench(lambda c=c: kernels.skinny_gemm(x, weight, None, c), warmup=5, rep=20,
                                     return_mode="median") for c in timed}
        best = min(timed, key=lambda c: times[c.label()])
        row["ours_config"] = best.label()
        row["ours_ms"] = times[best.label()]
        row["rule_ms"] = times[candidates[0].label()]  # the rule's first choice, untimed selection
        if sweep:
            row["sweep_ms"] = times
        # as decode runs them: CUDA-graph replays (no launch cost), as the engine's choice times them
        row["cublas_graph_ms"], row["ours_graph_ms"] = time_calls(
            [lambda: torch.nn.functional.linear(x, weight), lambda: kernels.skinny_gemm(x, weight, None, best)],
            x.device)
        row["ours_err"] = (kernels.skinny_gemm(x, weight, None, best).float() - ref).abs().max().item()
        row["cublas_err"] = (torch.nn.functional.linear(x, weight).float() - ref).abs().max().item()
        for name in ("cublas", "cublaslt", "ours"):
            row[f"{name}_tbps"] = weight_bytes / (row[f"{name}_ms"] * 1e-3) / 1e12
        row["cublas_over_ours"] = row["cublas_ms"] / row["ours_ms"]
        row["graph_cublas_over_ours"] = row["cublas_graph_ms"] / row["ours_graph_ms"]
        results.append(row)
        # a line per row as it comes, so that a run cut short by a timeout still shows what it measured
        print(f"{model} {layer} ({n}, {k}) rows {num_rows}: cuBLAS {row['cublas_ms'] * 1e3:.1f} us, "
              f"ours {row['ours_ms'] * 1e3:.1f} us ({row['ours_config']}); in graphs cuBLAS "
              f"{row['cublas_graph_ms'] * 1e3:.1f} us, ours {row['ours_graph_ms'] * 1e3:.1f} us; "
              f"engine picks {row['engine_picks']}", flush=True)
    return results


def print_table(rows: list[dict], copy_tbps: float) -> None:
    print("| shape | rows | cuBLAS us | cublasLt us | ours us | ours (rule) us | cuBLAS TB/s | ours TB/s | "
          "cuBLAS/ours | graph: cuBLAS us | graph: ours us | graph: cuBLAS/ours | ours tiling | engine picks | "
          "err ours | err cuBLAS |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['model']} {r['layer']} ({r['n']}, {r['k']}) | {r['rows']} | {r['cublas_ms'] * 1e3:.1f} | "
              f"{r['cublaslt_ms'] * 1e3:.1f} | {r['ours_ms'] * 1e3:.1f} | {r['rule_ms'] * 1e3:.1f} | "
              f"{r['cublas_tbps']:.2f} | {r['ours_tbps']:.2f} | {r['cublas_over_ours']:.2f} | "
              f"{r['cublas_graph_ms'] * 1e3:.1f} | {r['ours_graph_ms'] * 1e3:.1f} | {r['graph_cublas_over_ours']:.2f} | "
              f"{r['ours_config']} | "
              f"{r['engine_picks']} | {r['ours_err']:.1e} | {r['cublas_err']:.1e} |")
    print(f"\ncopy bandwidth {copy_tbps:.2f} TB/s")
    for r in rows:
        if "sweep_ms" in r:
            sweep = ", ".join(f"{label}: {ms * 1e3:.1f}" for label, ms in sorted(r["sweep_ms"].items(),
                                                                               key=lambda item: item[1]))
            print(f"  {r['model']} {r['layer']} rows {r['rows']}: {sweep}")


def copy_bandwidth_tbps() -> float:
    from triton.testing import do_bench
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=20, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e12  # read + write


# --tiling-grid: FMA tiles of 4k-16k weight elements x warps x split-K x stages, and dot tiles, besides the rule's own
GRID_FMA_TILES = [(4, 1024), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 256), (32, 128), (64, 128), (4, 2048)]


def tiling_grid(model: str, layer: str, n: int, k: int, num_rows: int, top: int = 8) -> dict:
    """cuBLAS and a grid of tilings (not only the rule's candidates) for one shape, as CUDA-graph
    replays from a clean cold L2 (skinny_linear.time_calls): what the kernel can reach there."""
    from asyncllm.kernels import skinny_gemm as kernels
    from asyncllm.layers.skinny_linear import time_calls

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    weight = (torch.randn(n, k, device="cuda") / k ** 0.5).to(DTYPE)
    x = torch.randn(num_rows, k, device="cuda").to(DTYPE)
    configs = list(kernels.candidate_configs(num_rows, n, k, num_sms))
    if num_rows <= kernels.FMA_MAX_ROWS:
        for (block_n, block_k), warps, split, stages in itertools.product(GRID_FMA_TILES, (4, 8), (1, 2, 4), (1, 3)):
            if n // block_n * split >= num_sms // 2:
                configs.append(kernels.SkinnyConfig(False, block_n, block_k, split, warps, stages))
    for block_n, warps, stages, split in itertools.product((16, 32, 64), (4, 8), (3, 4, 5), (1, 2)):
        configs.append(kernels.SkinnyConfig(True, block_n, 128 if block_n == 64 else 256, split, warps, stages))
    usable = []
    for config in dict.fromkeys(configs):  # unique, in order
        try:
            kernels.skinny_gemm(x, weight, None, config)
            usable.append(config)
        except Exception:  # noqa: BLE001 - a tiling past this GPU's limits is left out
            continue
    calls = [lambda: torch.nn.functional.linear(x, weight)]
    calls += [lambda c=c: kernels.skinny_gemm(x, weight, None, c) for c in usable]
    times = time_calls(calls, x.device, reps=15)
    gigabytes = weight.numel() * weight.element_size() / 1e9
    ranked = sorted(zip([c.label() for c in usable], times[1:]), key=lambda item: item[1])
    print(f"{model} {layer} ({n}, {k}) rows {num_rows}: {len(usable)} tilings; cuBLAS {times[0] * 1e3:.1f} us "
          f"({gigabytes / times[0]:.2f} TB/s); the rule's first {times[1] * 1e3:.1f} us ({gigabytes / times[1]:.2f})",
          flush=True)
    for label, ms in ranked[:top]:
        print(f"   {label:32s} {ms * 1e3:7.1f} us {gigabytes / ms:5.2f} TB/s", flush=True)
    return dict(model=model, layer=layer, n=n, k=k, rows=num_rows, cublas_ms=times[0], rule_ms=times[1],
                ranked_ms=ranked)


FP8_CANDIDATES = 3  # the first tilings of each kernel timed in --fp8


def fp8_rows(model: str, layer: str, n: int, k: int, rows: list[int]) -> list[dict]:
    """--fp8: one shape, each row count (the module's doc says what is timed)."""
    import torch.nn.functional as F

    from asyncllm.kernels import skinny_gemm as kernels
    from asyncllm.layers import fp8_linear
    from asyncllm.layers.skinny_linear import time_calls

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    weight = (torch.randn(n, k, device="cuda") / k ** 0.5).to(DTYPE)
    per_channel = fp8_linear.quantize_rows(weight, None)
    grouped = fp8_linear.quantize_rows(weight, 128)
    results = []
    for num_rows in rows:
        x = torch.randn(num_rows, k, device="cuda").to(DTYPE)
        labels, calls = ["cublas"], [lambda: F.linear(x, weight)]
        if num_rows <= kernels.MAX_ROWS:
            for i, config in enumerate(kernels.candidate_configs(num_rows, n, k, num_sms)[:FP8_CANDIDATES]):
                labels.append(f"bf16_skinny/{i}")
                calls.append(lambda c=config: kernels.skinny_gemm(x, weight, None, c))
            for name, group_k, (w8, scale) in (("fp8_channel", None, per_channel), ("fp8_group128", 128, grouped)):
                for i, config in enumerate(kernels.fp8_candidate_configs(num_rows, n, k, num_sms,
                                                                         group_k)[:FP8_CANDIDATES]):
                    labels.append(f"{name}/{i}")
                    calls.append(lambda c=config, w8=w8, scale=scale, g=group_k: kernels.skinny_gemm(
                        x, w8, None, c, scale=scale, group_k=g))
        w8, scale = per_channel
        labels.append("scaled_mm_w8a8")
        calls.append(lambda: fp8_linear._scaled_mm_linear(x, w8, scale, None))
        labels.append("dequant_cublas_channel")
        calls.append(lambda: F.linear(x, fp8_linear.dequantize_rows(w8, scale, None, DTYPE)))
        labels.append("dequant_cublas_group128")
        calls.append(lambda: F.linear(x, fp8_linear.dequantize_rows(*grouped, 128, DTYPE)))
        times = dict(zip(labels, time_calls(calls, x.device)))

        def best(prefix):
            found = [ms for label, ms in times.items() if label.startswith(prefix + "/")]
            return min(found) if found else None

        ref = x.float() @ fp8_linear.dequantize_rows(*per_channel, None, torch.float32).T
        scale_ref = ref.abs().max().item()
        row = dict(model=model, layer=layer, n=n, k=k, rows=num_rows, cublas_ms=times["cublas"],
                   bf16_skinny_ms=best("bf16_skinny"), fp8_channel_ms=best("fp8_channel"),
                   fp8_channel_rule_ms=times.get("fp8_channel/0"), fp8_group128_ms=best("fp8_group128"),
                   scaled_mm_ms=times["scaled_mm_w8a8"], dequant_channel_ms=times["dequant_cublas_channel"],
                   dequant_cublas_ms=times["dequant_cublas_group128"],
                   route=fp8_linear.ROUTES[fp8_linear.choose_route([times["scaled_mm_w8a8"],
                                                                    times["dequant_cublas_channel"]])],
                   err_w8a8=(fp8_linear._scaled_mm_linear(x, w8, scale, None).float() - ref).abs().max().item()
                   / scale_ref)
        if num_rows <= kernels.MAX_ROWS:
            out = fp8_linear.linear(x, w8, scale, None)  # the layer's own path: the weight-only kernel
            row["err_weight_only"] = (out.float() - ref).abs().max().item() / scale_ref
        results.append(row)
        shown = ", ".join(f"{key[:-3]} {value * 1e3:.1f} us" for key, value in row.items()
                          if key.endswith("_ms") and value is not None)
        print(f"{model} {layer} ({n}, {k}) rows {num_rows}: {shown}", flush=True)
    return results


def print_fp8_table(rows: list[dict]) -> None:
    def us(value):
        return "-" if value is None else f"{value * 1e3:.1f}"
    print("| shape | rows | cuBLAS bf16 us | skinny bf16 us | FP8 weight-only per-channel us (rule's) | "
          "FP8 weight-only 128-group us | _scaled_mm W8A8 us | dequant per-channel + cuBLAS us | route | "
          "dequant 128-group + cuBLAS us | bf16 skinny / FP8 | err weight-only | err W8A8 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        speedup = f"{r['bf16_skinny_ms'] / r['fp8_channel_ms']:.2f}" if r["fp8_channel_ms"] else "-"
        print(f"| {r['model']} {r['layer']} ({r['n']}, {r['k']}) | {r['rows']} | {us(r['cublas_ms'])} | "
              f"{us(r['bf16_skinny_ms'])} | {us(r['fp8_channel_ms'])} ({us(r['fp8_channel_rule_ms'])}) | "
              f"{us(r['fp8_group128_ms'])} | {us(r['scaled_mm_ms'])} | {us(r['dequant_channel_ms'])} | {r['route']} | "
              f"{us(r['dequant_cublas_ms'])} | {speedup} | "
              f"{r.get('err_weight_only', float('nan')):.1e} | {r['err_w8a8']:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rows", default=None,
                        help="comma-separated row counts (default 1,2,4,8,16; "
                             "with --fp8 1,2,4,8,16,32,64,128,256,512,2048)")
    parser.add_argument("--fp8", action="store_true", help="FP8 weights against bf16 (the module's doc)")
    parser.add_argument("--sweep", action="store_true", help="time every candidate tiling, not only the first few")
    parser.add_argument("--models", default=None, help="comma-separated: 0.6B, 8B (default both; with --fp8 8B)")
    parser.add_argument("--tiling-grid", action="store_true",
                        help="only cuBLAS against a grid of tilings per shape and row count, best first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm.py needs a CUDA GPU")
    torch.manual_seed(0)
    default_rows = "1,2,4,8,16,32,64,128,256,512,2048" if args.fp8 else "1,2,4,8,16"
    rows = [int(r) for r in (args.rows or default_rows).split(",")]
    models = (args.models or ("8B" if args.fp8 else "0.6B,8B")).split(",")
    if args.fp8:
        # the LM head stays in the compute dtype (FP8 weights are the decoder layers')
        results = [row for model, layer, n, k in SHAPES if model in models and layer != "lm_head"
                   for row in fp8_rows(model, layer, n, k, rows)]
        print(f"\n{torch.cuda.get_device_name(0)}, {DTYPE} activations, cold L2, CUDA graphs\n")
        print_fp8_table(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(0), results=results), f, indent=2)
        return
    if args.tiling_grid:
        results = [tiling_grid(model, layer, n, k, num_rows) for model, layer, n, k in SHAPES if model in models
                   for num_rows in rows]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(results=results), f, indent=2)
        return
    start = time.perf_counter()
    copy_tbps = copy_bandwidth_tbps()
    results = []
    for model, layer, n, k in SHAPES:
        if model in models:
            results.extend(bench_shape(model, layer, n, k, rows, args.sweep))
            torch.cuda.empty_cache()  # the last shape's weight
    print(f"\n{torch.cuda.get_device_name(0)}, {DTYPE}, cold L2\n")
    print_table(results, copy_tbps)
    print(f"\n{time.perf_counter() - start:.1f} s")
    if args.json:
        import triton
        meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                    dtype=str(DTYPE), copy_bandwidth_tbps=copy_tbps)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=2)


if __name__ == "__main__":
    main()
