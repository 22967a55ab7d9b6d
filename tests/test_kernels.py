"""Triton kernels and the Triton attention backend against the plain-PyTorch reference.

Without CUDA the kernels run through Triton's CPU interpreter on small shapes; with CUDA the same
tests run compiled over the real shape space (block sizes 16..256, head_dim 64/128, GQA 1/2/4,
long contexts, big decode batches) plus the CUDA-graph path of the backend.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`
pytest.importorskip("triton")

from asyncllm.attention.base import ForwardBatch  # noqa: E402
from asyncllm.attention.torch_ref import (TorchAttentionBackend, paged_attention_torch,  # noqa: E402
                                          store_kvcache_torch)
from asyncllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from asyncllm.kernels import (choose_decode_tile, choose_num_splits, choose_prefill_splits,  # noqa: E402
                              paged_attention, split_workspace_numel, store_kvcache)
from asyncllm.kernels.paged_attention import (MAX_PREFILL_SPLITS, MAX_SPLITS, PREFILL_SPLIT_TOKENS,  # noqa: E402
                                              longest_unsplit_context)
from asyncllm.kernels.host import cdiv  # noqa: E402
from asyncllm.startup_cache import StartupDecisions  # noqa: E402
from helpers import LaunchRecorder, compile_for_sm90_in_subprocess, seed_every_test  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
_AOT_SUBPROCESS = os.environ.get("ASYNCLLM_KERNELS_AOT") == "1"  # test_kernels_compile_for_sm90's child
if not CUDA and not _AOT_SUBPROCESS:
    import importlib

    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(importlib.import_module("asyncllm.kernels.paged_attention")._decode_kernel,
                      InterpretedFunction):
        pytest.skip("asyncllm.kernels was imported before TRITON_INTERPRET=1 was set and cannot run on CPU; "
                    "export TRITON_INTERPRET=1", allow_module_level=True)
# the interpreter is slow: CPU runs cover each code path once (fp32 and bf16, one-block and
# multi-block KV tiles, GQA), CUDA runs the full grid
DTYPES = [torch.bfloat16] if CUDA else [torch.float32, torch.bfloat16]
BLOCK_SIZES = [16, 32, 64, 128, 256] if CUDA else [16, 64]
HEAD_DIMS = [64, 128] if CUDA else [64]
GROUPS = [1, 2, 4] if CUDA else [1, 4]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


# ----------------------------------------------------------------------------- helpers

def make_paged_kv(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, extra_cols: int = 2, extra_blocks: int = 3):
    """Random K/V for each sequence, scattered over a random permutation of cache blocks. Every
    cache slot that no sequence owns is NaN, so a kernel reading past a sequence's end shows up."""
    num_blocks = [cdiv(s, block_size) for s in seq_lens]
    total = sum(num_blocks) + extra_blocks
    perm = torch.randperm(total, dtype=torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(num_blocks, default=0) + extra_cols, dtype=torch.int32)
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    used = 0
    for row, (seq_len, n) in enumerate(zip(seq_lens, num_blocks)):
        block_tables[row, :n] = perm[used:used + n]
        used += n
        pos = torch.arange(seq_len)
        slots = (block_tables[row, pos // block_size].long() * block_size + pos % block_size).to(DEVICE)
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
                seq_len, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    return k_cache, v_cache, block_tables.to(DEVICE)


def make_step(query_lens: list[int], context_lens: list[int], block_size: int, num_heads: int,
              num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype).to(DEVICE)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=query_start_loc.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=block_tables,
                max_query_len=max(query_lens), max_seq_len=max(seq_lens), scale=head_dim ** -0.5)


def reference(step: dict) -> torch.Tensor:
    s = step
    return paged_attention_torch(s["q"].float(), s["k_cache"].float().nan_to_num(0.0),
                                 s["v_cache"].float().nan_to_num(0.0), s["query_start_loc"], s["seq_lens"],
                                 s["block_tables"], s["max_query_len"], s["max_seq_len"], s["scale"])


def run_ours(step: dict, **kwargs) -> torch.Tensor:
    out = torch.full_like(step["q"], float("nan"))  # poisoned: every row must be written
    result = paged_attention(**step, out=out, **kwargs)
    assert result is out
    return out


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "NaN in output rows"
    out = out.float()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-6)).item()
    assert err < TOL[dtype], f"relative error {err:.3g}"


def random_lens(n: int, low: int, high: int) -> list[int]:
    return torch.randint(low, high + 1, (n,)).tolist()


_seed = seed_every_test(1234)


# ----------------------------------------------------------------------------- store_kvcache

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_store_kvcache_matches_reference_and_skips_minus_one(dtype, block_size):
    num_tokens, num_kv_heads, head_dim, num_blocks = 37, 2, 64, 6
    # k and v as strided views into a fused qkv projection, as the model produces them
    qkv = torch.randn(num_tokens, 8, head_dim).to(dtype).to(DEVICE)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.rand(num_tokens) < 0.3] = -1
    slot_mapping = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    store_kvcache_torch(k, v, k_ref, v_ref, slot_mapping)

    # bit-exact, NaN poison included: slots of -1 tokens and untouched slots keep their NaNs
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    written = (~k_cache.isnan()).all(-1).all(-1).sum().item()
    assert written == (slots >= 0).sum().item()


# ----------------------------------------------------------------------------- decode

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
def test_decode(dtype, block_size, head_dim, group):
    num_kv_heads = 2
    max_len = 1500 if CUDA else 150
    # one-token sequence, a length on a block boundary, random lengths
    seq_lens = [1, 2 * block_size] + random_lens(3, 2, max_len)
    step = make_step([1] * len(seq_lens), [s - 1 for s in seq_lens], block_size, num_kv_heads * group,
                     num_kv_heads, head_dim, dtype)
    assert_close(run_ours(step), reference(step), dtype)


@pytest.mark.parametrize("dtype", DTYPES[-1:] if CUDA else [torch.float32])
def test_decode_num_splits_agree(dtype):
    """Splits shorter than a sequence's KV, empty trailing splits, split counts not dividing the
    length: all must give the reference result."""
    seq_lens = [1, 40, 150] if not CUDA else [1, 40, 100, 333, 4097]
    step = make_step([1] * len(seq_lens), [s - 1 for s in seq_lens], 16, 4, 2, 64, dtype)
    ref = reference(step)
    base = run_ours(step, num_splits=1)
    assert_close(base, ref, dtype)
    for num_splits in [2, 3, 7] + ([16, MAX_SPLITS] if CUDA else []):
        out = run_ours(step, num_splits=num_splits)
        assert_close(out, ref, dtype)
        assert_close(out, base.float(), dtype)


def test_choose_decode_tile():
    small, large = (choose_decode_tile(n, 132, True) for n in (4 * 132, 4 * 132 + 1))
    assert small == (64, 3, 4) and large == (64, 2, 4)  # past 4 programs per SM: 2 stages
    assert choose_decode_tile(8, 132, False) == (32, 2, 4)


@pytest.mark.parametrize("dtype", DTYPES[-1:] if CUDA else [torch.float32])
def test_decode_tiles_agree(dtype):
    """Every decode tile bench_kernels.py --tile-sweep tries gives the reference: tiles wider and
    narrower than a cache block, one and several splits."""
    seq_lens = [1, 40, 150] if not CUDA else [1, 40, 333, 4097]
    step = make_step([1] * len(seq_lens), [s - 1 for s in seq_lens], 16, 4, 2, 64, dtype)
    ref = reference(step)
    for tile in ((32, 2, 4), (128, 2, 8)) + (((64, 4, 4), (128, 3, 4)) if CUDA else ()):
        for num_splits in (1, 3):
            assert_close(run_ours(step, num_splits=num_splits, decode_tile=tile), ref, dtype)


@pytest.mark.parametrize("block_size", [16, 128])
def test_decode_first_tile_before_the_wait_matches_the_loop(monkeypatch, block_size):
    """The decode kernel's two paths: its first K/V tile loaded before the PDL wait (small grids)
    and every tile in the loop (the rest). Both give the reference, and the same numbers (the same
    bits under the interpreter), with splits of one tile and of several, a partial last tile, empty
    trailing splits, a padding row, and one cache block per row (block_size 16 < BLOCK_N) or per
    tile."""
    import importlib
    attention_mod = importlib.import_module("asyncllm.kernels.paged_attention")
    dtype = DTYPES[-1] if CUDA else torch.float32
    step = make_step([1, 1, 1], [0, 63, 299], block_size, 4, 2, 64, dtype)
    step["seq_lens"] = torch.tensor([0, 64, 300], dtype=torch.int32, device=DEVICE)
    live = [1, 2]
    ref = reference(make_sub_step(step, live))
    for num_splits in (1, 2, 5):
        outs = []
        for per_sm in (10 ** 6, 0):  # every grid takes the early tile, then none does
            monkeypatch.setattr(attention_mod, "FIRST_TILE_EARLY_PROGRAMS_PER_SM", per_sm)
            out = run_ours(step, num_splits=num_splits)
            assert torch.equal(out[0], torch.zeros_like(out[0]))
            assert_close(out[live], ref, dtype)
            outs.append(out)
        if CUDA:  # compiled, the two paths may round differently (fused multiply-adds): within bf16's step
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_decode_with_rope_matches_the_rotary_kernel_then_decode(monkeypatch, block_size, qk_norm):
    """paged_attention given the fused projection and a DecodeRope: on a small grid the decode kernel
    normalises and rotates q and k itself, stores the K/V row and attends it from registers (the
    cache at that position holds NaN before: it must not be read); on a larger grid (forced here)
    the rotary kernel runs first. Either way the cache ends bit-equal to the rotary kernel's stores
    and the output matches the rotary kernel then the decode, and the reference, with the current
    position in the first, a middle or the last split, and a padding row (seq_len 0, slot -1)."""
    import importlib
    from asyncllm.kernels.fused_ops import qk_norm_rope_
    from asyncllm.attention.base import DecodeRope
    from asyncllm.layers.rotary import RotaryEmbedding
    attention_mod = importlib.import_module("asyncllm.kernels.paged_attention")
    dtype = DTYPES[-1] if CUDA else torch.float32
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    step = make_step([1] * 4, [0, 63, 299, 40], block_size, num_heads, num_kv_heads, head_dim, dtype)
    seq_lens = torch.tensor([0, 64, 300, 41], device=DEVICE)
    step["seq_lens"] = seq_lens.to(torch.int32)
    positions = (seq_lens - 1).clamp_min(0)
    tables = step["block_tables"].long()
    slots = tables[torch.arange(4, device=DEVICE), positions // block_size] * block_size + positions % block_size
    slots[0] = -1
    for cache in (step["k_cache"], step["v_cache"]):
        cache.view(-1, num_kv_heads, head_dim)[slots[1:]] = float("nan")  # this step's rows: not there yet
    qkv = torch.randn(4, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    weights = [(1 + 0.5 * torch.randn(head_dim, device=DEVICE)).to(dtype) for _ in range(2)] if qk_norm else []
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE).cos_sin_cache
    rope = DecodeRope(num_heads, positions, cos_sin, slots, *weights)
    live = [1, 2, 3]

    def rotary_then_decode(num_splits):
        ref_qkv, k_cache, v_cache = qkv.clone(), step["k_cache"].clone(), step["v_cache"].clone()
        qk_norm_rope_(ref_qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, *weights,
                      kv_cache=(k_cache, v_cache), slot_mapping=slots)
        ref_step = dict(step, q=ref_qkv[:, :num_heads * head_dim].view(4, num_heads, head_dim),
                        k_cache=k_cache, v_cache=v_cache)
        return run_ours(ref_step, num_splits=num_splits), reference(make_sub_step(ref_step, live)), k_cache, v_cache

    for num_splits in (1, 2, 5):
        expected, ref, ref_k, ref_v = rotary_then_decode(num_splits)
        for per_sm in (10 ** 6, 0):  # the decode kernel's own rotary, then the rotary kernel's
            monkeypatch.setattr(attention_mod, "FIRST_TILE_EARLY_PROGRAMS_PER_SM", per_sm)
            k_cache, v_cache = step["k_cache"].clone(), step["v_cache"].clone()
            out = torch.full((4, num_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
            paged_attention(qkv.clone(), k_cache, v_cache, step["query_start_loc"], step["seq_lens"], tables.int(),
                            1, 300, head_dim ** -0.5, out=out, num_splits=num_splits, rope=rope)
            assert torch.equal(out[0], torch.zeros_like(out[0]))
            assert_close(out[live], ref, dtype)
            assert_close(out[live], expected[live].float(), dtype)
            for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
                assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0), want.nan_to_num(0))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_zero_length_rows_are_zero(num_splits):
    """CUDA-graph padding rows (seq_len 0) produce zeros and don't disturb the real rows."""
    dtype = torch.bfloat16
    step = make_step([1, 1, 1, 1], [0, 50, 0, 99], 16, 4, 2, 64, dtype)
    step["seq_lens"] = torch.tensor([0, 51, 0, 100], dtype=torch.int32, device=DEVICE)
    out = run_ours(step, num_splits=num_splits)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    live = [1, 3]
    sub = make_sub_step(step, live)
    assert_close(out[live], reference(sub), dtype)


def make_sub_step(step: dict, rows: list[int]) -> dict:
    """The decode step restricted to some sequences (one query token each)."""
    sub = dict(step)
    sub["q"] = step["q"][rows]
    sub["seq_lens"] = step["seq_lens"][rows]
    sub["block_tables"] = step["block_tables"][rows]
    sub["query_start_loc"] = torch.arange(len(rows) + 1, dtype=torch.int32, device=DEVICE)
    sub["max_seq_len"] = int(sub["seq_lens"].max())
    return sub


@gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 3, 32, 256])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("max_len", [1024, 8192])
def test_decode_large(batch, block_size, max_len):
    if batch == 256 and max_len == 8192:
        max_len = 2048  # keeps the fp32 reference small
    seq_lens = random_lens(batch - 1, 1, max_len) + [max_len]
    step = make_step([1] * batch, [s - 1 for s in seq_lens], block_size, 32, 8, 128, torch.bfloat16)
    assert_close(run_ours(step), reference(step), torch.bfloat16)


