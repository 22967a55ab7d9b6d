"""The FP8 KV cache's kernels against the PyTorch reference that quantizes the same way
(attention/torch_ref.py: quantize_kv, dequantize_kv): the Triton KV store, the fused q/k norm +
rotary's store, and paged attention (decode direct and split, its early first tile and its own
rotary + store, prefill, split prefill, mixed steps) over float8_e4m3fn caches with scales != 1.

As tests/test_kernels.py: without CUDA the kernels run through Triton's CPU interpreter on small
shapes, with CUDA compiled on larger ones. One difference: Triton 3.6's interpreter casts fp32 to
e4m3 its own way (ties away from zero; subnormals below 2**-6 flushed to zero; a value that rounds
up to a power of two loses the carry: 7.94 -> 4.0, not 8.0), where the GPU (cvt.rn.satfinite) and
torch round to nearest even. So the stores are compared bit-for-bit on CUDA, and under the
interpreter most values must be bit-equal and the rest within a factor of two. Attention reads
caches the reference wrote, so its comparisons do not depend on the cast. Outputs and the cache's
unwritten slots are NaN-poisoned first.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from test_kernels import CUDA, DEVICE, TOL, make_step, make_sub_step, run_ours, run_split  # noqa: E402  (sets the interpreter up)

from asyncllm.attention.base import DecodeRope, hadamard_matrix, rotate_heads  # noqa: E402
from asyncllm.attention.torch_ref import (FP8_KV_DTYPE, FP8_KV_MAX, paged_attention_torch,  # noqa: E402
                                          quantize_kv, store_kvcache_torch)
from asyncllm.kernels import store_kvcache  # noqa: E402
from asyncllm.kernels.fused_ops import qk_norm_rope_  # noqa: E402
from asyncllm.layers.rotary import RotaryEmbedding  # noqa: E402
from helpers import seed_every_test  # noqa: E402

DTYPE = torch.bfloat16 if CUDA else torch.float32  # the compute dtype (the interpreter's bf16 dots are slow)
SCALES = (0.5, 2.0)  # (k_scale, v_scale): powers of two, so x / scale is exact and only the cast rounds
BLOCK_SIZES = [16, 128] if CUDA else [16]

_seed = seed_every_test(4321)


def fp8_step(step: dict, scales=SCALES) -> dict:
    """step with its caches quantized as the engine stores them (NaN poison stays NaN)."""
    return dict(step, k_cache=quantize_kv(step["k_cache"], FP8_KV_DTYPE, scales[0]),
                v_cache=quantize_kv(step["v_cache"], FP8_KV_DTYPE, scales[1]))


def reference(step: dict, scales=SCALES) -> torch.Tensor:
    """fp32 attention over the dequantized cache (its NaN poison zeroed: masked positions)."""
    k_cache = step["k_cache"].float().nan_to_num(0.0).to(FP8_KV_DTYPE)
    v_cache = step["v_cache"].float().nan_to_num(0.0).to(FP8_KV_DTYPE)
    return paged_attention_torch(step["q"].float(), k_cache, v_cache, step["query_start_loc"], step["seq_lens"],
                                 step["block_tables"], step["max_query_len"], step["max_seq_len"], step["scale"],
                                 kv_scales=scales)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), "NaN in output rows"
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()
    assert err < TOL[DTYPE], f"relative error {err:.3g}"


def assert_same_stores(got: torch.Tensor, want: torch.Tensor) -> None:
    """got, want: FP8 caches. NaN (unwritten poison) in the same places; written values bit-equal on
    CUDA; under the interpreter (its cast: module docstring) 95 % of them, the rest within a factor
    of two (or a flushed subnormal)."""
    assert got.dtype == want.dtype == FP8_KV_DTYPE
    assert torch.equal(got.float().isnan(), want.float().isnan())
    if CUDA:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        written = ~want.float().isnan()
        g, w = got.float()[written], want.float()[written]
        assert (g == w).float().mean().item() >= 0.95
        torch.testing.assert_close(g, w, rtol=0.5, atol=2 ** -6)


def poisoned_fp8_cache(shape) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEVICE).to(FP8_KV_DTYPE)


# ----------------------------------------------------------------------------- stores

def test_quantize_kv_scales_clamps_and_rounds_to_nearest_even():
    x = torch.tensor([1000.0, -1000.0, 68.0, 3.0, 2 ** -8, 0.0])
    stored = quantize_kv(x, FP8_KV_DTYPE, 0.5).float()  # x / 0.5 before the cast
    # past +-448 clamped (a bare cast gives NaN there); 136 lies between e4m3's 128 and 144: to even, 128
    assert stored.tolist() == [FP8_KV_MAX, -FP8_KV_MAX, 128.0, 6.0, 2 ** -7, 0.0]
    assert quantize_kv(x, torch.bfloat16, 0.5).equal(x.to(torch.bfloat16))  # other dtypes: a plain cast


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_store_kvcache_fp8_matches_reference(block_size):
    num_tokens, num_kv_heads, head_dim, num_blocks = 37, 2, 64, 6
    qkv = (torch.randn(num_tokens, 8, head_dim) * 4).to(DTYPE).to(DEVICE)
    qkv[0, 4, :3] = torch.tensor([5000.0, -5000.0, 1e-4])  # clamped, clamped, below e4m3's subnormals
    k, v = qkv[:, 4:6], qkv[:, 6:8]  # strided views into a fused projection, as the model makes them
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    first = slots[0].item()  # the token with the clamped values: stored
    slots[torch.rand(num_tokens) < 0.3] = -1
    slots[0] = first
    slot_mapping = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache, k_ref, v_ref = (poisoned_fp8_cache(shape) for _ in range(4))
    store_kvcache(k, v, k_cache, v_cache, slot_mapping, SCALES)
    store_kvcache_torch(k, v, k_ref, v_ref, slot_mapping, SCALES)
    assert_same_stores(k_cache, k_ref)
    assert_same_stores(v_cache, v_ref)
    written = (~k_cache.float().isnan()).all(-1).all(-1).sum().item()
    assert written == (slots >= 0).sum().item()
    assert k_cache.view(-1, num_kv_heads, head_dim)[first, 0, :2].float().tolist() == [FP8_KV_MAX, -FP8_KV_MAX]


def qk_norm_rope_case(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int = 16):
    """Inputs of the fused q/k norm + rotary with an FP8 store: qkv, positions, the cos/sin cache, the two
    norm weights, slots (one -1: a token not stored) and four NaN-poisoned FP8 caches (two to write, two
    for the reference)."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(DTYPE)
    positions = torch.randint(0, 500, (num_tokens,), device=DEVICE)
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE).cos_sin_cache
    weights = [(1 + 0.5 * torch.randn(head_dim, device=DEVICE)).to(DTYPE) for _ in range(2)]
    slots = torch.randperm(4 * block_size, device=DEVICE)[:num_tokens]
    slots[2] = -1
    shape = (4, block_size, num_kv_heads, head_dim)
    return qkv, positions, cos_sin, weights, slots, [poisoned_fp8_cache(shape) for _ in range(4)]


