"""Paged attention: our Triton kernels vs FlashAttention-2 (torch's built-in) and FlashAttention-4
(flash_attn.cute, when installed). CUDA only.

    python benchmarks/bench_kernels.py [--json results.json] [--no-fa4] [--budget-s 60] [--grid]
                                       [--timing graph|eager] [--splits-sweep] [--mixed] [--tile-sweep]
                                       [--short-over-long] [--fp8-kv]

Timing (--timing graph, the default) is the median of CUDA-graph replays of each call, with L2 flushed
before every one (asyncllm.layers.skinny_linear.time_calls): decode runs in graphs, and a
microsecond-scale kernel timed eagerly also times its host launch (a Triton launch from Python is
tens of microseconds; FA2's is a C++ op, FA4's a cute-DSL call). --timing eager is
triton.testing.do_bench's median (runs up to D), which zeroes a 256 MB buffer before every repetition;
either way each call starts from a cold L2 (50 MB on H200) even when its KV would fit there.
--splits-sweep times our decode alone at batches 1/4/16 over contexts 128..8k for every split count,
the data behind choose_num_splits and the decode graphs' context buckets. --tile-sweep times our
decode at batches 8..256 over 1k and 8k contexts for each split count and decode tile (BLOCK_N,
num_stages, num_warps), beside FA4 where installed: the data behind choose_decode_tile. --mixed times mixed
steps (decodes beside a prefill) with the decodes in the varlen kernel and in the decode kernel. FA2 has no
paged KV here: --short-over-long times a
short prefill chunk over a long cached context (issue 44: a new chat turn over a long history) with
the varlen kernel's KV splits as choose_prefill_splits picks them against one split, beside FA4, alone
and with the grid of a mixed CUDA graph (the bucket's room for more sequences: empty ones). FA2 has no
paged KV here: it reads the same K/V gathered into contiguous varlen tensors (cum_seq_k). FA4
reads the paged cache through page_table, like ours. --fp8-kv times our decode over a bf16 cache
and over the same K/V in FP8 (kv_cache_dtype="fp8"), with the default decode tile and a 128-position
one (an FP8 tile of 128 positions is a bf16 tile of 64's bytes). Decode reports achieved K+V bandwidth;
prefill reports TFLOP/s counting only the causally visible keys. "err" is ours vs FA2, relative.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
from common import REPO_ROOT  # noqa: F401 - importing common puts the repo root on sys.path

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
DTYPE = torch.bfloat16
# (batch, context, block_size): each sequence decodes one token over `context` cached tokens
DECODE_CASES = [(1, 1024, 128), (1, 8192, 128), (16, 1024, 128), (64, 1024, 128), (64, 1024, 16),
                (64, 1024, 256), (256, 1024, 128), (64, 4096, 128)]
# --grid: issue 22's kernel table, decode at batches 1/8/64/256 and contexts 128/1k/8k (block 128)
GRID_DECODE_CASES = [(batch, context, 128) for batch in (1, 8, 64, 256) for context in (128, 1024, 8192)]
# (batch, new tokens, cached context, block_size)
PREFILL_CASES = [(1, 1024, 1024, 128), (16, 1024, 1024, 128), (4, 4096, 4096, 128)]


def load_fa4():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:  # not installed, or its CUDA DSL fails to import
        return None, f"{type(exc).__name__}: {exc}"
    return flash_attn_varlen_func, None


def make_case(batch: int, query_len: int, context: int, block_size: int):
    """A paged cache holding `batch` sequences of context + query_len tokens on shuffled blocks,
    the same K/V as contiguous varlen tensors for FA2, and the step's queries."""
    dev = torch.device("cuda")
    seq_len = context + query_len
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=dev) * query_len
    k_contig = k_cache[block_tables.long()].flatten(1, 2)[:, :seq_len].reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    v_contig = v_cache[block_tables.long()].flatten(1, 2)[:, :seq_len].reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    cu_seq_k = torch.arange(batch + 1, dtype=torch.int32, device=dev) * seq_len
    q = torch.randn(batch * query_len, NUM_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                query_start_loc=query_start_loc, k_contig=k_contig, v_contig=v_contig, cu_seq_k=cu_seq_k,
                max_query_len=query_len, max_seq_len=seq_len)