# ----------------------------------------------------------------------------- prefill / mixed

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
def test_mixed_prefill_and_decode(dtype, block_size, head_dim, group):
    """Decodes, prefill chunks over cached context and fresh prefills in one step."""
    if CUDA:
        query_lens = [1, 1, 300, 1, 64, 1000, 17]
        context_lens = [5, 2000, 0, 700, 128, 1500, 0]
    else:
        query_lens = [1, 35, 1, 12]
        context_lens = [30, 0, 90, 45]
    num_kv_heads = 2
    step = make_step(query_lens, context_lens, block_size, num_kv_heads * group, num_kv_heads, head_dim, dtype)
    assert_close(run_ours(step), reference(step), dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_step_decodes_take_the_decode_kernel(num_splits):
    """A mixed step's one-row sequences (decodes, a one-token chunk) go to the decode kernel, split
    or not, the rest to the varlen kernel: the reference's result, as with every row in the varlen
    kernel (single_rows=False), and rows of no sequence stay poisoned."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    query_lens, context_lens = [1, 40, 1, 1, 9], [70, 0, 3, 150, 20]
    step = make_step(query_lens, context_lens, 16, 4, 2, 64, dtype)
    step["q"] = torch.cat([step["q"], torch.randn_like(step["q"][:3])])  # 3 rows beyond the last sequence
    ref = reference(dict(step, q=step["q"][:-3]))
    routed = run_ours(step, num_splits=num_splits)
    assert routed[-3:].isnan().all()
    assert_close(routed[:-3], ref, dtype)
    assert_close(run_ours(step, single_rows=False)[:-3], ref, dtype)


def test_odd_group_head_dim_and_fp16():
    """3 query heads per KV head, a head_dim that is not a power of two, fp16."""
    dtype = torch.float16
    step = make_step([1, 30, 7], [20, 3, 0], 16, 6, 2, 48, dtype)
    assert_close(run_ours(step), reference(step), dtype)
    decode = make_step([1, 1], [20, 70], 16, 6, 2, 48, dtype)
    assert_close(run_ours(decode, num_splits=2), reference(decode), dtype)


def test_block_table_narrower_than_seq_len_does_not_fault():
    """The runner's memory probe runs long prefills over a one-column block table; table reads
    are clamped to its width, so the kernel stays in bounds (its output is meaningless)."""
    step = make_step([40], [0], 16, 4, 2, 64, torch.float32)
    step["block_tables"] = step["block_tables"][:, :1].contiguous()
    step["k_cache"] = step["k_cache"].nan_to_num(0.0)
    step["v_cache"] = step["v_cache"].nan_to_num(0.0)
    assert run_ours(step).isfinite().all()


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_large(block_size, head_dim):
    query_lens = [1024, 1, 2048, 333, 1]
    context_lens = [4096, 8000, 0, 1024, 100]
    step = make_step(query_lens, context_lens, block_size, 16, 8, head_dim, torch.bfloat16)
    assert_close(run_ours(step), reference(step), torch.bfloat16)


@gpu
@needs_cuda
def test_batch_size_and_table_width_compile_no_new_variants():
    """Steps of any batch size and block-table width reuse one compiled kernel per path: a
    compile on the serving path costs the host about a second."""
    from asyncllm.kernels import compiled_variants

    def counts(batch: int, width: int, query_len: int) -> dict:
        max_context = width * 16 - query_len  # fits a table of exactly `width` 16-token blocks
        step = make_step([query_len] * batch, random_lens(batch - 1, 1, max_context) + [max_context], 16, 8, 4,
                         128, torch.bfloat16)
        step["block_tables"] = step["block_tables"][:, :width].contiguous()
        # a step without decodes launches the varlen kernel alone, as the backend's (single_rows=False)
        out = run_ours(step, num_splits=3) if query_len == 1 else run_ours(step, single_rows=False)
        assert_close(out, reference(step), torch.bfloat16)
        return compiled_variants()

    for query_len in (1, 5):  # the decode pair, then the varlen kernel
        # the decode kernel's two paths: the first KV tile before the PDL wait on a small grid (5
        # sequences x 4 KV heads x 3 splits) and not on a large one (32 x 4 x 3), each compiled once
        counts(5, 9, query_len)
        first = counts(32, 9, query_len)
        # a batch of 1, widths of 1 and of multiples of 16: the values Triton specializes on
        for batch, width in ((1, 1), (16, 32), (1, 16), (3, 7), (32, 1)):
            assert counts(batch, width, query_len) == first, (batch, width, query_len)


# ----------------------------------------------------------------------------- prefill split-KV

def run_split(step: dict, prefill_splits: int, split_tokens: int, **kwargs) -> torch.Tensor:
    """run_ours with the varlen kernel's KV split prefill_splits ways (split_tokens: the least KV a
    split takes), into a NaN-poisoned workspace that the split path must have written."""
    num_tokens, num_heads, head_dim = step["q"].shape
    numel = split_workspace_numel(num_tokens, num_heads, head_dim, prefill_splits)
    workspace = torch.full((numel + 1,), float("nan"), device=DEVICE)  # decodes here: one split, no scratch
    out = run_ours(step, prefill_splits=prefill_splits, split_tokens=split_tokens, workspace=workspace,
                   num_splits=1, **kwargs)
    assert not workspace[:numel].isnan().all(), "the split path wrote no partials"
    return out


# (query_lens, context_lens, prefill_splits, split_tokens, block_size, group): CPU tiles are fp32
# BLOCK_N 32 / bf16 BLOCK_N 64, BLOCK_Q = 64 // group rows
PREFILL_SPLIT_CASES = [
    # 8 splits of one 64-position tile over 305 positions: the last three empty (lse -inf)
    ([5], [300], 8, 1, 16, 2),
    # 3 splits of 64 over [0, 132): the boundary at 128 lies inside the diagonal (positions 100..131)
    ([40], [100], 3, 1, 16, 2),
    # uneven splits; decodes beside the chunks (the decode kernel's), a fresh prompt, GQA 4
    ([1, 33, 1, 70], [150, 270, 64, 0], 5, 1, 64, 4),
    # one KV head per query head, splits of at least 96 positions: the short chunk's tiles go unsplit
    ([2, 17, 1], [400, 20, 33], 4, 96, 16, 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_SPLIT_CASES, ids=lambda case: f"{case[0]}-over-{case[1]}")
def test_prefill_split_kv_matches_reference(dtype, case):
    """The varlen kernel with split KV and the merge, against the reference: empty splits, uneven
    ones, a split boundary inside the causal diagonal, decodes beside, GQA, tiles left unsplit; rows
    past the last sequence stay poisoned."""
    query_lens, context_lens, splits, split_tokens, block_size, group = case
    step = make_step(query_lens, context_lens, block_size, 2 * group, 2, 64, dtype)
    ref = reference(step)
    step["q"] = torch.cat([step["q"], torch.randn_like(step["q"][:3])])  # 3 rows beyond the last sequence
    out = run_split(step, splits, split_tokens)
    assert out[-3:].isnan().all()
    assert_close(out[:-3], ref, dtype)


def test_prefill_split_one_row_chunks_in_the_varlen_kernel():
    """single_rows=False: one-row sequences are the varlen kernel's too, split and merged like the rest."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    step = make_step([1, 9, 1], [200, 130, 7], 16, 4, 2, 64, dtype)
    assert_close(run_split(step, 4, 1, single_rows=False), reference(step), dtype)


def test_prefill_unsplit_tiles_write_directly_bit_for_bit():
    """A tile whose KV is under two splits' worth is not split: its output is the unsplit kernel's,
    bit for bit (the same loop, written directly), and nothing is left for the merge to clobber."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    step = make_step([30, 12], [90, 5], 16, 4, 2, 64, dtype)
    unsplit = run_ours(step, prefill_splits=1)
    assert torch.equal(run_ours(step, prefill_splits=4, split_tokens=4096), unsplit)
    assert_close(unsplit, reference(step), dtype)


def test_choose_prefill_splits():
    # 0.6B's shape (16 heads, 8 KV heads, bf16): 64 new tokens over 32k, one 64-row tile per KV head
    chat_turn = dict(num_heads=16, num_kv_heads=8, head_dim=128, small_elems=True, max_seq_len=32768 + 64, num_sms=132)
    assert choose_prefill_splits(64, 1, 64, **chat_turn) == MAX_PREFILL_SPLITS
    # a mixed CUDA graph of 64 tokens has room for 64 sequences: its grid's surplus programs cap the count
    in_graph = choose_prefill_splits(64, 64, 64, **chat_turn)
    assert 1 < in_graph < MAX_PREFILL_SPLITS
    # a short context does not split, nor a chunk whose tiles already fill the SMs
    assert choose_prefill_splits(64, 1, 64, **dict(chat_turn, max_seq_len=2 * PREFILL_SPLIT_TOKENS - 1)) == 1
    assert choose_prefill_splits(64, 1, 64, **dict(chat_turn, max_seq_len=2 * PREFILL_SPLIT_TOKENS)) == 2
    assert choose_prefill_splits(8192, 1, 8192, **chat_turn) == 1
    # more rows, fewer splits; never more than the context gives splits of split_tokens
    counts = [choose_prefill_splits(n, 1, n, **chat_turn) for n in (16, 64, 256, 512, 1024, 2048)]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1, counts
    assert choose_prefill_splits(64, 1, 64, **dict(chat_turn, max_seq_len=8192)) == 8192 // PREFILL_SPLIT_TOKENS
    assert choose_prefill_splits(64, 1, 64, **chat_turn, split_tokens=16) == MAX_PREFILL_SPLITS
    # a prompt with no cached prefix (its KV is its own rows) at bench_latency's TTFT lengths: unsplit
    for n in (128, 1024):
        assert choose_prefill_splits(n, 1, n, **dict(chat_turn, max_seq_len=n)) == 1
    assert split_workspace_numel(64, 16, 128, 1) == 0 and split_workspace_numel(64, 16, 128, 4) == 64 * 16 * 4 * 129


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_heads", [16, 32])
@pytest.mark.parametrize("query_len", [1, 16, 64, 300, 512])
@pytest.mark.parametrize("context", [8192, 32768 - 512])
def test_prefill_split_large(block_size, num_heads, query_len, context):
    """Short chunks over long contexts in bf16, beside decodes and a short chunk: the split count
    chosen and a forced uneven one, against the reference."""
    query_lens, context_lens = [query_len, 1, 40, 1], [context, 30000, 100, 5]
    step = make_step(query_lens, context_lens, block_size, num_heads, 8, 128, torch.bfloat16)
    ref = reference(step)
    chosen = choose_prefill_splits(step["q"].shape[0], 4, step["max_query_len"], num_heads, 8, 128, True,
                                   step["max_seq_len"], torch.cuda.get_device_properties(0).multi_processor_count)
    assert_close(run_ours(step), ref, torch.bfloat16)
    # a one-row chunk is the decode kernel's (single_rows), leaving the varlen kernel only the short
    # 40-row chunk, too short to split: its split path is the single_rows=False run below
    for splits in ({chosen, 7} if query_len > 1 else ()):
        if splits > 1:
            assert_close(run_split(step, splits, PREFILL_SPLIT_TOKENS), ref, torch.bfloat16)
    # the varlen kernel alone (a one-row chunk there too)
    assert_close(run_split(step, 7, PREFILL_SPLIT_TOKENS, single_rows=False), ref, torch.bfloat16)


# ----------------------------------------------------------------------------- num_splits

def test_choose_num_splits():
    assert choose_num_splits(256, 8, 4096, 132) == 1  # plenty of programs already
    # rounded down: a grid just short of PROGRAMS_PER_SM x SMs (64 x 8 of 4 x 132) runs unsplit
    assert choose_num_splits(64, 8, 8192, 132) == 1
    assert choose_num_splits(8, 8, 8192, 132) == 8
    assert choose_num_splits(16, 8, 8192, 132) == 4
    assert choose_num_splits(1, 8, 30, 132) == 1  # too short to split
    one = choose_num_splits(1, 8, 8192, 132)
    assert 16 <= one <= MAX_SPLITS
    assert choose_num_splits(16, 8, 8192, 132) < one
    assert choose_num_splits(1, 1, 10 ** 6, 132) == MAX_SPLITS
    assert split_workspace_numel(4, 8, 128, 1) == 0


# ----------------------------------------------------------------------------- backend

def make_batch(query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor,
               block_size: int) -> ForwardBatch:
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    tables = block_tables.cpu()
    slot_mapping = tables[rows, positions // block_size].long() * block_size + positions % block_size
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    return ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64, device=DEVICE), positions=positions.to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE), query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=block_tables,
        logits_indices=(query_start_loc[1:] - 1).long().to(DEVICE), num_seqs=len(query_lens),
        num_tokens=len(positions), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens)


def make_backends(block_size: int, num_blocks: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, num_layers: int = 2, split_tokens: int = PREFILL_SPLIT_TOKENS):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape).to(dtype).to(DEVICE) for _ in range(2 * num_layers)]
    ours = TritonAttentionBackend([c.clone() for c in caches[:num_layers]],
                                  [c.clone() for c in caches[num_layers:]],
                                  num_heads, num_kv_heads, head_dim, head_dim ** -0.5, split_tokens=split_tokens)
    ref = TorchAttentionBackend([c.float() for c in caches[:num_layers]], [c.float() for c in caches[num_layers:]],
                                num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    return ours, ref


def qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    return (torch.randn(num_tokens, num_heads, head_dim).to(dtype).to(DEVICE),
            torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(DEVICE),
            torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(DEVICE))


def check_backend_step(ours, ref, batch, layer, q, k, v, dtype):
    """Same outputs and, bit for bit, the same caches as the reference backend."""
    out = ours.forward(layer, q, k, v, batch)
    expected = ref.forward(layer, q.float(), k.float(), v.float(), batch)
    assert_close(out, expected, dtype)
    assert torch.equal(ours.k_caches[layer].float(), ref.k_caches[layer].to(dtype).float())
    assert torch.equal(ours.v_caches[layer].float(), ref.v_caches[layer].to(dtype).float())


@pytest.mark.parametrize("dtype", DTYPES[-1:] if CUDA else [torch.float32])
@pytest.mark.parametrize("split_tokens", [PREFILL_SPLIT_TOKENS, 16])
def test_backend_prefill_then_decode(dtype, split_tokens):
    """An eager mixed step, then a decode step; with split_tokens 16 the step's chunks split their KV
    (a prefix-cache hit's chunk over cached context is such a step)."""
    block_size, num_heads, num_kv_heads, head_dim = 16, 4, 2, 64
    ours, ref = make_backends(block_size, 24, num_heads, num_kv_heads, head_dim, dtype, split_tokens=split_tokens)
    block_tables = torch.randperm(24, dtype=torch.int32).view(3, 8).to(DEVICE)
    # a mixed step: a fresh prefill, a chunk over cached context, a decode
    query_lens, context_lens = [20, 9, 1], [0, 30, 60]
    batch = make_batch(query_lens, context_lens, block_tables, block_size)
    for layer in range(2):
        ours.prepare_metadata(batch)
        assert (batch.attn_metadata.prefill_splits > 1) == (split_tokens < PREFILL_SPLIT_TOKENS)
        check_backend_step(ours, ref, batch, layer, *qkv(batch.num_tokens, num_heads, num_kv_heads, head_dim,
                                                          dtype), dtype)
    # then a decode step of all three
    batch = make_batch([1, 1, 1], [20, 39, 61], block_tables, block_size)
    ours.prepare_metadata(batch)
    assert batch.attn_metadata.num_splits >= 1
    check_backend_step(ours, ref, batch, 1, *qkv(3, num_heads, num_kv_heads, head_dim, dtype), dtype)


@pytest.mark.parametrize("early", [True, False])
def test_attention_layer_hands_the_rotary_to_the_decode_kernel(monkeypatch, early):
    """A Qwen3 attention layer on the fused path at a decode step: the Triton backend takes the
    projection (attend_qkv) and its decode kernel does the q/k norm + rotary and the K/V store, or
    (a larger grid, forced) runs the rotary kernel first. Same output as the layer with the rotary
    kernel then forward, and as the PyTorch layer over the reference backend; the caches bit-equal."""
    import importlib
    from types import SimpleNamespace

    from asyncllm.kernels import fused_ops
    from asyncllm.layers.rotary import RotaryEmbedding
    from asyncllm.models.transformer import DecoderAttention
    attention_mod = importlib.import_module("asyncllm.kernels.paged_attention")
    monkeypatch.setattr(attention_mod, "FIRST_TILE_EARLY_PROGRAMS_PER_SM", 2 if early else 0)
    decode_kernel, rope_in_kernel = attention_mod._decode_kernel, []

    class Spy:  # notes whether each decode launch did the rotary itself
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                rope_in_kernel.append(kwargs["ROPE"])
                return decode_kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attention_mod, "_decode_kernel", Spy())
    dtype = DTYPES[-1] if CUDA else torch.float32
    block_size, num_heads, num_kv_heads, head_dim = 16, 8, 2, 64
    config = SimpleNamespace(hidden_size=128, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                             head_dim=head_dim, rms_norm_eps=1e-6)
    layer = DecoderAttention(config, 0, qkv_bias=False, o_bias=False, qk_norm=True,
                             rotary_emb=RotaryEmbedding(head_dim, 512, 1e6)).to(DEVICE)
    for param in layer.parameters():
        param.data = (0.2 * torch.randn_like(param) + (1 if param.dim() == 1 else 0)).to(dtype)
    layer.rotary_emb.to(DEVICE)
    block_tables = torch.randperm(24, dtype=torch.int32).view(3, 8).to(DEVICE)
    batch = make_batch([1, 1, 1], [20, 39, 100], block_tables, block_size)
    hidden = torch.randn(3, 128, device=DEVICE).to(dtype)

    def run(fused: bool, hand_over: bool):
        torch.manual_seed(1)  # the same caches each time
        ours, ref = make_backends(block_size, 24, num_heads, num_kv_heads, head_dim, dtype, num_layers=1)
        backend = ours if fused else ref
        monkeypatch.setattr(layer, "_fused", fused_ops if fused else None)
        monkeypatch.setattr(layer, "_norm_rope", layer._norm_rope_fused if fused else layer._norm_rope_native)
        if not hand_over:
            monkeypatch.setattr(backend, "attend_qkv", lambda *args: None)
        batch.attn_backend = backend
        backend.prepare_metadata(batch)
        with torch.no_grad():
            out = layer(batch.positions, hidden, batch)
        return out.float(), backend.k_caches[0].float(), backend.v_caches[0].float()

    handed = run(True, True)
    assert rope_in_kernel == [early]
    unfused, native = run(True, False), run(False, False)
    assert rope_in_kernel == [early, False]
    assert_close(handed[0], unfused[0], dtype)
    assert_close(handed[0], native[0], dtype)
    assert torch.equal(handed[1], unfused[1]) and torch.equal(handed[2], unfused[2])


