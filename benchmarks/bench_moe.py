"""The mixture-of-experts block's experts: kernels/fused_moe.py (grouped GEMMs) and, at up to 16
tokens, kernels/skinny_moe.py (the decode path: no sort, each selected expert streamed once) against
the PyTorch path (a loop over the experts that have tokens, layers/moe.py's forward_native) and the
byte / FLOP floor. CUDA only.

    python benchmarks/bench_moe.py [--tokens 1,8,64,256,4096] [--routing uniform,skewed] [--sweep] [--json out.json]
    python benchmarks/bench_moe.py --tokens 1,2,4,8,16 --sweep   # the decode path against its floor

One layer of Qwen3-30B-A3B's shape (128 experts, top-8, hidden 2048, experts of 768), bf16, random
weights and inputs, routing from a random router (uniform) or one that sends every token to the same
9 experts (skewed). Each call is timed as the median of CUDA-graph replays with L2 flushed before each
(asyncllm.layers.skinny_linear.time_calls); the torch path reads counts on the host and cannot be
captured, so it is timed eagerly (triton.testing.do_bench). The byte floor is the distinct experts'
weights read once at --bandwidth; the FLOP floor 2 * 3 * H * I FLOPs per (token, expert) pair at
--tflops. Router and top-k are outside the experts' columns (the same routing for each path). The
skinny column is the tiling layers/moe.py picks (skinny_moe.choose_config); --sweep also times its
neighbours (candidate_configs) and reports the best, with its tiling.

The router columns time the routing alone on the layer's bf16 router logits: kernels/moe_router.py's
one kernel (what the block runs on CUDA) against layers/moe.py's route (the torch ops: softmax in
float32, topk, renormalise), both captured in CUDA graphs (time_calls), with the saving over
Qwen3-30B-A3B's 48 layers per decode step.
"""
from __future__ import annotations

import argparse
import json

import torch
from common import REPO_ROOT  # noqa: F401 - importing common puts the repo root on sys.path

from asyncllm.layers.moe import SparseMoeBlock, route  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER, LAYERS = 2048, 128, 8, 768, 48
DTYPE = torch.bfloat16