def test_qk_norm_rope_stores_fp8_as_store_kvcache():
    """The fused q/k norm + rotary's K/V store into an FP8 cache: the rotated k and v quantized by the
    scales, as the reference store writes them; q rotated as without a cache."""
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 8, 2, 64
    qkv, positions, cos_sin, weights, slots, (k_cache, v_cache, k_ref, v_ref) = \
        qk_norm_rope_case(num_tokens, num_heads, num_kv_heads, head_dim)
    plain = qk_norm_rope_(qkv.clone(), positions, cos_sin, num_heads, num_kv_heads, head_dim, *weights)
    stored = qk_norm_rope_(qkv.clone(), positions, cos_sin, num_heads, num_kv_heads, head_dim, *weights,
                           kv_cache=(k_cache, v_cache), slot_mapping=slots, kv_scales=SCALES)
    assert torch.equal(stored, plain)
    k = plain[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = plain[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    store_kvcache_torch(k, v, k_ref, v_ref, slots, SCALES)
    assert_same_stores(k_cache, k_ref)
    assert_same_stores(v_cache, v_ref)


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 8, 2), (16, 3, 1)])
def test_qk_norm_rope_rotates_q_and_k_by_hadamard(head_dim, num_heads, num_kv_heads):
    """rotate=True (Config.kv_cache_rotation): every q and k head after its norm + rotary times
    hadamard_matrix(head_dim), v untouched, and the FP8 cache holds the rotated k. 8 + 2 heads and
    3 + 1 heads of 16 (half 8) take the kernel's padding to a dot's 16 rows and columns. Against the
    unrotated kernel's output rotated in torch (attention.base.rotate_heads); the caches NaN-poisoned."""
    num_tokens = 9
    qkv, positions, cos_sin, weights, slots, (k_cache, v_cache, k_ref, v_ref) = \
        qk_norm_rope_case(num_tokens, num_heads, num_kv_heads, head_dim)
    plain = qk_norm_rope_(qkv.clone(), positions, cos_sin, num_heads, num_kv_heads, head_dim, *weights)
    rotated = qk_norm_rope_(qkv.clone(), positions, cos_sin, num_heads, num_kv_heads, head_dim, *weights,
                            kv_cache=(k_cache, v_cache), slot_mapping=slots, kv_scales=SCALES, rotate=True)
    qk = (num_heads + num_kv_heads) * head_dim
    want = rotate_heads(plain[:, :qk].view(num_tokens, -1, head_dim).float(), hadamard_matrix(head_dim, DEVICE))
    assert not rotated.isnan().any()
    torch.testing.assert_close(rotated[:, :qk].view(num_tokens, -1, head_dim).float(), want,
                               **({"rtol": 2 ** -7, "atol": 1e-2} if CUDA else {"rtol": 1e-5, "atol": 1e-5}))
    assert torch.equal(rotated[:, qk:], plain[:, qk:])  # v
    k = rotated[:, num_heads * head_dim:qk].view(num_tokens, num_kv_heads, head_dim)
    store_kvcache_torch(k, rotated[:, qk:].view(num_tokens, num_kv_heads, head_dim), k_ref, v_ref, slots, SCALES)
    assert_same_stores(k_cache, k_ref)
    assert_same_stores(v_cache, v_ref)