def test_backend_graph_buffers_eagerly():
    """The CUDA-graph metadata path without a graph: capture-time metadata given as None (as the
    graph runner does) stores and attends to nothing; replay buffers then carry a smaller live
    batch with a narrower block table, padded to the graph's batch size."""
    dtype, block_size, num_heads, num_kv_heads, head_dim = torch.float32, 16, 4, 2, 64
    graph_bs, max_blocks, num_blocks = 4, 16, 24
    ours, ref = make_backends(block_size, num_blocks, num_heads, num_kv_heads, head_dim, dtype, num_layers=1)
    ours.init_cuda_graph_state(graph_bs, max_blocks)
    static = ForwardBatch(input_ids=torch.zeros(graph_bs, dtype=torch.int64, device=DEVICE),
                          positions=torch.zeros(graph_bs, dtype=torch.int64, device=DEVICE), slot_mapping=None,
                          query_start_loc=None, seq_lens=None, block_tables=None, logits_indices=None,
                          num_seqs=graph_bs, num_tokens=graph_bs, max_query_len=1,
                          max_seq_len=max_blocks * block_size)  # the graph's context bound
    ours.prepare_for_capture(static)
    assert static.max_seq_len == max_blocks * block_size and static.attn_metadata.num_splits > 1
    k_before = ours.k_caches[0].clone()
    q, k, v = qkv(graph_bs, num_heads, num_kv_heads, head_dim, dtype)
    out = ours.forward(0, q, k, v, static)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ours.k_caches[0], k_before)

    tables = torch.randperm(num_blocks, dtype=torch.int32)[:3 * 4].view(3, 4).to(DEVICE)
    live = make_batch([1, 1, 1], [10, 63, 30], tables, block_size)
    ours.prepare_for_replay(live, static)
    q_live, k_live, v_live = qkv(3, num_heads, num_kv_heads, head_dim, dtype)
    q[:3], k[:3], v[:3] = q_live, k_live, v_live
    k[3:] = float("nan")  # the padding row must not be stored
    out = ours.forward(0, q, k, v, static)
    expected = ref.forward(0, q_live, k_live, v_live, live)
    assert_close(out[:3], expected, dtype)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert torch.equal(ours.k_caches[0], ref.k_caches[0]) and torch.equal(ours.v_caches[0], ref.v_caches[0])


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
def test_fa4_backend_matches_reference(block_size):
    """The FlashAttention-4 backend on our paged cache (its page_table path; page sizes other than
    its KV tile take a non-TMA path) against the PyTorch reference: a mixed step of a fresh prompt,
    chunks over cached context and decodes, then a decode-only step."""
    pytest.importorskip("flash_attn.cute")
    from asyncllm.attention.flash_attn_backend import FA4AttentionBackend
    dtype, num_heads, num_kv_heads, head_dim = torch.bfloat16, 16, 8, 128
    num_blocks = 4 * cdiv(1100, block_size) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape).to(dtype).to(DEVICE) for _ in range(2)]
    ours = FA4AttentionBackend([caches[0].clone()], [caches[1].clone()], num_heads, num_kv_heads, head_dim,
                               head_dim ** -0.5)
    ref = TorchAttentionBackend([caches[0].float()], [caches[1].float()], num_heads, num_kv_heads, head_dim,
                                head_dim ** -0.5)
    tables = torch.randperm(num_blocks, dtype=torch.int32)[:4 * cdiv(1100, block_size)].view(4, -1).to(DEVICE)
    for query_lens, context_lens in (([300, 1, 50, 1], [0, 700, 130, 64]), ([1, 1, 1, 1], [300, 701, 180, 65])):
        batch = make_batch(query_lens, context_lens, tables, block_size)
        ours.prepare_metadata(batch)
        check_backend_step(ours, ref, batch, 0, *qkv(batch.num_tokens, num_heads, num_kv_heads, head_dim, dtype),
                           dtype)


def test_decode_graph_context_bounds():
    """Decode graphs' context bounds: ascending, ending at the longest context, one per distinct
    split count (a batch that fills the GPU without splitting gets one graph)."""
    from asyncllm.attention.triton_backend import DECODE_GRAPH_CONTEXTS
    ours, _ = make_backends(16, 8, 16, 8, 64, torch.float32, num_layers=1)
    assert ours.decode_graph_context_bounds(1, 40960) == [*DECODE_GRAPH_CONTEXTS, 40960]
    assert ours.decode_graph_context_bounds(1, 512) == [256, 512]
    assert ours.decode_graph_context_bounds(1, 100) == [100]
    assert ours.decode_graph_context_bounds(256, 40960) == [40960]
    # a graph's split count is the one for half its bound: its replays' contexts lie below it
    assert [ours._graph_num_splits(1, bound) for bound in (256, 1024, 2048, 40960)] == [4, 16, 32, 64]
    for batch_size in (1, 2, 4, 8, 16, 32, 64):
        bounds = ours.decode_graph_context_bounds(batch_size, 40960)
        counts = [ours._graph_num_splits(batch_size, bound) for bound in bounds]
        assert bounds == sorted(bounds) and bounds[-1] == 40960
        assert counts == sorted(set(counts)), (batch_size, bounds, counts)


def test_mixed_graph_context_bounds():
    """A mixed graph that splits KV at the longest context gets a second, unsplit graph for contexts
    under two splits' worth, where no tile splits (a prompt with no cached prefix: issue 49's TTFT
    regression, a split grid and a merge kernel a layer on every such replay): one split, no
    workspace. Issue 44's 64-token turn over 32k keeps its split graph."""
    ours, ref = make_backends(16, 4, 16, 8, 128, torch.bfloat16, num_layers=1)  # 0.6B's attention, bf16
    unsplit = longest_unsplit_context(ours.split_tokens)
    max_context = 4096  # bench_latency: max_model_len 4096, max_num_seqs 8, mixed graphs to 2048 tokens
    ours.init_cuda_graph_state(8, cdiv(max_context, 16), max_mixed_tokens=2048)
    for tokens in (128, 1024):
        assert ours.mixed_graph_context_bounds(tokens, 8, max_context) == [unsplit, max_context]
        split = ours._mixed_graph_prefill_splits(tokens, 8, max_context)
        assert split > 1
        for bound, splits in ((unsplit, 1), (max_context, split)):
            capture = mixed_capture_batch(tokens, 8, bound)
            ours.prepare_for_capture(capture)
            assert capture.attn_metadata.prefill_splits == splits
            assert (capture.attn_metadata.workspace is None) == (splits == 1)
    # a bucket whose tiles fill the SMs never splits, nor does a context under two splits: one graph
    assert ours.mixed_graph_context_bounds(2048, 8, max_context) == [max_context]
    assert ours.mixed_graph_context_bounds(128, 8, unsplit) == [unsplit]
    # issue 44: a 64-token graph (room for 64 sequences) over 32k splits as the kernel chooses
    assert ours.mixed_graph_context_bounds(64, 64, 32768) == [unsplit, 32768]
    assert ours._mixed_graph_prefill_splits(64, 64, 32768) == choose_prefill_splits(
        64, 64, 64, 16, 8, 128, True, 32768, ours.num_sms) > 1
    assert ref.mixed_graph_context_bounds(128, 8, max_context) == [max_context]  # no split to avoid