def bench_case(block: SparseMoeBlock, num_tokens: int, skewed: bool, bandwidth: float, tflops: float,
               sweep: bool) -> dict:
    import triton.testing

    from asyncllm.kernels import skinny_moe
    from asyncllm.kernels.fused_moe import fused_moe
    from asyncllm.kernels.moe_router import route_topk
    from asyncllm.layers.skinny_linear import time_calls
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=DTYPE)
    logits = block.gate(x)
    if skewed:
        logits[:, :TOP_K + 1] += 20.0
    weights, ids = route(logits, TOP_K, True)
    experts = block.experts
    router_kernel_ms, router_torch_ms = time_calls([lambda: route_topk(logits, TOP_K, True),
                                                    lambda: route(logits, TOP_K, True)], torch.device("cuda"))
    kernel_weights, kernel_ids = route_topk(logits, TOP_K, True)
    # ids may differ only in the order of exactly tied experts (bf16 logits), which changes no output
    router_ids_equal = bool(torch.equal(kernel_ids.sort(1).values, ids.sort(1).values))
    router_max_weight_error = (kernel_weights.sort(1).values - weights.sort(1).values).abs().max().item()

    def fused():
        return fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)

    fused_ms = time_calls([fused], torch.device("cuda"))[0]
    torch_ms = triton.testing.do_bench(lambda: block.forward_native(x, weights, ids), return_mode="median")
    want = block.forward_native(x, weights, ids).float()
    error = ((fused().float() - want).norm() / want.norm()).item()
    skinny = {}
    if num_tokens <= skinny_moe.MAX_TOKENS:
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        chosen = skinny_moe.choose_config(num_tokens, TOP_K, EXPERTS, HIDDEN, INTER, num_sms)
        configs = skinny_moe.candidate_configs(num_tokens, TOP_K, EXPERTS, HIDDEN, INTER, num_sms) if sweep \
            else [chosen]
        calls = [lambda c=c: skinny_moe.skinny_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, c)
                 for c in configs]
        times = time_calls(calls, torch.device("cuda"))
        # ASYNCLLM_MOE_ROUTED_DECODE's path at the chosen tiling: the routing and the split sums inside the two
        # kernels (against the routing kernel, skinny_moe and its split-K reduce: router_kernel_ms + skinny_ms)
        counters = skinny_moe.new_tile_counters(HIDDEN, [chosen], x.device)  # once, as the block makes them
        routed_ms = time_calls([lambda: skinny_moe.skinny_moe_routed(
            x, logits, TOP_K, True, experts.gate_up_proj, experts.down_proj, chosen, counters)],
            torch.device("cuda"))[0]
        best = min(range(len(configs)), key=times.__getitem__)
        errors = [((call().float() - want).norm() / want.norm()).item() for call in calls]
        skinny = dict(skinny_ms=times[0], skinny_config=chosen.label(), skinny_rel_error=errors[0],
                      skinny_routed_ms=routed_ms, best_skinny_ms=times[best], best_skinny_config=configs[best].label(),
                      skinny_max_rel_error=max(errors))
    distinct = ids.unique().numel()
    expert_bytes = 3 * HIDDEN * INTER * DTYPE.itemsize
    byte_floor_ms = distinct * expert_bytes / bandwidth * 1e3
    flop_floor_ms = num_tokens * TOP_K * 2 * 3 * HIDDEN * INTER / tflops * 1e3
    return dict(tokens=num_tokens, routing="skewed" if skewed else "uniform", distinct_experts=distinct,
                fused_ms=fused_ms, torch_ms=torch_ms, byte_floor_ms=byte_floor_ms, flop_floor_ms=flop_floor_ms,
                floor_ms=max(byte_floor_ms, flop_floor_ms), rel_error=error, router_kernel_ms=router_kernel_ms,
                router_torch_ms=router_torch_ms, router_ids_equal=router_ids_equal,
                router_max_weight_error=router_max_weight_error, **skinny)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,64,256,4096")
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--bandwidth", type=float, default=4.2e12, help="bytes/s of the floor (H200: ~4.2e12)")
    parser.add_argument("--tflops", type=float, default=790e12, help="bf16 FLOP/s of the floor (H200: ~790e12)")
    parser.add_argument("--sweep", action="store_true", help="also time the skinny path's neighbouring tilings")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe.py needs a CUDA GPU")
    torch.manual_seed(0)
    with torch.device("cuda"):
        block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, INTER, renormalize=True)
    for p in block.parameters():
        p.data = p.data.to(DTYPE).normal_(0, HIDDEN ** -0.5)
    rows = [bench_case(block, int(n), routing == "skewed", args.bandwidth, args.tflops, args.sweep)
            for routing in args.routing.split(",") for n in args.tokens.split(",")]
    print(f"{torch.cuda.get_device_name(0)}: one Qwen3-30B-A3B MoE layer, {DTYPE}")
    head = f"{'tokens':>7} {'routing':>8} {'experts':>7} {'fused ms':>9} {'skinny ms':>9} {'torch ms':>9} " \
           f"{'floor ms':>9} {'floor/fused':>11} {'floor/skinny':>12} {'rel err':>8}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        small = "skinny_ms" in r
        print(f"{r['tokens']:>7} {r['routing']:>8} {r['distinct_experts']:>7} {r['fused_ms']:>9.4f} "
              f"{r['skinny_ms'] if small else float('nan'):>9.4f} {r['torch_ms']:>9.4f} {r['floor_ms']:>9.4f} "
              f"{r['floor_ms'] / r['fused_ms']:>11.2f} "
              f"{r['floor_ms'] / r['skinny_ms'] if small else float('nan'):>12.2f} "
              f"{max(r['rel_error'], r.get('skinny_max_rel_error', 0.0)):>8.1e}"
              + (f"  skinny: {r['skinny_config']}" if small else ""))
        if args.sweep and small:
            print(f"{'':>16} best of the sweep {r['best_skinny_ms']:.4f} ms: {r['best_skinny_config']}")
    head = f"{'tokens':>7} {'routing':>8} {'router kernel ms':>16} {'router torch ms':>15} " \
           f"{f'saved x{LAYERS} layers ms':>21} {'same ids':>8} {'max weight err':>14}"
    print("\nrouter alone (softmax + top-k + renormalise)\n" + head + "\n" + "-" * len(head))
    for r in rows:
        saved = LAYERS * (r['router_torch_ms'] - r['router_kernel_ms'])
        print(f"{r['tokens']:>7} {r['routing']:>8} {r['router_kernel_ms']:>16.4f} {r['router_torch_ms']:>15.4f} "
              f"{saved:>21.3f} {str(r['router_ids_equal']):>8} {r['router_max_weight_error']:>14.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), results=rows), f, indent=2)


if __name__ == "__main__":
    main()