def test_hadamard_rotation_keeps_scores_and_shrinks_fp8_key_error():
    """Why the rotation: scores q.k are unchanged by an orthogonal matrix, while keys with a few outlier
    channels (as real models' are: SmolLM2's reach 20 where the median channel stays under 4) lose less
    of their scores to e4m3's rounding once the outliers are spread over the head. Deterministic,
    torch only (the kernels' rotation is checked against rotate_heads above)."""
    generator = torch.Generator().manual_seed(0)
    head_dim, num_keys = 64, 512
    outliers = torch.ones(head_dim)
    outliers[[3, 35, 17]] = 12.0  # rotary pairs (i, i + 32) carry the outliers together
    q = torch.randn(64, head_dim, generator=generator) * outliers
    k = torch.randn(num_keys, head_dim, generator=generator) * outliers + 2.0 * outliers
    h = hadamard_matrix(head_dim)
    torch.testing.assert_close(h @ h, torch.eye(head_dim), rtol=0, atol=1e-6)
    exact = q @ k.T
    torch.testing.assert_close(rotate_heads(q, h) @ rotate_heads(k, h).T, exact, rtol=1e-4, atol=1e-3)

    def fp8_score_error(rotation):
        qr, kr = (q, k) if rotation is None else (rotate_heads(q, rotation), rotate_heads(k, rotation))
        stored = quantize_kv(kr, FP8_KV_DTYPE).float()
        return ((qr @ stored.T - exact).norm() / exact.norm()).item()
    plain, rotated = fp8_score_error(None), fp8_score_error(h)
    assert rotated < 0.5 * plain, (plain, rotated)


# ----------------------------------------------------------------------------- attention

@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("first_tile_early", [True, False])
def test_decode_over_fp8_cache(monkeypatch, block_size, num_splits, first_tile_early):
    attention_mod = importlib.import_module("asyncllm.kernels.paged_attention")
    monkeypatch.setattr(attention_mod, "FIRST_TILE_EARLY_PROGRAMS_PER_SM", 10 ** 6 if first_tile_early else 0)
    seq_lens = [1, 2 * block_size, 150] + ([1500, 4097] if CUDA else [])
    step = fp8_step(make_step([1] * len(seq_lens), [s - 1 for s in seq_lens], block_size, 8, 2, 64, DTYPE))
    assert_close(run_ours(step, num_splits=num_splits, kv_scales=SCALES), reference(step))


def test_fp8_scales_are_applied():
    """The same quantized cache read with other scales gives the reference for those scales, not
    for these: the kernels multiply by the scales they are given."""
    step = fp8_step(make_step([1, 1, 30], [40, 99, 20], 16, 8, 2, 64, DTYPE))
    other = (1.0, 1.0)
    out = run_ours(step, kv_scales=other)
    assert_close(out, reference(step, other))
    err = ((out.float() - reference(step)).norm() / reference(step).norm()).item()
    assert err > 0.1


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mixed_prefill_and_decode_over_fp8_cache(block_size):
    query_lens, context_lens = ([1, 1, 300, 1, 64, 17], [5, 2000, 0, 700, 128, 0]) if CUDA else \
        ([1, 35, 1, 12], [30, 0, 90, 45])
    step = fp8_step(make_step(query_lens, context_lens, block_size, 8, 2, 64, DTYPE))
    assert_close(run_ours(step, kv_scales=SCALES), reference(step))
    assert_close(run_ours(step, kv_scales=SCALES, single_rows=False), reference(step))