def test_backend_unsplit_mixed_graph_eagerly(monkeypatch):
    """The unsplit mixed graph's metadata path without a graph (split_tokens 16: contexts up to 31
    tokens): prompts with no cached prefix and short cached ones, padded into it, exact, through the
    varlen kernel alone, as before split-KV: no merge launched, no workspace."""
    dtype, block_size, num_heads, num_kv_heads, head_dim = torch.float32, 16, 4, 2, 64
    graph_tokens, graph_seqs, max_blocks, num_blocks = 64, 8, 8, 48
    ours, ref = make_backends(block_size, num_blocks, num_heads, num_kv_heads, head_dim, dtype, num_layers=1,
                              split_tokens=16)
    ours.init_cuda_graph_state(graph_seqs, max_blocks, max_mixed_tokens=graph_tokens)
    bounds = ours.mixed_graph_context_bounds(graph_tokens, graph_seqs, max_blocks * block_size)
    assert bounds == [31, max_blocks * block_size]
    capture = mixed_capture_batch(graph_tokens, graph_seqs, bounds[0])
    ours.prepare_for_capture(capture)
    assert capture.attn_metadata.prefill_splits == 1 and capture.attn_metadata.workspace is None

    def no_merge(*args, **kwargs):
        raise AssertionError("the unsplit graph launched a merge")
    # the module, not asyncllm.kernels' function of the same name
    monkeypatch.setattr(sys.modules["asyncllm.kernels.paged_attention"], "_merge", no_merge)
    q_buf, k_buf, v_buf = qkv(graph_tokens, num_heads, num_kv_heads, head_dim, dtype)
    replay_mixed_graph(ours, ref, capture, (q_buf, k_buf, v_buf), num_blocks, graph_seqs, max_blocks, block_size,
                       dtype, [
        ([31], [0]),  # a prompt with no cached prefix, as long as the bound
        ([20, 1, 9], [0, 10, 22]),  # a fresh prompt, a decode, a chunk over cached context
    ])


def test_graph_bucket_sizes():
    from asyncllm.runner.cuda_graph import graph_batch_sizes, graph_token_sizes
    assert graph_token_sizes(0) == []
    assert graph_token_sizes(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
    assert graph_token_sizes(100) == [16, 32, 64, 100] and graph_token_sizes(10) == [10]
    for sizes in (graph_token_sizes(3000), graph_batch_sizes(300)):
        assert sizes == sorted(set(sizes))
        assert all(b <= a * 2 for a, b in zip(sizes, sizes[1:]))  # no step pads by more than half
    assert graph_batch_sizes(512)[-1] == 512 and graph_batch_sizes(5) == [1, 2, 4, 5]


def mixed_capture_batch(num_tokens: int, num_seqs: int, context_bound: int) -> ForwardBatch:
    """A mixed graph's capture batch, as the graph runner makes it: no attention metadata of its own."""
    return ForwardBatch(input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE), positions=None,
                        slot_mapping=None, query_start_loc=None, seq_lens=None, block_tables=None,
                        logits_indices=None, num_seqs=num_seqs, num_tokens=num_tokens, max_query_len=num_tokens,
                        max_seq_len=context_bound)


def replay_mixed_graph(ours, ref, capture, qkv_bufs, num_blocks, graph_seqs, max_blocks, block_size, dtype, cases):
    """run_mixed_replays over the graph that ours.forward on capture (a captured mixed batch) stands for,
    its sequences' block tables drawn at random from num_blocks."""
    q_buf, k_buf, v_buf = qkv_bufs

    def run_graph():
        return ours.forward(0, q_buf, k_buf, v_buf, capture)
    run_graph.capture_batch = capture
    tables = torch.randperm(num_blocks, dtype=torch.int32)[:graph_seqs * max_blocks // 2].view(
        graph_seqs // 2, max_blocks).to(DEVICE)
    run_mixed_replays(ours, ref, run_graph, q_buf, k_buf, v_buf, tables, block_size, dtype, cases)


def run_mixed_replays(ours, ref, run_graph, q_buf, k_buf, v_buf, tables, block_size, dtype, steps):
    """Each step (query_lens, context_lens) loaded into the mixed graph's buffers (padding rows
    NaN: never stored, never read), run through run_graph, and checked against the reference."""
    num_heads, num_kv_heads, head_dim = q_buf.shape[1], k_buf.shape[1], k_buf.shape[2]
    for query_lens, context_lens in steps:
        live = len(query_lens)
        sub_tables = tables[:live, :cdiv(max(c + q for c, q in zip(context_lens, query_lens)), block_size)]
        batch = make_batch(query_lens, context_lens, sub_tables.contiguous(), block_size)
        t = batch.num_tokens
        q, k, v = qkv(t, num_heads, num_kv_heads, head_dim, dtype)
        q_buf[:t], k_buf[:t], v_buf[:t] = q, k, v
        q_buf[t:].normal_()
        k_buf[t:] = float("nan")
        v_buf[t:] = float("nan")
        ours.prepare_for_replay(batch, run_graph.capture_batch)
        out = run_graph()
        expected = ref.forward(0, q.float(), k.float(), v.float(), batch)
        assert_close(out[:t], expected, dtype)
        assert torch.equal(ours.k_caches[0].float(), ref.k_caches[0].to(dtype).float())
        assert torch.equal(ours.v_caches[0].float(), ref.v_caches[0].to(dtype).float())


@pytest.mark.parametrize("split_tokens", [PREFILL_SPLIT_TOKENS, 16])
def test_backend_mixed_graph_buffers_eagerly(split_tokens):
    """A mixed CUDA graph's metadata path without a graph: a step of 64 tokens and 8 sequences,
    then live steps with fewer tokens and sequences (prefill chunks over cached context beside
    decodes) padded into it. The padding must store nothing and leave the live rows exact. With
    split_tokens 16 the graph's varlen kernel splits KV, the count fixed at capture for a 128-token
    context, and replays with shorter contexts (tiles split fewer ways, or not at all) stay exact."""
    dtype, block_size, num_heads, num_kv_heads, head_dim = torch.float32, 16, 4, 2, 64
    graph_tokens, graph_seqs, max_blocks, num_blocks = 64, 8, 8, 48
    ours, ref = make_backends(block_size, num_blocks, num_heads, num_kv_heads, head_dim, dtype, num_layers=1,
                              split_tokens=split_tokens)
    ours.init_cuda_graph_state(graph_seqs, max_blocks, max_mixed_tokens=graph_tokens)
    capture = mixed_capture_batch(graph_tokens, graph_seqs, max_blocks * block_size)
    ours.prepare_for_capture(capture)
    assert capture.max_query_len == graph_tokens and capture.max_seq_len == max_blocks * block_size
    assert (capture.attn_metadata.prefill_splits > 1) == (split_tokens < PREFILL_SPLIT_TOKENS)
    q_buf, k_buf, v_buf = qkv(graph_tokens, num_heads, num_kv_heads, head_dim, dtype)
    k_before = ours.k_caches[0].clone()
    ours.forward(0, q_buf, k_buf, v_buf, capture)  # what warm-up and capture run: stores nothing
    assert torch.equal(ours.k_caches[0], k_before)
    replay_mixed_graph(ours, ref, capture, (q_buf, k_buf, v_buf), num_blocks, graph_seqs, max_blocks, block_size,
                       dtype, [
        ([20, 1, 9], [0, 40, 30]),  # a fresh prompt, a decode, a chunk over cached context
        ([1, 1, 1, 1], [10, 63, 30, 100]),  # decodes only, through the varlen kernel
        ([50, 14], [0, 5]),  # exactly the graph's token count
        ([5, 1, 30], [120, 90, 60]),  # chunks over the longest contexts the graph takes
    ])


def capture_mixed_graph(ours, capture, q_buf, k_buf, v_buf):
    """A CUDA graph of the backend's forward over the capture batch (after a warm-up off the graph),
    as run_mixed_replays' run_graph."""
    ours.prepare_for_capture(capture)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ours.forward(0, q_buf, k_buf, v_buf, capture)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf = ours.forward(0, q_buf, k_buf, v_buf, capture)

    def run_graph():
        graph.replay()
        return out_buf
    run_graph.capture_batch = capture
    return run_graph


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
def test_backend_mixed_cuda_graph_long_context_splits(block_size):
    """Issue 44's chat turn in a mixed graph: 64 tokens (room for 64 sequences) captured for a 32k
    context, so its varlen kernel splits KV; replays bring a new turn over 32k cached tokens, turns
    beside decodes, and short contexts (tiles unsplit) with the graph's split count."""
    dtype, num_heads, num_kv_heads, head_dim = torch.bfloat16, 16, 8, 128
    graph_tokens, graph_seqs, max_blocks = 64, 64, cdiv(32768, block_size)
    num_blocks = 4 * max_blocks
    ours, ref = make_backends(block_size, num_blocks, num_heads, num_kv_heads, head_dim, dtype, num_layers=1)
    ours.init_cuda_graph_state(graph_seqs, max_blocks, max_mixed_tokens=graph_tokens)
    capture = mixed_capture_batch(graph_tokens, graph_seqs, max_blocks * block_size)
    q_buf, k_buf, v_buf = qkv(graph_tokens, num_heads, num_kv_heads, head_dim, dtype)
    run_graph = capture_mixed_graph(ours, capture, q_buf, k_buf, v_buf)
    assert capture.attn_metadata.prefill_splits > 1
    tables = torch.randperm(num_blocks, dtype=torch.int32).view(4, max_blocks).to(DEVICE)
    run_mixed_replays(ours, ref, run_graph, q_buf, k_buf, v_buf, tables, block_size, dtype, [
        ([64], [32768 - 64]),
        ([16, 1, 1, 30], [20000, 32000, 9000, 4000]),
        ([1, 1], [32000, 100]),
        ([40, 20], [300, 0]),
    ])


@gpu
@needs_cuda
@pytest.mark.parametrize("split_tokens", [PREFILL_SPLIT_TOKENS, 64])
def test_backend_mixed_cuda_graph_replay(split_tokens):
    """Capture a mixed step of 256 tokens and 16 sequences; replay it with smaller mixed steps
    (split_tokens 64: with the varlen kernel's KV split, as over a long context)."""
    dtype, block_size, num_heads, num_kv_heads, head_dim = torch.bfloat16, 16, 16, 8, 128
    graph_tokens, graph_seqs, max_blocks, num_blocks = 256, 16, 64, 16 * 64
    ours, ref = make_backends(block_size, num_blocks, num_heads, num_kv_heads, head_dim, dtype, num_layers=1,
                              split_tokens=split_tokens)
    ours.init_cuda_graph_state(graph_seqs, max_blocks, max_mixed_tokens=graph_tokens)
    capture = mixed_capture_batch(graph_tokens, graph_seqs, max_blocks * block_size)
    q_buf, k_buf, v_buf = qkv(graph_tokens, num_heads, num_kv_heads, head_dim, dtype)
    run_graph = capture_mixed_graph(ours, capture, q_buf, k_buf, v_buf)
    assert (capture.attn_metadata.prefill_splits > 1) == (split_tokens < PREFILL_SPLIT_TOKENS)
    tables = torch.randperm(num_blocks, dtype=torch.int32).view(graph_seqs, max_blocks).to(DEVICE)
    run_mixed_replays(ours, ref, run_graph, q_buf, k_buf, v_buf, tables, block_size, dtype, [
        ([128, 1, 1, 60], [0, 500, 1000, 200]),
        ([1] * 16, random_lens(16, 1, max_blocks * block_size - 2)),
        ([200, 56], [300, 0]),
        ([17], [0]),
    ])


@gpu
@needs_cuda
def test_backend_cuda_graph_replay():
    """Capture a decode step for 8 sequences, replay it with 5 and then 8 live sequences."""
    dtype, block_size, num_heads, num_kv_heads, head_dim = torch.bfloat16, 16, 16, 4, 128
    max_bs, max_blocks, num_blocks = 8, 64, 8 * 64
    ours, ref = make_backends(block_size, num_blocks, num_heads, num_kv_heads, head_dim, dtype, num_layers=1)
    ours.init_cuda_graph_state(max_bs, max_blocks)
    tables = torch.randperm(num_blocks, dtype=torch.int32).view(max_bs, max_blocks).to(DEVICE)

    # as the graph runner does: the capture batch carries no attention metadata of its own
    capture_batch = ForwardBatch(
        input_ids=torch.zeros(max_bs, dtype=torch.int64, device=DEVICE), positions=None, slot_mapping=None,
        query_start_loc=None, seq_lens=None, block_tables=None, logits_indices=None, num_seqs=max_bs,
        num_tokens=max_bs, max_query_len=1, max_seq_len=max_blocks * block_size)
    q_buf, k_buf, v_buf = qkv(max_bs, num_heads, num_kv_heads, head_dim, dtype)
    ours.prepare_for_capture(capture_batch)
    assert capture_batch.max_seq_len == max_blocks * block_size
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ours.forward(0, q_buf, k_buf, v_buf, capture_batch)  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf = ours.forward(0, q_buf, k_buf, v_buf, capture_batch)
    assert torch.equal(ours.k_caches[0].float(), ref.k_caches[0].to(dtype).float())  # warm-up stored nothing

    # fewer live sequences with short tables (fewer block-table columns than the graph's), then a
    # full batch up to the longest length the graph was captured for
    for live, longest in ((5, 300), (max_bs, max_blocks * block_size - 1)):
        context_lens = random_lens(live - 1, 0, longest) + [longest]
        sub_tables = tables[:live, :cdiv(longest + 1, block_size)].contiguous()
        batch = make_batch([1] * live, context_lens, sub_tables, block_size)
        q, k, v = qkv(live, num_heads, num_kv_heads, head_dim, dtype)
        q_buf[:live].copy_(q)
        k_buf[:live].copy_(k)
        v_buf[:live].copy_(v)
        q_buf[live:].normal_()
        k_buf[live:].fill_(float("nan"))  # padding rows must not be stored (slot -1)
        v_buf[live:].fill_(float("nan"))
        ours.prepare_for_replay(batch, capture_batch)
        graph.replay()
        expected = ref.forward(0, q.float(), k.float(), v.float(), batch)
        assert_close(out_buf[:live], expected, dtype)
        assert torch.equal(out_buf[live:], torch.zeros_like(out_buf[live:]))  # seq_len 0 rows
        assert torch.equal(ours.k_caches[0].float(), ref.k_caches[0].to(dtype).float())
        assert torch.equal(ours.v_caches[0].float(), ref.v_caches[0].to(dtype).float())


# ----------------------------------------------------------------------------- sm_90 compile check

def _record_launches(configs: list[dict], kv_dtype: torch.dtype = torch.bfloat16) -> list:
    """Run the host wrappers on CPU tensors with every kernel replaced by a recorder, so the
    launches carry exactly the arguments and tile choices a real call would make. kv_dtype
    float8_e4m3fn: the FP8 cache's launches only (paged attention, the KV stores)."""
    import importlib

    from triton.runtime.jit import JITFunction

    # importlib, not `import a.b as m`: the package re-exports a function named paged_attention
    kv_store_mod = importlib.import_module("asyncllm.kernels.kv_store")
    attention_mod = importlib.import_module("asyncllm.kernels.paged_attention")
    fused_mod = importlib.import_module("asyncllm.kernels.fused_ops")
    skinny_mod = importlib.import_module("asyncllm.kernels.skinny_gemm")
    calls = []

    patched = [(mod, name) for mod in (kv_store_mod, attention_mod, fused_mod, skinny_mod)
               for name, value in vars(mod).items() if isinstance(value, JITFunction) and name.endswith("_kernel")]
    # every launch as on an sm_90 GPU with programmatic dependent launch (kernels/pdl.py) on
    patched += [(mod, "launch_options") for mod in (attention_mod, fused_mod, skinny_mod)]
    originals = [getattr(mod, name) for mod, name in patched]
    for mod, name in patched:
        setattr(mod, name, (lambda x: {"USE_PDL": True, "launch_pdl": True}) if name == "launch_options"
                else LaunchRecorder(getattr(mod, name), calls))
    try:
        for cfg in configs:
            step = make_step(cfg["query_lens"], [0] * len(cfg["query_lens"]), cfg["block_size"],
                             cfg["num_heads"], 8, cfg["head_dim"], torch.bfloat16)
            step.update(k_cache=step["k_cache"].to(kv_dtype), v_cache=step["v_cache"].to(kv_dtype))
            rope = None
            if cfg.get("rope"):  # the decode kernel's own q/k norm + rotary, from the fused projection
                from asyncllm.attention.base import DecodeRope
                tokens, head_dim = len(cfg["query_lens"]), cfg["head_dim"]
                step["q"] = torch.randn(tokens, (cfg["num_heads"] + 16) * head_dim, dtype=torch.bfloat16)
                norm = [torch.ones(head_dim, dtype=torch.bfloat16)] * 2 if cfg["rope"] == "norm" else []
                rope = DecodeRope(cfg["num_heads"], torch.zeros(tokens, dtype=torch.int64),
                                  torch.randn(64, head_dim), torch.zeros(tokens, dtype=torch.int64), *norm)
            paged_attention(**step, num_splits=cfg.get("num_splits"), rope=rope,
                            prefill_splits=cfg.get("prefill_splits"), kv_scales=(0.5, 2.0))
        k = torch.randn(4, 8, cfg["head_dim"], dtype=torch.bfloat16)
        store_kvcache(k, k, step["k_cache"], step["v_cache"], torch.arange(4), kv_scales=(0.5, 2.0))
        qkv = torch.randn(4, 32 * 128, dtype=torch.bfloat16)
        cos_sin = torch.randn(64, 128)
        if kv_dtype != torch.bfloat16:
            cache = torch.zeros(2, 3, 256, 8, 128, dtype=kv_dtype)
            fused_mod.qk_norm_rope_(qkv, torch.arange(4), cos_sin, 16, 8, 128, qkv[0, :128], qkv[0, :128], 1e-6,
                                    kv_cache=(cache[0], cache[1]), slot_mapping=torch.arange(4), kv_scales=(0.5, 2.0))
            # Config.kv_cache_rotation: q and k heads times a Hadamard matrix (dots of 16+ rows and columns)
            fused_mod.qk_norm_rope_(qkv, torch.arange(4), cos_sin, 16, 8, 128, qkv[0, :128], qkv[0, :128], 1e-6,
                                    kv_cache=(cache[0], cache[1]), slot_mapping=torch.arange(4), kv_scales=(0.5, 2.0),
                                    rotate=True)
            return calls
        x = torch.randn(4, 4096, dtype=torch.bfloat16)
        fused_mod.fused_add_rms_norm(x, x, x[0], 1e-6)
        fused_mod.silu_and_mul(x)
        fused_mod.qk_norm_rope_(qkv, torch.arange(4), cos_sin, 16, 8, 128, x[0, :128], x[0, :128], 1e-6)
        fused_mod.qk_norm_rope_(qkv, torch.arange(4), cos_sin, 16, 8, 128)
        cache = torch.zeros(2, 3, 256, 8, 128, dtype=torch.bfloat16)
        fused_mod.qk_norm_rope_(qkv, torch.arange(4), cos_sin, 16, 8, 128, x[0, :128], x[0, :128], 1e-6,
                                kv_cache=(cache[0], cache[1]), slot_mapping=torch.arange(4))
        weight, rows = torch.randn(1024, 2048, dtype=torch.bfloat16), torch.randn(16, 2048, dtype=torch.bfloat16)
        gate_up = torch.randn(16, 2 * 2048, dtype=torch.bfloat16)
        for num_rows in (1, 3, 16):  # the FMA loop (1 row, 4-row tiles) and the dot loop, split-K and bias
            for config in skinny_mod.candidate_configs(num_rows, 1024, 2048, 132):
                skinny_mod.skinny_gemm(rows[:num_rows], weight, weight[0, :1024], config)
            # the gated form (the MLP's down projection, no bias): the tilings the layer times
            for config in skinny_mod.candidate_configs(num_rows, 1024, 2048, 132)[:3]:
                skinny_mod.skinny_gemm(gate_up[:num_rows], weight, None, config, gated=True)
        # FP8 weights (weight-only): per-channel and 128-column group scales, plain and gated
        weight8 = weight.to(torch.float8_e4m3fn)
        for group_k, scale in ((None, torch.ones(1024, 1)), (128, torch.ones(1024, 16))):
            for num_rows in (1, 3, 16):
                config = skinny_mod.fp8_candidate_configs(num_rows, 1024, 2048, 132, group_k)[0]
                skinny_mod.skinny_gemm(rows[:num_rows], weight8, None, config, scale=scale, group_k=group_k)
                if not config.dot:
                    skinny_mod.skinny_gemm(gate_up[:num_rows], weight8, None, config, gated=True, scale=scale,
                                           group_k=group_k)
    finally:
        for (mod, name), original in zip(patched, originals):
            setattr(mod, name, original)
    return calls


def _compile_for_sm90(kernel, args, kwargs):
    """What Triton's launcher would compile for these arguments, built for sm_90 with ptxas."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "launch_pdl") if key in kwargs}
    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        if name in kwargs or value is None or isinstance(value, (bool, str)) or (
                isinstance(value, int) and value == 1):
            signature[name], constexprs[name] = "constexpr", value  # as the launcher specializes
        elif isinstance(value, torch.Tensor):
            ty = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}[value.dtype]
            signature[name] = "*" + ty
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.metadata.shared <= 227 * 1024, f"{kernel.__name__}: {compiled.metadata.shared} B of smem"
    return compiled


def compile_all_for_sm90(kv_dtype: torch.dtype = torch.bfloat16) -> int:
    configs = [
        dict(query_lens=[1, 1], block_size=128, num_heads=16, head_dim=128, num_splits=4),  # split decode
        dict(query_lens=[1, 1], block_size=16, num_heads=32, head_dim=128, num_splits=1),  # direct, gathered
        dict(query_lens=[300, 1], block_size=256, num_heads=16, head_dim=128),  # prefill
        dict(query_lens=[64, 1], block_size=16, num_heads=32, head_dim=128, prefill_splits=8),  # split prefill
        dict(query_lens=[1, 1], block_size=256, num_heads=16, head_dim=128, num_splits=64),  # no early tile
        dict(query_lens=[1], block_size=16, num_heads=32, head_dim=128, num_splits=8, rope="norm"),  # own rotary
        dict(query_lens=[1], block_size=128, num_heads=32, head_dim=128, num_splits=1, rope="plain"),
    ]
    calls = _record_launches(configs, kv_dtype)
    seen = set()
    for kernel, args, kwargs in calls:
        key = (kernel.__name__, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key not in seen:
            seen.add(key)
            _compile_for_sm90(kernel, args, kwargs)
    return len(seen)


def compile_fp8_kv_for_sm90() -> int:
    """compile_all_for_sm90's attention launches over an FP8 cache (tests/test_fp8_kv_kernels.py)."""
    return compile_all_for_sm90(torch.float8_e4m3fn)


@pytest.mark.skipif(CUDA, reason="on CUDA every other test compiles the kernels for real")
def test_kernels_compile_for_sm90():
    """The CPU interpreter never compiles; build the real launch configurations for sm_90 (the
    H200) in a subprocess without TRITON_INTERPRET, so compile-only errors surface on CPU too."""
    # decode x2 + x2 with its own rotary, reduce, prefill, split prefill + its merge, store, rms norm,
    # silu, qk x3, skinny GEMM (FMA, dot, split-K reduce), gated skinny GEMM (FMA, dot), FP8 weight-only
    # skinny GEMM (FMA, dot, gated FMA)
    assert compile_for_sm90_in_subprocess("test_kernels", "compile_all_for_sm90") >= 21


# ----------------------------------------------------------------------------- skinny GEMM

# (N, K) of Qwen3-0.6B's and -8B's linear layers at TP=1: qkv, o_proj, gate_up, down, lm_head
MODEL_GEMM_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
                     (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]


def skinny_reference(x, weight, bias):
    y = x.float() @ weight.float().T
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def check_skinny(x, weight, bias, configs):
    from asyncllm.kernels.skinny_gemm import skinny_gemm
    ref = skinny_reference(x, weight, bias).float()
    for config in configs:
        out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)  # poisoned
        result = skinny_gemm(x, weight, bias, config, out=out)
        assert not result.isnan().any(), f"{config}: NaN in the output"
        # fp32 sums in another order, then one rounding to bf16 (the interpreter truncates): one or two ulps
        torch.testing.assert_close(result.float(), ref, rtol=2 ** -6, atol=1e-3, msg=lambda m: f"{config}: {m}")