def run_ours(c: dict, out: torch.Tensor, num_splits: int | None = None, workspace: torch.Tensor | None = None,
             decode_tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    from asyncllm.kernels import paged_attention
    return paged_attention(c["q"], c["k_cache"], c["v_cache"], c["query_start_loc"], c["seq_lens"], c["block_tables"],
                           c["max_query_len"], c["max_seq_len"], HEAD_DIM ** -0.5, out=out, num_splits=num_splits,
                           workspace=workspace, decode_tile=decode_tile)


def fp8_kv(timing: str) -> list[dict]:
    """Our decode over the bf16 cache of make_case and over the same K/V quantized to FP8 (scale 1.0,
    as the engine keeps it), at the choose_num_splits count: times, K+V bandwidth (each cache's own
    bytes), FP8's speed-up, and how far its output lies from bf16's (the quantization's error)."""
    from asyncllm.kernels import choose_decode_tile, choose_num_splits, split_workspace_numel
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, context in itertools.product((1, 16, 64, 256), (1024, 8192)):
        c = make_case(batch, 1, context, 128)
        fp8 = dict(c, k_cache=c["k_cache"].to(torch.float8_e4m3fn), v_cache=c["v_cache"].to(torch.float8_e4m3fn))
        splits = choose_num_splits(batch, NUM_KV_HEADS, c["max_seq_len"], num_sms)
        workspace = torch.empty(max(1, split_workspace_numel(batch, NUM_HEADS, HEAD_DIM, splits)),
                                dtype=torch.float32, device="cuda")
        out = torch.empty_like(c["q"])
        default_tile = choose_decode_tile(batch * NUM_KV_HEADS * splits, num_sms, True)
        calls = [lambda case=case, tile=tile: run_ours(case, out, splits, workspace, tile)
                 for case, tile in ((c, default_tile), (fp8, default_tile), (fp8, (128, 2, 4)))]
        bf16_ms, fp8_ms, fp8_wide_ms = time_ms(calls, timing)
        ref = calls[0]().float().clone()
        err = ((calls[1]().float() - ref).norm() / ref.norm()).item()
        kv_elems = 2 * batch * c["max_seq_len"] * NUM_KV_HEADS * HEAD_DIM
        rows.append(dict(batch=batch, context=context, num_splits=splits, tile=list(default_tile), bf16_ms=bf16_ms,
                         fp8_ms=fp8_ms, fp8_tile128_ms=fp8_wide_ms, bf16_tbps=2 * kv_elems / (bf16_ms * 1e-3) / 1e12,
                         fp8_tbps=kv_elems / (fp8_ms * 1e-3) / 1e12, speedup=bf16_ms / fp8_ms,
                         speedup_tile128=bf16_ms / fp8_wide_ms, fp8_err_vs_bf16=err))
        r = rows[-1]
        print(f"decode {batch}x{context} s{splits}: bf16 {bf16_ms:.4f} ms ({r['bf16_tbps']:.2f} TB/s), fp8 "
              f"{fp8_ms:.4f} ms ({r['fp8_tbps']:.2f} TB/s, x{r['speedup']:.2f}), fp8 tile 128 {fp8_wide_ms:.4f} ms "
              f"(x{r['speedup_tile128']:.2f}), fp8 vs bf16 {err:.1e}", flush=True)
        torch.cuda.empty_cache()
    return rows


def run_fa4(fa4, c: dict, num_splits: int = 1) -> torch.Tensor:
    """FA4 over the same paged cache; num_splits 0 is its own split heuristic."""
    extra = {} if num_splits == 1 else {"num_splits": num_splits}
    result = fa4(c["q"], c["k_cache"], c["v_cache"], cu_seqlens_q=c["query_start_loc"], max_seqlen_q=c["max_query_len"],
                 seqused_k=c["seq_lens"], page_table=c["block_tables"], causal=True, softmax_scale=HEAD_DIM ** -0.5,
                 **extra)
    return result[0] if isinstance(result, tuple) else result  # some versions return (out, lse)


def time_ms(calls: list, timing: str) -> list[float]:
    """Each call's median device time (ms), cold L2: graph replays or do_bench (see the docstring)."""
    if timing == "eager":
        from triton.testing import do_bench
        return [do_bench(call) for call in calls]
    from asyncllm.layers.skinny_linear import time_calls
    return time_calls(calls, torch.device("cuda"), reps=50)


def bench_case(kind: str, batch: int, query_len: int, context: int, block_size: int, fa4, use_fa4: bool,
               timing: str = "graph", num_splits: int | None = None) -> dict:
    from asyncllm.kernels import choose_num_splits, split_workspace_numel

    c = make_case(batch, query_len, context, block_size)
    scale = HEAD_DIM ** -0.5
    out = torch.empty_like(c["q"])
    workspace = None
    if kind != "decode":
        num_splits = 1
    else:
        if num_splits is None:
            num_splits = choose_num_splits(batch, NUM_KV_HEADS, c["max_seq_len"],
                                           torch.cuda.get_device_properties(0).multi_processor_count)
        workspace = torch.empty(max(1, split_workspace_numel(batch, NUM_HEADS, HEAD_DIM, num_splits)),
                                dtype=torch.float32, device="cuda")

    def ours():
        return run_ours(c, out, num_splits, workspace)

    def fa2():
        return torch.ops.aten._flash_attention_forward(
            c["q"], c["k_contig"], c["v_contig"], c["query_start_loc"], c["cu_seq_k"], c["max_query_len"],
            c["max_seq_len"], 0.0, True, False, scale=scale)[0]

    row = dict(kind=kind, batch=batch, query_len=query_len, context=context, block_size=block_size,
               num_splits=num_splits if kind == "decode" else None)
    row["ours_ms"], row["fa2_ms"] = time_ms([ours, fa2], timing)
    ref = fa2().float()
    row["err_vs_fa2"] = ((ours().float() - ref).norm() / ref.norm()).item()

    row["fa4_ms"] = None
    if fa4 is not None and use_fa4:
        for splits in ((0, 1) if kind == "decode" else (1,)):  # 0: FA4's own split heuristic
            try:
                fa4_out = run_fa4(fa4, c, splits).float()
                row["fa4_ms"] = time_ms([lambda: run_fa4(fa4, c, splits)], timing)[0]
                row["fa4_err_vs_fa2"] = ((fa4_out - ref).norm() / ref.norm()).item()
                row["fa4_num_splits"] = splits
                break
            except Exception as exc:
                row["fa4_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"

    if kind == "decode":
        kv_bytes = 2 * batch * c["max_seq_len"] * NUM_KV_HEADS * HEAD_DIM * c["k_cache"].element_size()
        row["ours_tbps"] = kv_bytes / (row["ours_ms"] * 1e-3) / 1e12
    else:
        visible_keys = batch * (query_len * context + query_len * (query_len + 1) / 2)
        flops = 4 * NUM_HEADS * HEAD_DIM * visible_keys
        row["ours_tflops"] = flops / (row["ours_ms"] * 1e-3) / 1e12
        row["fa2_tflops"] = flops / (row["fa2_ms"] * 1e-3) / 1e12
    return row


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    head = (f"{'case':<28} {'ours ms':>9} {'FA2 ms':>9} {'FA4 ms':>9} {'FA2/ours':>9} {'FA4/ours':>9} "
            f"{'ours perf':>14} {'err':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["kind"] == "decode":
            case = f"decode {r['batch']}x{r['context']} bs{r['block_size']} s{r['num_splits']}"
            perf = f"{r['ours_tbps']:.2f} TB/s"
        else:
            case = f"prefill {r['batch']}x{r['query_len']}/{r['context']} bs{r['block_size']}"
            perf = f"{r['ours_tflops']:.0f} TFLOP/s"
        fa4_ratio = r["fa4_ms"] / r["ours_ms"] if r.get("fa4_ms") else None
        print(f"{case:<28} {fmt(r['ours_ms']):>9} {fmt(r['fa2_ms']):>9} {fmt(r.get('fa4_ms')):>9} "
              f"{fmt(r['fa2_ms'] / r['ours_ms'], '.2f'):>9} {fmt(fa4_ratio, '.2f'):>9} {perf:>14} "
              f"{r['err_vs_fa2']:>8.1e}")
        if r.get("fa4_error") and r.get("fa4_ms") is None:
            print(f"    FA4 failed: {r['fa4_error']}")


def splits_sweep(timing: str) -> list[dict]:
    """Our decode alone at batches 1/4/16 x contexts 128..8k x every split count up to MAX_SPLITS."""
    from asyncllm.kernels import split_workspace_numel
    from asyncllm.kernels.paged_attention import MAX_SPLITS
    rows = []
    for batch in (1, 4, 16):
        for context in (128, 256, 512, 1024, 2048, 8192):
            splits = 1
            while splits <= MAX_SPLITS:
                c = make_case(batch, 1, context, 128)
                workspace = torch.empty(max(1, split_workspace_numel(batch, NUM_HEADS, HEAD_DIM, splits)),
                                        dtype=torch.float32, device="cuda")
                out = torch.empty_like(c["q"])

                def ours(c=c, splits=splits, workspace=workspace, out=out):
                    return run_ours(c, out, splits, workspace)
                rows.append(dict(batch=batch, context=context, num_splits=splits, ours_ms=time_ms([ours], timing)[0]))
                splits *= 2
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{'s' + str(1 << i):>7}" for i in range(7)) + "   (us)")
    for batch in (1, 4, 16):
        for context in (128, 256, 512, 1024, 2048, 8192):
            times = [r["ours_ms"] * 1e3 for r in rows if r["batch"] == batch and r["context"] == context]
            best = min(times)
            print(f"{batch:>5} {context:>7} " + " ".join(f"{t:>6.1f}{'*' if t == best else ' '}" for t in times))
    return rows


# --tile-sweep: (batch, context, split counts)
TILE_SWEEP_CASES = [(64, 8192, (1, 2, 3, 4, 6, 8)), (256, 8192, (1, 2)), (8, 8192, (4, 8, 9, 12, 16)),
                    (64, 1024, (1, 2, 3, 4)), (256, 1024, (1, 2))]
TILE_SWEEP_TILES = [(n, stages, warps) for n in (32, 64, 128) for stages in (2, 3, 4) for warps in (4, 8)]


def tile_sweep(timing: str, fa4) -> list[dict]:
    """Our decode at each (split count, decode tile) of TILE_SWEEP_CASES, and FA4 (called without num_splits)."""
    from asyncllm.kernels import split_workspace_numel
    rows = []
    for batch, context, split_counts in TILE_SWEEP_CASES:
        c = make_case(batch, 1, context, 128)
        out = torch.empty_like(c["q"])
        workspace = torch.empty(split_workspace_numel(batch, NUM_HEADS, HEAD_DIM, max(split_counts)),
                                dtype=torch.float32, device="cuda")
        ref = None
        labels, calls = [], []
        for splits, tile in itertools.product(split_counts, TILE_SWEEP_TILES):
            def ours(splits=splits, tile=tile):
                return run_ours(c, out, splits, workspace, tile)
            try:
                result = ours().float()
            except Exception as exc:  # noqa: BLE001 - a tile over the shared memory: not a candidate
                print(f"{batch}x{context} s{splits} tile {tile}: {type(exc).__name__}", flush=True)
                continue
            ref = result if ref is None else ref
            assert (result - ref).abs().max().item() < 2e-2, (splits, tile)
            labels.append(f"s{splits} n{tile[0]} st{tile[1]} w{tile[2]}")
            calls.append(ours)
        if fa4 is not None:
            calls.append(lambda: run_fa4(fa4, c))
            labels.append("FA4")
        times = time_ms(calls, timing)
        kv_bytes = 2 * batch * c["max_seq_len"] * NUM_KV_HEADS * HEAD_DIM * c["k_cache"].element_size()
        print(f"\ndecode {batch}x{context} (block 128): best first", flush=True)
        for label, ms in sorted(zip(labels, times), key=lambda pair: pair[1])[:12]:
            print(f"  {label:<22} {ms * 1e3:8.1f} us  {kv_bytes / (ms * 1e-3) / 1e12:5.2f} TB/s")
        rows += [dict(batch=batch, context=context, config=label, ms=ms) for label, ms in zip(labels, times)]
        del c, out, workspace
        torch.cuda.empty_cache()
    return rows


# a mixed step: (query heads, decodes, their context, prefill tokens, the prompt's cached context); KV heads 8, D 128,
# block 256 (the engine's default). The first is issue 17's 64-stream serving step on Qwen3-0.6B's heads.
MIXED_CASES = [(16, 59, 1100, 1500, 1024), (16, 59, 1100, 1024, 0), (32, 60, 1100, 1500, 1024),
               (16, 4, 1100, 1500, 1024), (16, 200, 2000, 512, 512)]


# --short-over-long: (query heads, new tokens, cached context, sequence slots); 16 heads are Qwen3-0.6B's, 32
# the 8B's (8 KV heads each); slots > 1 give the grid the mixed CUDA graph of that token bucket has
SHORT_OVER_LONG_CASES = [(16, 64, 32768, 1), (16, 64, 32768, 64), (16, 16, 8192, 1), (16, 256, 8192, 1),
                         (16, 16, 32768, 1), (16, 256, 32768, 1), (16, 256, 32768, 256), (32, 64, 32768, 1)]


def short_over_long(timing: str, fa4) -> list[dict]:
    """A prefill chunk over a long cached context: our varlen kernel at choose_prefill_splits' count
    and at one split, and FA4 (its own split heuristic), with the K+V bytes each read once (the floor)."""
    from asyncllm.kernels import choose_prefill_splits, paged_attention
    rows = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for num_heads, query_len, context, slots in SHORT_OVER_LONG_CASES:
        c = make_case(1, query_len, context, 256)
        c["q"] = torch.randn(query_len, num_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
        # empty sequences after the live one: a mixed graph's padding (no rows, no KV)
        qsl = torch.full((slots + 1,), query_len, dtype=torch.int32, device="cuda")
        qsl[0] = 0
        seq_lens = torch.zeros(slots, dtype=torch.int32, device="cuda")
        seq_lens[0] = context + query_len
        tables = c["block_tables"].expand(slots, -1).contiguous()
        args = (c["q"], c["k_cache"], c["v_cache"], qsl, seq_lens, tables, query_len, context + query_len,
                HEAD_DIM ** -0.5)
        splits = choose_prefill_splits(query_len, slots, query_len, num_heads, NUM_KV_HEADS, HEAD_DIM, True,
                                       context + query_len, num_sms)
        calls = [lambda: paged_attention(*args, prefill_splits=splits, num_sms=num_sms),
                 lambda: paged_attention(*args, prefill_splits=1, num_sms=num_sms)]
        if fa4 is not None and slots == 1:
            calls.append(lambda: run_fa4(fa4, c, num_splits=0))
        ref = calls[1]().float()
        diff = (calls[0]().float() - ref).abs().max().item()
        times = time_ms(calls, timing)
        kv_bytes = 2 * (context + query_len) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
        row = dict(num_heads=num_heads, new_tokens=query_len, context=context, seq_slots=slots, num_splits=splits,
                   split_ms=times[0], one_split_ms=times[1], fa4_ms=times[2] if len(times) > 2 else None,
                   split_gbps=kv_bytes / times[0] / 1e6, max_abs_diff=diff)
        rows.append(row)
        fa4_text = f", FA4 {times[2] * 1e3:.1f} us" if len(times) > 2 else ""
        print(f"H={num_heads}: {query_len} new over {context} cached ({slots} slots): {splits} splits "
              f"{times[0] * 1e3:.1f} us ({row['split_gbps']:.0f} GB/s of K+V), 1 split {times[1] * 1e3:.1f} us"
              f"{fa4_text}; max |diff| {diff:.2g}", flush=True)
    return rows


def mixed_steps(timing: str) -> list[dict]:
    """A mixed step's attention with its decodes in the varlen kernel (single_rows=False) against the
    decode kernel, at one split and at choose_num_splits' count for the decodes."""
    from asyncllm.kernels import choose_num_splits, paged_attention
    block_size, num_kv_heads = 256, 8
    rows = []
    for num_heads, decodes, context, prefill, prompt_context in MIXED_CASES:
        query_lens = [1] * decodes + [prefill]
        seq_lens = [context + 1] * decodes + [prompt_context + prefill]
        blocks = [math.ceil(n / block_size) for n in seq_lens]
        k_cache = torch.randn(sum(blocks), block_size, num_kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
        v_cache = torch.randn_like(k_cache)
        order = torch.randperm(sum(blocks), dtype=torch.int32)
        tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        for i, start in enumerate([0] + list(itertools.accumulate(blocks))[:-1]):
            tables[i, :blocks[i]] = order[start:start + blocks[i]]
        q = torch.randn(sum(query_lens), num_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
        query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                tables.cuda(), max(query_lens), max(seq_lens), HEAD_DIM ** -0.5)
        splits = choose_num_splits(decodes, num_kv_heads, max(seq_lens))
        calls = [lambda: paged_attention(*args, single_rows=False), lambda: paged_attention(*args, num_splits=1),
                 lambda: paged_attention(*args, num_splits=splits)]
        ref = calls[0]().float()
        diff = max((call().float() - ref).abs().max().item() for call in calls[1:])
        varlen, one_split, split = time_ms(calls, timing)
        row = dict(num_heads=num_heads, decodes=decodes, context=context, prefill=prefill,
                   prompt_context=prompt_context, varlen_ms=varlen, decode_kernel_ms=one_split,
                   num_splits=splits, decode_kernel_split_ms=split, max_abs_diff=diff)
        rows.append(row)
        print(f"H={num_heads}: {decodes} decodes x {context} + {prefill} prefill over {prompt_context}: decodes in the "
              f"varlen kernel {varlen * 1e3:.1f} us, in the decode kernel {one_split * 1e3:.1f} us (1 split), "
              f"{split * 1e3:.1f} us ({splits} splits); max |diff| {diff:.2g}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--no-fa4", action="store_true", help="skip FlashAttention-4")
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="stop timing FA4 (whose first call per shape JIT-compiles) past this many seconds")
    parser.add_argument("--grid", action="store_true",
                        help="decode over batches 1/8/64/256 x contexts 128/1k/8k instead of the default cases")
    parser.add_argument("--timing", choices=["graph", "eager"], default="graph",
                        help="CUDA-graph replays (default) or eager do_bench calls")
    parser.add_argument("--splits-sweep", action="store_true",
                        help="only our decode, at every split count (batches 1/4/16, contexts 128..8k)")
    parser.add_argument("--tile-sweep", action="store_true",
                        help="only our decode at each split count and decode tile, beside FA4 (batches 8..256)")
    parser.add_argument("--mixed", action="store_true",
                        help="only mixed steps: their decodes in the varlen kernel against the decode kernel")
    parser.add_argument("--fp8-kv", action="store_true",
                        help="only our decode over a bf16 cache against the same K/V in FP8 (kv_cache_dtype='fp8')")
    parser.add_argument("--short-over-long", action="store_true",
                        help="only short prefill chunks over long contexts: split KV against one split, and FA4")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    if args.tile_sweep or args.short_over_long:
        fa4, fa4_error = (None, "disabled") if args.no_fa4 else load_fa4()
        rows = (tile_sweep if args.tile_sweep else short_over_long)(args.timing, fa4)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(timing=args.timing, fa4=fa4_error or "installed", results=rows), f, indent=2)
        return
    if args.splits_sweep or args.mixed or args.fp8_kv:
        rows = splits_sweep(args.timing) if args.splits_sweep else mixed_steps(args.timing) if args.mixed \
            else fp8_kv(args.timing)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(timing=args.timing, results=rows), f, indent=2)
        return
    fa4, fa4_error = (None, "disabled") if args.no_fa4 else load_fa4()
    if fa4 is None:
        print(f"FlashAttention-4 unavailable: {fa4_error}")
    start = time.perf_counter()
    rows = []
    cases = [("decode", b, 1, ctx, bs) for b, ctx, bs in (GRID_DECODE_CASES if args.grid else DECODE_CASES)]
    cases += [("prefill", b, q, ctx, bs) for b, q, ctx, bs in PREFILL_CASES]
    for kind, batch, query_len, context, block_size in cases:
        use_fa4 = time.perf_counter() - start < args.budget_s
        rows.append(bench_case(kind, batch, query_len, context, block_size, fa4, use_fa4, args.timing))
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name(0)}, H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} {DTYPE}, "
          f"timing: {args.timing}\n")
    print_table(rows)
    print(f"\n{time.perf_counter() - start:.1f} s")
    if args.json:
        import triton
        meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                    num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=str(DTYPE),
                    fa4_available=fa4 is not None, timing=args.timing)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)


if __name__ == "__main__":
    main()