def test_prefill_split_kv_over_fp8_cache():
    """The varlen kernel's split-KV path and its merge: v_scale on each partial."""
    step = fp8_step(make_step([1, 33, 1, 70], [150, 270, 64, 0], 16, 8, 2, 64, DTYPE))
    assert_close(run_split(step, 5, 1, kv_scales=SCALES), reference(step))


@pytest.mark.parametrize("num_splits,own_rotary,rotate", [
    *((splits, own, False) for splits in (1, 2, 5) for own in (True, False)), (2, True, True)])
def test_decode_with_rope_over_fp8_cache(monkeypatch, num_splits, own_rotary, rotate):
    """paged_attention given the fused projection and a DecodeRope over an FP8 cache: the decode
    kernel's own rotary + store (small grid) or the rotary kernel's store then the decode. Either
    way the cache gets the quantized row the reference store writes, and the output is the
    reference's over that cache: the new row is attended as stored, not at full precision. With
    rope.rotate (Config.kv_cache_rotation) the small grid too takes the rotary kernel, which rotates
    q and k (test_qk_norm_rope_rotates_q_and_k_by_hadamard)."""
    attention_mod = importlib.import_module("asyncllm.kernels.paged_attention")
    monkeypatch.setattr(attention_mod, "FIRST_TILE_EARLY_PROGRAMS_PER_SM", 10 ** 6 if own_rotary else 0)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    step = fp8_step(make_step([1] * 3, [63, 299, 40], block_size, num_heads, num_kv_heads, head_dim, DTYPE))
    seq_lens = step["seq_lens"].long()
    positions = seq_lens - 1
    tables = step["block_tables"].long()
    slots = tables[torch.arange(3, device=DEVICE), positions // block_size] * block_size + positions % block_size
    for cache in (step["k_cache"], step["v_cache"]):
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[slots] = 0x7F  # NaN: not there yet
    qkv = torch.randn(3, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(DTYPE)
    weights = [(1 + 0.5 * torch.randn(head_dim, device=DEVICE)).to(DTYPE) for _ in range(2)]
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE).cos_sin_cache

    rotated = qk_norm_rope_(qkv.clone(), positions, cos_sin, num_heads, num_kv_heads, head_dim, *weights,
                            rotate=rotate)
    ref_step = dict(step, q=rotated[:, :num_heads * head_dim].view(3, num_heads, head_dim),
                    k_cache=step["k_cache"].clone(), v_cache=step["v_cache"].clone())
    k = rotated[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(3, num_kv_heads, head_dim)
    v = rotated[:, (num_heads + num_kv_heads) * head_dim:].view(3, num_kv_heads, head_dim)
    store_kvcache_torch(k, v, ref_step["k_cache"], ref_step["v_cache"], slots, SCALES)

    k_cache, v_cache = step["k_cache"].clone(), step["v_cache"].clone()
    out = torch.full((3, num_heads, head_dim), float("nan"), dtype=DTYPE, device=DEVICE)
    rope = DecodeRope(num_heads, positions, cos_sin, slots, *weights, rotate=rotate)
    attention_mod.paged_attention(qkv.clone(), k_cache, v_cache, step["query_start_loc"], step["seq_lens"],
                                  step["block_tables"], 1, 300, head_dim ** -0.5, out=out, num_splits=num_splits,
                                  rope=rope, kv_scales=SCALES)
    assert_same_stores(k_cache, ref_step["k_cache"])
    assert_same_stores(v_cache, ref_step["v_cache"])
    # the reference over the cache this call wrote (under the interpreter its cast may differ by a step)
    assert_close(out, reference(dict(ref_step, k_cache=k_cache, v_cache=v_cache)))


@pytest.mark.skipif(CUDA, reason="on CUDA every other test compiles the kernels for real")
def test_fp8_kernels_compile_for_sm90():
    """The interpreter never compiles: build the FP8-cache launches for sm_90 in a subprocess."""
    from helpers import compile_for_sm90_in_subprocess
    # store, qk norm-rope store (plain, rotated), decode (direct, split + merge, own rotary), prefill,
    # split prefill + merge
    assert compile_for_sm90_in_subprocess("test_kernels", "compile_fp8_kv_for_sm90") >= 8