@pytest.mark.parametrize("num_rows", [1, 3, 16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_skinny_gemm_matches_reference(num_rows, has_bias):
    """Every candidate tiling, split-K with ragged and empty splits, N and K that no block divides."""
    from asyncllm.kernels.skinny_gemm import FMA_MAX_ROWS, SkinnyConfig, candidate_configs
    dtype = torch.bfloat16
    n, k = (1000, 1500) if CUDA else (37, 200)
    x = torch.randn(num_rows, k, device=DEVICE).to(dtype)
    weight = torch.randn(n, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if has_bias else None
    configs = candidate_configs(num_rows, n, k, num_sms=132 if CUDA else 8)
    for dot in (True, False) if num_rows <= FMA_MAX_ROWS else (True,):  # a K tail; 8 splits of 7 tiles
        configs += [SkinnyConfig(dot, 16, 64, 3, 4), SkinnyConfig(dot, 16 if dot else 2, 32, 8, 4)]
    configs.append(SkinnyConfig(True, 64, 128, 1, 4))  # the rule's widest dot tile (the 8B lm_head's)
    configs += [replace(config, grouped=True) for config in configs if not config.dot]  # the grouped FMA loop
    assert {config.dot for config in configs} == ({True, False} if num_rows <= FMA_MAX_ROWS else {True})
    check_skinny(x, weight, bias, configs)


def gated_configs(num_rows, n, k):
    """The candidate tilings plus, for each loop, a K tail with ragged and empty splits, and split-K
    over one-tile splits."""
    from asyncllm.kernels.skinny_gemm import FMA_MAX_ROWS, SkinnyConfig, candidate_configs
    configs = candidate_configs(num_rows, n, k, num_sms=132 if CUDA else 8)
    for dot in (True, False) if num_rows <= FMA_MAX_ROWS else (True,):
        configs += [SkinnyConfig(dot, 16, 64, 3, 4), SkinnyConfig(dot, 16 if dot else 2, 16, 4, 4)]
    return configs + [replace(config, grouped=True) for config in configs if not config.dot]


@pytest.mark.parametrize("num_rows", [1, 3, 16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_gated_skinny_gemm_matches_reference(num_rows, has_bias):
    """The gated kernel (silu(gate) * up on load) against F.linear of the unfused gate, every tiling,
    N and K that no block divides, into a NaN-poisoned output. The unfused gate is
    fused_ops.silu_and_mul, what the unfused path runs where this kernel runs (the interpreter
    truncates to bf16 where PyTorch rounds); its match with PyTorch's SiluAndMul is tested below."""
    from asyncllm.kernels.fused_ops import silu_and_mul
    from asyncllm.kernels.skinny_gemm import skinny_gemm
    dtype = torch.bfloat16
    n, k = (1000, 1500) if CUDA else (37, 200)
    gate_up = torch.randn(num_rows, 2 * k, device=DEVICE).to(dtype)
    weight = torch.randn(n, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if has_bias else None
    configs = gated_configs(num_rows, n, k)
    assert any(config.split_k > 1 for config in configs) and any(k % config.block_k for config in configs)
    ref = skinny_reference(silu_and_mul(gate_up), weight, bias).float()
    for config in configs:
        out = torch.full((num_rows, n), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
        result = skinny_gemm(gate_up, weight, bias, config, out=out, gated=True)
        assert result.data_ptr() == out.data_ptr() and not result.isnan().any(), f"{config}: NaN in the output"
        torch.testing.assert_close(result.float(), ref, rtol=2 ** -6, atol=1e-3, msg=lambda m: f"{config}: {m}")


@pytest.mark.parametrize("num_rows", [2, 13])
def test_gated_skinny_gemm_gate_is_silu_and_mul_bit_for_bit(num_rows):
    """Through an identity weight (every sum one exact product) the gated kernel returns its gate
    itself, which must be silu_and_mul's to the bit: the fused MLP rounds as the unfused one. The
    rows sit in a wider buffer (a row stride that is not 2K), as a view of a larger projection may."""
    from asyncllm.kernels.fused_ops import silu_and_mul
    from asyncllm.kernels.skinny_gemm import skinny_gemm
    dtype = torch.bfloat16
    k = 72  # no power-of-two tile divides it: the masked K tail
    gate_up = (3 * torch.randn(num_rows, 2 * k + 8, device=DEVICE)).to(dtype)[:, :2 * k]
    eye = torch.eye(k, device=DEVICE).to(dtype)
    expected = silu_and_mul(gate_up)
    for config in gated_configs(num_rows, k, k):
        out = torch.full((num_rows, k), float("nan"), dtype=dtype, device=DEVICE)
        assert torch.equal(skinny_gemm(gate_up, eye, None, config, out=out, gated=True), expected), config


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", MODEL_GEMM_SHAPES)
def test_skinny_gemm_model_shapes(n, k):
    from asyncllm.kernels.skinny_gemm import candidate_configs
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(torch.bfloat16)
    for num_rows in (1, 3, 16):
        x = torch.randn(num_rows, k, device=DEVICE).to(torch.bfloat16)
        configs = candidate_configs(num_rows, n, k, num_sms)
        check_skinny(x, weight, None, configs + [replace(c, grouped=True) for c in configs if not c.dot])
    x = torch.randn(8, k, device=DEVICE).to(torch.float16)  # fp16 and a bias too
    bias = torch.randn(n, device=DEVICE).to(torch.float16)
    check_skinny(x, weight.half(), bias, candidate_configs(8, n, k, num_sms)[:1])


def test_skinny_candidate_configs_are_valid():
    from asyncllm.kernels.skinny_gemm import FMA_MAX_ROWS, MAX_ROWS, block_rows, candidate_configs
    for n, k in MODEL_GEMM_SHAPES + [(37, 200), (8, 16)]:
        for num_rows in range(1, MAX_ROWS + 1):
            configs = candidate_configs(num_rows, n, k, 132)
            assert configs[0].dot == (num_rows > FMA_MAX_ROWS)
            for config in configs:
                for size in (config.block_n, config.block_k, config.split_k):
                    assert size & (size - 1) == 0, config
                assert config.block_n >= (16 if config.dot else 2), config
                assert 16 <= config.block_k and 1 <= config.split_k <= 16, config
                if not config.dot:  # the FMA loop's fp32 tile stays within ~64 registers per thread
                    assert num_rows <= FMA_MAX_ROWS, config
                    tile = block_rows(num_rows, dot=False) * config.block_n * config.block_k
                    assert tile <= 64 * 32 * config.num_warps, config


def test_linear_layers_take_skinny_gemm_only_for_few_rows(monkeypatch):
    """The layers route 1..16 rows of bf16/fp16 through the kernel, and everything else (more
    rows, fp32, the kernel switched off, a device the kernel does not serve) through F.linear.
    CPU tensors count as a kernel device here, so the kernel runs through the interpreter."""
    import torch.nn.functional as F

    from asyncllm.kernels import skinny_gemm as skinny_mod
    from asyncllm.layers import skinny_linear
    from asyncllm.layers.embed_head import ParallelLMHead
    from asyncllm.layers.linear import ColumnParallelLinear, RowParallelLinear

    calls = []
    real = skinny_mod.skinny_gemm
    monkeypatch.setattr(skinny_mod, "skinny_gemm", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    monkeypatch.setattr(skinny_linear, "_choices", {})
    monkeypatch.setattr(skinny_linear, "_enabled", True)  # the default (ASYNCLLM_SKINNY_GEMM=0 turns it off)
    # routing only: the kernel's first tiling is taken without timing it against cuBLAS (which runs
    # the kernel once per candidate, and may keep cuBLAS)
    monkeypatch.setattr(skinny_linear, "choose_fastest", lambda kernels, x, weight, bias, candidates: candidates[0])
    monkeypatch.setattr(skinny_linear, "_decisions", StartupDecisions(None))  # no answer from an engine's cache
    dtype = torch.bfloat16
    column = ColumnParallelLinear(48, 40, bias=True).to(DEVICE, dtype)
    row = RowParallelLinear(48, 24, bias=True).to(DEVICE, dtype)
    head = ParallelLMHead(50, 48).to(DEVICE, dtype)
    for layer in (column, row, head):
        for param in layer.parameters():
            param.data.normal_()

    def expect(layer, x, kernel: bool):
        calls.clear()
        y = layer(x)
        assert len(calls) == (1 if kernel else 0), (type(layer).__name__, tuple(x.shape), x.dtype)
        enabled = skinny_linear.is_enabled()
        skinny_linear.set_enabled(False)
        try:
            ref = layer(x)  # F.linear
        finally:
            skinny_linear.set_enabled(enabled)
        # the row-parallel layer adds its bias after rounding the product: an ulp of the product
        # (|y| ~ 8 here, ulp 1/32) shows where the bias cancels it
        torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -6, atol=2 ** -5)

    x3 = torch.randn(3, 48, device=DEVICE).to(dtype)
    expect(column, x3, kernel=CUDA)  # on CPU: not a kernel device by default
    monkeypatch.setattr(skinny_linear, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    for layer in (column, row, head):
        expect(layer, x3, kernel=True)
        expect(layer, torch.randn(2, 8, 48, device=DEVICE).to(dtype), kernel=True)  # 16 rows
        expect(layer, torch.randn(17, 48, device=DEVICE).to(dtype), kernel=False)
    column32 = ColumnParallelLinear(48, 40).to(DEVICE)
    column32.weight.data.normal_()
    expect(column32, x3.float(), kernel=False)
    skinny_linear.set_enabled(False)
    try:
        expect(row, x3, kernel=False)
    finally:
        skinny_linear.set_enabled(True)
    assert all(config is not None for config in skinny_linear.choices().values())
    assert "3 rows x (40, 48) + bias" not in skinny_linear.describe_choices()  # keyed by rows rounded up
    assert skinny_linear.describe_choices()["4 rows x (40, 48) + bias"].startswith("fma ")
    x17 = torch.randn(17, 48, device=DEVICE).to(dtype)
    assert torch.equal(column(x17), F.linear(x17, column.weight, column.bias))


def test_mlp_takes_gated_skinny_gemm_where_linear_takes_the_kernel(monkeypatch):
    """DecoderMLP's down projection takes the gated kernel (no silu_and_mul of its own) for 1..16
    rows where linear() takes the kernel for the unfused shape and the gated form was chosen, and
    the unfused path (SiluAndMul, then linear()) otherwise: more rows, cuBLAS for the product, the
    gated form timed slower, off the kernel's devices. The same numbers as down_proj(act_fn(gate_up))
    either way, the bias added after the reduction."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from asyncllm.kernels import fused_ops
    from asyncllm.kernels import skinny_gemm as skinny_mod
    from asyncllm.layers import skinny_linear
    from asyncllm.layers.activation import SiluAndMul
    from asyncllm.layers.linear import RowParallelLinear
    from asyncllm.models.transformer import DecoderMLP

    calls = []  # per kernel launch: gated or not
    real = skinny_mod.skinny_gemm
    monkeypatch.setattr(skinny_mod, "skinny_gemm",
                        lambda *args, **kw: calls.append(kw.get("gated", False)) or real(*args, **kw))
    monkeypatch.setattr(skinny_linear, "_choices", {})
    monkeypatch.setattr(skinny_linear, "_gated_choices", {})
    monkeypatch.setattr(skinny_linear, "_enabled", True)
    monkeypatch.setattr(skinny_linear, "choose_fastest",
                        lambda kernels, x, weight, bias, candidates, gated=False: candidates[0])
    monkeypatch.setattr(skinny_linear, "_decisions", StartupDecisions(None))  # no answer from an engine's cache
    dtype = torch.bfloat16
    mlp = DecoderMLP(SimpleNamespace(hidden_size=48, intermediate_size=40)).to(DEVICE, dtype)
    row = RowParallelLinear(40, 24, bias=True).to(DEVICE, dtype)
    for param in list(mlp.parameters()) + list(row.parameters()):
        param.data.normal_(std=param.shape[-1] ** -0.5 if param.dim() == 2 else 1.0)  # activations of ~unit scale
    act_fn = SiluAndMul()

    def expect(down, gate_up, forward, launches: list[bool]):
        calls.clear()
        y = forward(gate_up)
        assert calls == launches, (tuple(gate_up.shape), calls)
        if launches == [True]:
            # the unfused path on the kernel's device computes the gate as the kernel does: the same bits
            assert torch.equal(y, down(fused_ops.silu_and_mul(gate_up)))
            # PyTorch's gate: the interpreter truncates to bf16 where PyTorch rounds, an ulp of some inputs
            torch.testing.assert_close(y.float(), down(act_fn(gate_up)).float(), rtol=2 ** -6, atol=2 ** -4)
        else:
            assert torch.equal(y, down(act_fn(gate_up)))

    x3 = torch.randn(3, 48, device=DEVICE).to(dtype)
    if not CUDA:  # off the kernel's devices: exactly the PyTorch MLP
        expect(mlp.down_proj, mlp.gate_up_proj(x3), mlp.down_proj.forward_silu_mul, [])
        assert torch.equal(mlp(x3), F.linear(act_fn.forward_native(F.linear(x3, mlp.gate_up_proj.weight)),
                                             mlp.down_proj.weight))
    monkeypatch.setattr(skinny_linear, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    for x in (x3, torch.randn(2, 8, 48, device=DEVICE).to(dtype), torch.randn(17, 48, device=DEVICE).to(dtype)):
        few = x.numel() // x.shape[-1] <= 16
        calls.clear()
        y = mlp(x)
        assert calls == ([False, True] if few else []), calls  # gate_up's kernel, then the gated down_proj
        gate_up = mlp.gate_up_proj(x)
        expect(mlp.down_proj, gate_up, mlp.down_proj.forward_silu_mul, [True] if few else [])
        assert torch.equal(y, mlp.down_proj.forward_silu_mul(gate_up))
        expect(row, gate_up, row.forward_silu_mul, [True] if few else [])  # a bias, after the all-reduce
    # the gated form is decided after, and only where, linear() takes the kernel for the product
    key = (x3.device, dtype, 4, 48, 40, False)
    config = skinny_linear.choices()[key]
    assert config is not None and skinny_linear.gated_choices()[key] == config  # on CPU: the product's tiling
    assert skinny_linear.describe_choices()["4 rows x (24, 40) gated"].startswith("fma ")
    skinny_linear._gated_choices[key] = None  # timed slower than the unfused pair
    expect(mlp.down_proj, mlp.gate_up_proj(x3), mlp.down_proj.forward_silu_mul, [False])
    assert skinny_linear.describe_choices()["4 rows x (48, 40) gated"] == "unfused"
    skinny_linear._choices[key] = None  # cuBLAS for the product: never the gated form
    skinny_linear._gated_choices[key] = config
    expect(mlp.down_proj, mlp.gate_up_proj(x3), mlp.down_proj.forward_silu_mul, [])
    skinny_linear.set_enabled(False)
    try:
        expect(row, mlp.gate_up_proj(x3), row.forward_silu_mul, [])
    finally:
        skinny_linear.set_enabled(True)


@gpu
@needs_cuda
def test_skinny_linear_decides_outside_capture_and_replays(monkeypatch):
    """A shape first met inside a CUDA-graph capture keeps cuBLAS there and is left undecided; an
    eager call times and decides it; a graph captured after that replays the decision, right."""
    import torch.nn.functional as F

    from asyncllm.layers import skinny_linear

    monkeypatch.setattr(skinny_linear, "_choices", {})
    monkeypatch.setattr(skinny_linear, "_enabled", True)
    weight = (torch.randn(4096, 1024, device=DEVICE) / 32).to(torch.bfloat16)
    x = torch.randn(2, 1024, device=DEVICE).to(torch.bfloat16)
    F.linear(x, weight)  # cuBLAS's lazy set-up, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear.linear(x, weight)
    assert skinny_linear.choices() == {}
    skinny_linear.linear(x, weight)
    (config,) = skinny_linear.choices().values()  # the kernel's tiling, or None where cuBLAS was faster
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear.linear(x, weight)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y.float(), skinny_reference(x, weight, None).float(), rtol=2 ** -7, atol=1e-3)
    assert len(skinny_linear.choices()) == 1, "the graph's capture must not decide again"


def test_skinny_choice_needs_a_clear_gain_and_skips_tilings_that_fail(monkeypatch):
    """choose_fastest keeps cuBLAS unless a tiling is MIN_GAIN faster, and a tiling that fails to
    compile or run (on some GPU) drops out of the race instead of failing the engine's start-up.
    For the gated form, the tilings run gated and race the unfused pair."""
    from types import SimpleNamespace

    from asyncllm.kernels.skinny_gemm import SkinnyConfig
    from asyncllm.layers import skinny_linear

    good, bad, better = (SkinnyConfig(False, 2, 64, 1, 4), SkinnyConfig(True, 128, 128, 1, 4),
                         SkinnyConfig(False, 4, 32, 1, 4))

    launched = []

    def fake_gemm(x, weight, bias, config, gated=False):
        launched.append(gated)
        if config == bad:
            raise RuntimeError("out of resources: shared memory")
        return x

    kernels = SimpleNamespace(skinny_gemm=fake_gemm)
    x, weight = torch.zeros(1, 8), torch.zeros(4, 8)
    timings = []
    monkeypatch.setattr(skinny_linear, "time_calls", lambda calls, device, neighbour=None: timings[:len(calls)])
    timings[:] = [1.0, 0.9, 0.5]  # cuBLAS, good, better (bad is not timed)
    assert skinny_linear.choose_fastest(kernels, x, weight, None, [good, bad, better]) == better
    timings[:] = [1.0, 0.99, 0.98]  # within noise of cuBLAS
    assert skinny_linear.choose_fastest(kernels, x, weight, None, [good, bad, better]) is None
    assert skinny_linear.choose_fastest(kernels, x, weight, None, [bad]) is None
    assert not any(launched)

    def time_gated(calls, device, neighbour=None):
        assert calls[0]().shape == (1, 4)  # the unfused pair: silu_and_mul of [gate | up], then linear()
        return timings[:len(calls)]

    monkeypatch.setattr(skinny_linear, "time_calls", time_gated)
    launched.clear()
    gate_up = torch.zeros(1, 16)
    timings[:] = [1.0, 0.9]
    assert skinny_linear.choose_fastest(kernels, gate_up, weight, None, [good], gated=True) == good
    timings[:] = [1.0, 0.99]
    assert skinny_linear.choose_fastest(kernels, gate_up, weight, None, [good], gated=True) is None
    assert launched == [True, True]


def test_skinny_choice_tie_goes_to_the_kernel_where_pdl_is_on(monkeypatch):
    """Where the timing runs between PDL neighbours (kernels/pdl.py on: CUDA, sm_90+), a tie within
    MIN_GAIN goes to our kernel, which keeps the decode step's chain of early launches where cuBLAS
    breaks it, and the gated form, which takes the SiLU kernel out of the chain; a clear loss still
    goes to cuBLAS or the unfused pair, and without PDL a tie does too. The neighbour kernel reaches
    the timer."""
    from types import SimpleNamespace

    from asyncllm.kernels.skinny_gemm import SkinnyConfig
    from asyncllm.layers import skinny_linear

    config = SkinnyConfig(False, 2, 64, 1, 4)
    kernels = SimpleNamespace(skinny_gemm=lambda x, weight, bias, config, gated=False: x)

    def neighbour():
        pass

    monkeypatch.setattr(skinny_linear, "_neighbour_kernel", lambda x: neighbour)
    timings = []

    def time_calls(calls, device, neighbour=None):
        assert neighbour is expected_neighbour
        return timings[:len(calls)]

    monkeypatch.setattr(skinny_linear, "time_calls", time_calls)
    x, weight, gate_up = torch.zeros(1, 8), torch.zeros(4, 8), torch.zeros(1, 16)
    expected_neighbour = neighbour
    for gated, rows in ((False, x), (True, gate_up)):  # cuBLAS or the unfused pair, then the kernel
        timings[:] = [1.0, 1.0 + skinny_linear.MIN_GAIN / 2]
        assert skinny_linear.choose_fastest(kernels, rows, weight, None, [config], gated=gated) == config
        timings[:] = [1.0, 1.0 + 2 * skinny_linear.MIN_GAIN]
        assert skinny_linear.choose_fastest(kernels, rows, weight, None, [config], gated=gated) is None
    monkeypatch.setattr(skinny_linear, "_neighbour_kernel", lambda x: None)  # PDL off: a tie is no win
    expected_neighbour = None
    for gated, rows in ((False, x), (True, gate_up)):
        timings[:] = [1.0, 1.0 - skinny_linear.MIN_GAIN / 2]
        assert skinny_linear.choose_fastest(kernels, rows, weight, None, [config], gated=gated) is None
        timings[:] = [1.0, 1.0 - 2 * skinny_linear.MIN_GAIN]
        assert skinny_linear.choose_fastest(kernels, rows, weight, None, [config], gated=gated) == config


# ----------------------------------------------------------------------------- fused ops

@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rms_norm_and_silu_match_layers(dtype):
    from asyncllm.kernels.fused_ops import fused_add_rms_norm, rms_norm, silu_and_mul
    from asyncllm.layers.activation import SiluAndMul
    from asyncllm.layers.layernorm import RMSNorm

    hidden = 4096 if CUDA else 96
    norm = RMSNorm(hidden, eps=1e-6).to(DEVICE)
    norm.weight.data = torch.randn(hidden, device=DEVICE).to(dtype)
    x = torch.randn(5, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(5, hidden, device=DEVICE).to(dtype)
    # a reduction order or rsqrt/exp differing in the last fp32 bit can flip the rounding of the
    # normed value and then of the weighted product: allow two ulps of the output dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm.forward_native(x), **tol)
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, 1e-6)
    ref_out, ref_residual = norm.forward_native(x, residual)
    torch.testing.assert_close(out, ref_out, **tol)
    if CUDA or dtype != torch.bfloat16:
        assert torch.equal(new_residual, ref_residual)
    else:  # the interpreter truncates fp32 -> bf16 where compiled code rounds to nearest
        torch.testing.assert_close(new_residual, ref_residual, rtol=1e-2, atol=1e-2)

    gate_up = torch.randn(2, 3, 2 * (11008 if CUDA else 80), device=DEVICE).to(dtype)
    torch.testing.assert_close(silu_and_mul(gate_up), SiluAndMul().forward_native(gate_up), **tol)


@pytest.mark.parametrize("store_kv", [True, False])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qk_norm_rope_matches_layers(dtype, qk_norm, store_kv):
    """One kernel for Qwen3's q/k RMSNorm and rotary (or rotary alone, Llama/Qwen2) against the
    modules' own PyTorch code, in place on the fused projection with v left alone; with a cache given,
    the rotated k and v land in the paged cache exactly where store_kvcache puts them (and only there:
    slot -1 rows store nothing, the rest of the poisoned cache is untouched)."""
    from asyncllm.kernels.fused_ops import qk_norm_rope_
    from asyncllm.layers.layernorm import RMSNorm
    from asyncllm.layers.rotary import RotaryEmbedding

    head_dim, num_heads, num_kv_heads, tokens = (128, 16, 8, 300) if CUDA else (64, 4, 2, 7)
    rotary = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE)
    q_norm, k_norm = RMSNorm(head_dim, eps=1e-6).to(DEVICE), RMSNorm(head_dim, eps=1e-6).to(DEVICE)
    for norm in (q_norm, k_norm):
        norm.weight.data = (1 + 0.5 * torch.randn(head_dim, device=DEVICE)).to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = (3 * torch.randn(tokens, q_size + 2 * kv_size, device=DEVICE)).to(dtype)
    q = qkv[:, :q_size].reshape(tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].reshape(tokens, num_kv_heads, head_dim)
    if qk_norm:
        q, k = q_norm.forward_native(q), k_norm.forward_native(k)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    ref_q, ref_k = rotary(positions, q, k)
    v_before = qkv[:, q_size + kv_size:].clone()
    norm_args = (q_norm.weight, k_norm.weight, 1e-6) if qk_norm else ()
    store_args = {}
    if store_kv:
        block_size, num_blocks = 16, cdiv(tokens, 16) + 2
        caches = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype,
                            device=DEVICE)
        slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
        slots[::3] = -1
        store_args = dict(kv_cache=(caches[0], caches[1]), slot_mapping=slots)
    qk_norm_rope_(qkv, positions, rotary.cos_sin_cache, num_heads, num_kv_heads, head_dim, *norm_args, **store_args)
    got_q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    got_k = qkv[:, q_size:q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    if store_kv:
        expected = torch.full_like(caches, float("nan"))
        store_kvcache(got_k, v_before.view(tokens, num_kv_heads, head_dim), expected[0], expected[1], slots)
        assert torch.equal(caches.isnan(), expected.isnan())
        assert torch.equal(caches.nan_to_num(0.0), expected.nan_to_num(0.0))
    for got, ref in ((got_q, ref_q), (got_k, ref_k)):
        if dtype == torch.float32:  # the math itself: equal up to fp32 operation order
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            continue
        # bf16: the kernel rounds where the modules round, but compiled code may contract or
        # reorder fp32 steps between roundings, so a rounding can flip; where rotary cancels
        # (x1*cos - x2*sin near 0) one flipped ulp of an input-sized product is a large relative
        # error. Bound each element by a few ulps of its own size and of the inputs' (|x| ~ 3 here),
        # and the whole. The interpreter truncates where compiled code rounds: the whole only.
        if CUDA:
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=3 * 2 ** -7)
        limit = 5e-3 if CUDA else 3e-2
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < limit
    assert torch.equal(qkv[:, q_size + kv_size:], v_before)  # v untouched


# ----------------------------------------------------------------------------- logits ops

@pytest.mark.parametrize("dtype,in_place", [(torch.float32, True), (torch.bfloat16, False), (torch.float32, False)])
def test_penalties_kernel_matches_reference_and_leaves_other_rows(dtype, in_place):
    """The penalised rows, in place on float32 logits or from the model's logits (bf16 too) into a
    float32 output poisoned with NaN; rows not listed are poisoned and must stay so, and the model's
    logits are left as they were when the output is another tensor."""
    from asyncllm.kernels.logits_ops import penalize
    from asyncllm.layers.logits_adjustments import apply_penalties

    vocab, slots = (151936, 9) if CUDA else (3000, 5)
    counts = torch.randint(0, 4, (slots, vocab), device=DEVICE, dtype=torch.int32)
    counts *= torch.rand(slots, vocab, device=DEVICE) < 0.05  # most tokens never generated
    in_prompt = torch.rand(slots, vocab, device=DEVICE) < 0.05
    rows = torch.tensor([3, 0, 5], device=DEVICE)
    slot_of_row = torch.tensor([4, 1, 2], device=DEVICE)
    presence, frequency, repetition = (torch.tensor(v, device=DEVICE) for v in
                                       ([0.5, -1.0, 2.0], [0.3, 0.0, -0.7], [1.3, 0.6, 1.0]))
    logits = torch.full((6, vocab), float("nan"), device=DEVICE, dtype=dtype)
    logits[rows] = (4 * torch.randn(len(rows), vocab, device=DEVICE)).to(dtype)
    before = logits.clone()
    expected = apply_penalties(logits[rows].float(), counts[slot_of_row], in_prompt[slot_of_row], presence,
                               frequency, repetition)
    out = logits if in_place else torch.full((6, vocab), float("nan"), device=DEVICE)
    penalize(logits, out, rows, slot_of_row, counts, in_prompt, presence, frequency, repetition)
    torch.testing.assert_close(out[rows], expected, rtol=1e-6, atol=1e-6)
    others = [r for r in range(6) if r not in rows.tolist()]
    assert out[others].isnan().all()
    if not in_place:
        assert torch.equal(logits[rows], before[rows])
        # bit for bit what penalising the float32 copy in place gives (the sampler's path before)
        copy = logits.float()
        penalize(copy, copy, rows, slot_of_row, counts, in_prompt, presence, frequency, repetition)
        assert torch.equal(out[rows], copy[rows])


def test_token_counts_add_each_sampled_token_once_per_listing():
    """TokenCounts.count against a loop: one more per (slot, token), a slot listed twice counts both
    (the engine never does, but the counts stay right), other slots untouched."""
    from asyncllm.layers.logits_adjustments import TokenCounts

    vocab = 151936 if CUDA else 3000
    counts = TokenCounts(vocab, DEVICE)
    slots = [counts.acquire([1, 2], [5, 5, vocab - 1]) for _ in range(5)]
    before = counts.output_counts.clone()
    listed = torch.tensor([slots[3], slots[0], slots[3], slots[1]], device=DEVICE)
    tokens = torch.tensor([vocab - 1, 7, vocab - 1, 5], device=DEVICE)
    counts.count(listed, tokens)
    expected = before.clone()
    for slot, token in zip(listed.tolist(), tokens.tolist()):
        expected[slot, token] += 1
    assert torch.equal(counts.output_counts, expected)
    assert counts.output_counts[slots[3], vocab - 1].item() == 3


@gpu
@needs_cuda
def test_sampler_with_penalties_and_logprobs_never_waits_for_the_device():
    """A 256-row step of bf16 logits with penalties and logprobs=5 on every row (the one-read
    kernels, the token counts' update) queues its work without one host sync, counts each sampled
    token once, leaves the model's logits alone, and gives the raw distribution's log-probabilities."""
    from asyncllm.layers.logits_adjustments import LogitsAdjustments, TokenCounts
    from asyncllm.layers.sampler import Sampler, SamplingTensors, log_softmax_logprobs

    rows, vocab = 256, 151936
    logits = (3 * torch.randn(rows, vocab, device=DEVICE)).to(torch.bfloat16)
    before = logits.clone()
    ones, index = torch.ones(rows, device=DEVICE), torch.arange(rows, device=DEVICE)
    counts = TokenCounts(vocab, DEVICE)
    slots = torch.tensor([counts.acquire(torch.randint(0, vocab, (64,)).tolist(), torch.randint(0, vocab, (32,))
                                         .tolist()) for _ in range(rows)], device=DEVICE)
    params = SamplingTensors(ones * 0.6, None, None, None, [], False, keys=index * 7919 + 1,
                             adjustments=LogitsAdjustments(
                                 penalty_rows=index, penalty_slots=slots, presence=ones * 0.5, frequency=ones * 0.5,
                                 repetition=ones * 1.1, token_counts=counts),
                             logprob_rows=index, num_top_logprobs=5)
    sampler = Sampler()
    sampler(logits, params)  # compiles the kernels
    counted = counts.output_counts.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(logits, before)
    counted[slots, out.token_ids] += 1  # the slots are distinct
    assert torch.equal(counts.output_counts, counted)
    expected = log_softmax_logprobs(logits, out.token_ids, 5)
    torch.testing.assert_close(out.logprobs.chosen, expected.chosen, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.logprobs.ranks, expected.ranks)
    torch.testing.assert_close(out.logprobs.top_logprobs, expected.top_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("every_row", [True, False])
def test_token_bitmask_kernel_matches_reference(every_row):
    """Forbidden tokens become -inf; allowed ones keep their exact value; unlisted rows are untouched
    (poisoned with NaN); the vocabulary is not a multiple of 32."""
    from asyncllm.kernels.logits_ops import apply_token_bitmask_

    vocab = 151936 + 5 if CUDA else 3000 + 5
    rows = torch.arange(4, device=DEVICE) if every_row else torch.tensor([1, 4, 6, 7], device=DEVICE)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, device=DEVICE)
    values = torch.randn(4, vocab, device=DEVICE)
    logits = torch.full((4 if every_row else 9, vocab), float("nan"), device=DEVICE)
    logits[rows] = values
    apply_token_bitmask_(logits, None if every_row else rows, bitmask)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, device=DEVICE, dtype=torch.int32)) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    torch.testing.assert_close(logits[rows], values.masked_fill(~allowed, float("-inf")), rtol=0, atol=0)
    others = [r for r in range(len(logits)) if r not in rows.tolist()]
    assert logits[others].isnan().all()


@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_chunked_logprobs_match_log_softmax(num_top):
    """The one-read log-probabilities against log_softmax + torch.topk (log_softmax_logprobs): chosen
    log-probs and top values close, ranks and top ids equal (no ties: random logits), a vocabulary
    that is not a multiple of the chunk, and the best token in the last, partial chunk."""
    from asyncllm.kernels.logits_ops import chunked_logprobs
    from asyncllm.layers.sampler import log_softmax_logprobs

    vocab = 151936 if CUDA else 9000 + 7
    logits = 4 * torch.randn(5, vocab, device=DEVICE)
    logits[1, vocab - 1] = 30.0
    token_ids = torch.tensor([0, vocab - 1, 17, vocab // 2, 4096], device=DEVICE)
    chosen, ranks, top_ids, top_logprobs = chunked_logprobs(logits, token_ids, num_top)
    expected = log_softmax_logprobs(logits, token_ids, num_top)
    torch.testing.assert_close(chosen, expected.chosen, rtol=1e-5, atol=1e-5)
    assert torch.equal(ranks, expected.ranks)
    assert torch.equal(top_ids, expected.top_ids)
    torch.testing.assert_close(top_logprobs, expected.top_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_logprobs_read_half_precision_logits_as_their_float32_copy(dtype):
    """bf16/fp16 logits in: the same outputs as their float32 copy (the kernel upcasts exact values;
    ranks and top ids equal, log-probs to the last bits: a compiled sum may group its terms by the
    load's width), and against log_softmax_logprobs on the same logits (it upcasts itself): chosen
    and top log-probs close, ranks equal, and each top id one whose log-prob is its top value (bf16
    logits tie often: which of equal tokens comes first is the sort's choice). Rows are a strided
    view, as the model's logits sliced to the vocabulary."""
    from asyncllm.kernels.logits_ops import chunked_logprobs
    from asyncllm.layers.sampler import log_softmax_logprobs

    vocab = 151936 if CUDA else 9000 + 7
    padded = (4 * torch.randn(5, vocab + 64, device=DEVICE)).to(dtype)
    logits = padded[:, :vocab]
    logits[1, vocab - 1] = 30.0
    token_ids = torch.tensor([0, vocab - 1, 17, vocab // 2, 4096], device=DEVICE)
    got = chunked_logprobs(logits, token_ids, 5)
    from_copy = chunked_logprobs(logits.float(), token_ids, 5)
    assert all(a.dtype == b.dtype for a, b in zip(got, from_copy))
    assert torch.equal(got[1], from_copy[1]) and torch.equal(got[2], from_copy[2])
    for a, b in ((got[0], from_copy[0]), (got[3], from_copy[3])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    chosen, ranks, top_ids, top_logprobs = got
    expected = log_softmax_logprobs(logits, token_ids, 5)
    assert expected.chosen.dtype == torch.float32
    torch.testing.assert_close(chosen, expected.chosen, rtol=1e-5, atol=1e-5)
    assert torch.equal(ranks, expected.ranks)
    torch.testing.assert_close(top_logprobs, expected.top_logprobs, rtol=1e-5, atol=1e-5)
    reference = logits.float().log_softmax(dim=-1)
    torch.testing.assert_close(reference.gather(1, top_ids), top_logprobs, rtol=1e-5, atol=1e-5)
    assert top_ids[1, 0].item() == vocab - 1


def race_reference(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The exponential race in PyTorch on given uniforms: argmax(x / T - log(-log u)), argmax(x) where T = 0."""
    x = logits.float()
    sampled = temperatures > 0
    race = x / torch.where(sampled, temperatures, 1.0).unsqueeze(1) - torch.log(-torch.log(uniforms))
    return torch.where(sampled.unsqueeze(1), race, x).argmax(dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_kernel_is_the_race_on_its_uniforms(dtype):
    """The one-read sampler against the race in PyTorch on the kernel's own draws (sample_uniforms):
    greedy rows, temperatures 0.3..2, -inf (forbidden) tokens, a row with one allowed token in the
    last partial chunk, greedy ties (the first maximum wins, as torch.argmax), bf16 and fp32 logits,
    a vocabulary that is not a multiple of the chunk. The output buffer is fresh: every row must be
    written with an id in range."""
    from asyncllm.kernels.logits_ops import sample, sample_uniforms

    vocab, rows = (151936 + 3, 64) if CUDA else (9000 + 7, 6)
    logits = (3 * torch.randn(rows, vocab, device=DEVICE)).to(dtype)
    temperatures = torch.rand(rows, device=DEVICE) * 1.7 + 0.3
    temperatures[0] = temperatures[3] = 0.0
    logits[3, 100] = logits[3, 7000] = logits[3].max() + 1  # a greedy tie: token 100 wins
    logits[1, :vocab - 2] = float("-inf")  # row 1 may take only the last two tokens
    logits[2, ::2] = float("-inf")
    keys = torch.randint(-2**63, 2**63 - 1, (rows,), dtype=torch.int64, device=DEVICE)
    got = sample(logits, temperatures, keys)
    expected = race_reference(logits, temperatures, sample_uniforms(keys, vocab))
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert ((got >= 0) & (got < vocab)).all()
    assert got[3].item() == 100 and got[1].item() >= vocab - 2 and got[2].item() % 2 == 1
    mismatch = (got != expected).nonzero().flatten().tolist()
    # the race is float32 in both; log may round differently in Triton: a mismatch must be a near tie
    for row in mismatch:
        u = sample_uniforms(keys[row:row + 1], vocab)[0]
        x = logits[row].float()
        t = temperatures[row].item()
        score = x / t - torch.log(-torch.log(u)) if t > 0 else x
        assert abs(score[got[row]] - score[expected[row]]) < 1e-4 * score[expected[row]].abs().clamp(min=1), row
    assert len(mismatch) <= max(1, rows // 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_kernel_keeps_to_the_cutoffs(dtype):
    """With cutoffs (top-k / top-p / min-p's form) a sampled row draws only among tokens whose
    logit / T (PyTorch's division) reaches its cutoff: the race on those alone, on the kernel's own
    draws; the token at the cutoff itself stays eligible; greedy rows ignore their cutoff."""
    from asyncllm.kernels.logits_ops import sample, sample_uniforms

    vocab, rows = (151936, 16) if CUDA else (9000 + 7, 5)
    logits = (3 * torch.randn(rows, vocab, device=DEVICE)).to(dtype)
    temperatures = torch.rand(rows, device=DEVICE) + 0.5
    temperatures[0] = 0.0
    z = logits.float() / temperatures.clamp(min=1e-9).unsqueeze(1)
    order = z.sort(dim=-1, descending=True).values
    keep_counts = torch.tensor([5, 1, 2, 40, 3] * 4, device=DEVICE)[:rows]
    cutoffs = order.gather(1, (keep_counts - 1).unsqueeze(1)).squeeze(1)  # each row's k-th largest z
    cutoffs[0] = float("inf")  # a greedy row: ignored
    keys = torch.randint(-2**63, 2**63 - 1, (rows,), dtype=torch.int64, device=DEVICE)
    got = sample(logits, temperatures, keys, cutoffs)
    u = sample_uniforms(keys, vocab)
    race = z - torch.log(-torch.log(u))
    race = race.masked_fill(z < cutoffs.unsqueeze(1), float("-inf"))
    expected = torch.where(temperatures.unsqueeze(1) > 0, race, logits.float()).argmax(dim=-1)
    assert torch.equal(got, expected)
    assert got[0].item() == logits[0].float().argmax().item()
    assert (z[1:].gather(1, got[1:].unsqueeze(1)).squeeze(1) >= cutoffs[1:]).all()
    one = (keep_counts == 1).nonzero().flatten()
    assert torch.equal(got[one], z[one].argmax(dim=-1))  # only the top token is left


def test_sample_kernel_rows_depend_only_on_their_key():
    """A row's token depends on its key and logits, not on its place in the batch or its neighbours."""
    from asyncllm.kernels.logits_ops import sample

    vocab = 151936 if CUDA else 5000
    logits = torch.randn(5, vocab, device=DEVICE) * 2
    temperatures = torch.ones(5, device=DEVICE)
    keys = torch.tensor([11, 12, 13, -14, 2**62], dtype=torch.int64, device=DEVICE)
    whole = sample(logits, temperatures, keys)
    order = torch.tensor([4, 2, 0, 3, 1], device=DEVICE)
    shuffled = sample(logits[order], temperatures[order], keys[order])
    assert torch.equal(shuffled, whole[order])
    single = sample(logits[2:3], temperatures[2:3], keys[2:3])
    assert torch.equal(single, whole[2:3])
    other_key = sample(logits, temperatures, keys + 1000)
    assert not torch.equal(other_key, whole)  # 5 rows of flat-ish logits: equal draws are ~impossible


def test_sample_uniforms_are_uniform_and_independent_across_keys():
    """The Philox draws behind the race: in [0, 1), uniform (Kolmogorov-Smirnov distance), and
    uncorrelated between neighbouring keys (the keys of a step's unseeded rows are consecutive)."""
    from asyncllm.kernels.logits_ops import sample_uniforms

    vocab = 151936 if CUDA else 20000
    u = sample_uniforms(torch.tensor([7, 8, -(2**63)], dtype=torch.int64, device=DEVICE), vocab).double().cpu()
    assert u.min() >= 0 and u.max() < 1
    for row in u:
        ecdf = torch.arange(1, vocab + 1, dtype=torch.float64) / vocab
        ks = (row.sort().values - ecdf).abs().max().item()
        assert ks < 1.95 / vocab ** 0.5  # the 0.1 % critical value
    correlation = torch.corrcoef(u[:2])[0, 1].item()
    assert abs(correlation) < 4 / vocab ** 0.5


@needs_cuda
@gpu
def test_sample_kernel_frequencies_follow_softmax():
    """Many rows of the same logits, each with its own key: the tokens' frequencies match
    softmax(logits / T) within 5 standard errors."""
    from asyncllm.kernels.logits_ops import sample

    rows, vocab, temperature = 200_000, 12, 0.7
    base = torch.linspace(-2, 2, vocab, device=DEVICE)
    logits = base.expand(rows, vocab).contiguous()
    keys = torch.arange(rows, dtype=torch.int64, device=DEVICE) * 7919 - 123
    tokens = sample(logits, torch.full((rows,), temperature, device=DEVICE), keys)
    freq = torch.bincount(tokens, minlength=vocab).double() / rows
    p = (base / temperature).softmax(-1).double()
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / rows).sqrt() + 1e-9).all(), (freq, p)


@needs_cuda
@gpu
def test_sampler_on_cuda_with_top_k_top_p_follows_the_kept_softmax():
    """The whole CUDA path (cutoff kernels, then the one-read race): top-k 4 then top-p 0.8 on
    logits linspace(-2, 2, 12) / 0.7: the tokens kept are those of the reference cutoffs, drawn
    with their renormalised softmax probabilities (within 5 standard errors)."""
    from asyncllm.layers.sampler import Sampler, SamplingTensors
    from asyncllm.layers.sampling_filters import apply_cutoffs, filter_cutoffs_reference

    rows, vocab, temperature = 200_000, 12, 0.7
    base = torch.linspace(-2, 2, vocab, device=DEVICE)
    logits = base.expand(rows, vocab).contiguous().to(torch.bfloat16)
    temps = torch.full((rows,), temperature, device=DEVICE)
    top_ks = torch.full((rows,), 4, dtype=torch.int64, device=DEVICE)
    top_ps = torch.full((rows,), 0.8, device=DEVICE)
    params = SamplingTensors(temperatures=temps, top_ks=top_ks, top_ps=top_ps, min_ps=None, seeded_rows=[],
                             all_greedy=False, keys=torch.arange(rows, dtype=torch.int64, device=DEVICE) * 31 + 5)
    tokens = Sampler()(logits, params).token_ids
    z = logits[:1].float() / temperature
    kept = apply_cutoffs(z, filter_cutoffs_reference(logits[:1], temps[:1], top_ks[:1], top_ps[:1]))[0]
    p = kept.softmax(-1).double()
    assert (p > 0).sum().item() in (2, 3)  # top-p 0.8 of the 4 largest
    freq = torch.bincount(tokens, minlength=vocab).double() / rows
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / rows).sqrt() + 1e-9).all(), (freq, p)
