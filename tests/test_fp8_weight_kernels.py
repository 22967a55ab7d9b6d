"""FP8 weights (weight-only skinny GEMM, W8A8, the dequantizing path) against a plain PyTorch reference:
the FP8 weight dequantized to float32 and multiplied in float32.

As tests/test_kernels.py: without CUDA the kernels run through Triton's CPU interpreter on small shapes
(K not a multiple of the 128-column scale group, N no tile divides), with CUDA compiled on the Qwen3
0.6B / 8B shapes. Outputs are NaN-poisoned first, so an output the kernel never writes fails.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from test_kernels import CUDA, DEVICE, MODEL_GEMM_SHAPES  # noqa: E402  (sets the interpreter up)

from asyncllm.layers import fp8_linear, skinny_linear  # noqa: E402
from asyncllm.layers.fp8_linear import dequantize_rows, quantize_rows  # noqa: E402
from helpers import seed_every_test  # noqa: E402

_seed = seed_every_test(4747)
# the interpreter is slow (a third of a second a launch): every tiling at 1, 4 and 16 rows (the FMA loop's
# one row and four-row tiles, the dot loop's), the layer test below takes 1, 2, 4, 8, 16 and 64 rows
ROWS = [1, 2, 4, 8, 16] if CUDA else [1, 4, 16]
GROUPS = [None, 128, 32]  # per-channel, Qwen's block columns, a group smaller than the rule's tiles
SHAPE = (1000, 1500) if CUDA else (37, 200)  # 200 = 128 + a partial group of 72


def fp8_weight(n: int, k: int, group_k):
    quantized, scale = quantize_rows((torch.randn(n, k) / k ** 0.5).to(DEVICE), group_k)
    return quantized, scale, dequantize_rows(quantized, scale, group_k, torch.float32)


def reference(x, dequantized, bias=None):
    y = x.float() @ dequantized.T
    return y + bias.float() if bias is not None else y


def assert_matches(result, ref, label):
    assert not result.isnan().any(), f"{label}: NaN in the output (an output never written?)"
    # fp32 sums in another order, then one rounding to bf16 (the interpreter truncates): one or two ulps
    torch.testing.assert_close(result.float(), ref, rtol=2 ** -6, atol=1e-3, msg=lambda m: f"{label}: {m}")


def weight_only_configs(num_rows, n, k, group_k):
    """The candidate tilings, plus split-K with ragged and empty splits, both loops where the rows allow."""
    from asyncllm.kernels.skinny_gemm import FMA_MAX_ROWS, SkinnyConfig, fp8_candidate_configs
    configs = fp8_candidate_configs(num_rows, n, k, 132 if CUDA else 8, group_k)
    for dot in (True, False) if num_rows <= FMA_MAX_ROWS else (True,):
        configs += [SkinnyConfig(dot, 16, 32, 3, 4), SkinnyConfig(dot, 16 if dot else 2, 16, 8, 4)]
    grouped = [replace(config, grouped=True) for config in configs if not config.dot and config.block_k >= 16]
    return configs + grouped[:None if CUDA else 1]


def test_candidate_tiles_stay_inside_one_scale_group():
    from asyncllm.kernels.skinny_gemm import fp8_candidate_configs
    for n, k in MODEL_GEMM_SHAPES:
        for num_rows in (1, 4, 16):
            for group_k in (None, 128, 96):
                configs = fp8_candidate_configs(num_rows, n, k, 132, group_k)
                assert configs, (n, k, num_rows, group_k)
                for config in configs:
                    assert group_k is None or group_k % config.block_k == 0, config
                    assert config.block_k >= 16 or not config.dot, config


@pytest.mark.parametrize("group_k", GROUPS)
@pytest.mark.parametrize("num_rows", ROWS)
def test_fp8_skinny_gemm_matches_dequantized_reference(num_rows, group_k):
    from asyncllm.kernels.skinny_gemm import skinny_gemm
    n, k = SHAPE
    quantized, scale, dequantized = fp8_weight(n, k, group_k)
    x = torch.randn(num_rows, k, device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    configs = weight_only_configs(num_rows, n, k, group_k)
    assert any(config.split_k > 1 for config in configs) and any(k % config.block_k for config in configs)
    for index, config in enumerate(configs):
        for has_bias in (False, True) if CUDA or index == 0 else (False,):
            out = torch.full((num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)  # poisoned
            result = skinny_gemm(x, quantized, bias if has_bias else None, config, out=out, scale=scale,
                                 group_k=group_k)
            assert result.data_ptr() == out.data_ptr()
            assert_matches(result, reference(x, dequantized, bias if has_bias else None), config.label())


@pytest.mark.parametrize("group_k", [None, 128])
@pytest.mark.parametrize("num_rows", [1, 3])
def test_gated_fp8_skinny_gemm_matches_dequantized_reference(num_rows, group_k):
    from asyncllm.kernels.fused_ops import silu_and_mul
    from asyncllm.kernels.skinny_gemm import skinny_gemm
    n, k = SHAPE
    quantized, scale, dequantized = fp8_weight(n, k, group_k)
    gate_up = torch.randn(num_rows, 2 * k, device=DEVICE).to(torch.bfloat16)
    ref = reference(silu_and_mul(gate_up), dequantized)
    for config in weight_only_configs(num_rows, n, k, group_k):
        if config.dot:
            continue  # the layer takes the gated form in the FMA loop only
        out = torch.full((num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        assert_matches(skinny_gemm(gate_up, quantized, None, config, out=out, gated=True, scale=scale,
                                   group_k=group_k), ref, config.label())


@pytest.mark.parametrize("group_k", [None, 128])
@pytest.mark.parametrize("num_rows", [1, 2, 4, 8, 16, 64])
def test_fp8_linear_every_path_matches_dequantized_reference(monkeypatch, num_rows, group_k):
    """The layer's routing: 1..16 rows through the weight-only kernel (CPU counts as a kernel device
    here), more rows through W8A8 (CUDA, per-channel scales: x quantized per token, so a looser bound)
    or the dequantizing path; the MLP's gated form too."""
    monkeypatch.setattr(skinny_linear, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    n, k = (1024, 2048) if CUDA else SHAPE
    quantized, scale, dequantized = fp8_weight(n, k, group_k)
    x = torch.randn(num_rows, k, device=DEVICE).to(torch.bfloat16)
    w8a8 = CUDA and num_rows > 16 and group_k is None
    dequantizing = num_rows > 16 and not w8a8  # the weight dequantized to bf16 first: its own rounding
    for gated in (False, True):
        inputs = torch.randn(num_rows, 2 * k, device=DEVICE).to(torch.bfloat16) if gated else x
        if gated:
            result = fp8_linear.silu_mul_linear(inputs, quantized, scale, group_k)
            # the gate as the path computes it: the gated kernel's (fused_ops' rounding) in the FMA loop's
            # rows, else the unfused SiluAndMul (PyTorch's on CPU)
            from asyncllm.kernels.fused_ops import silu_and_mul
            from asyncllm.kernels.skinny_gemm import FMA_MAX_ROWS
            gate = silu_and_mul(inputs) if num_rows <= FMA_MAX_ROWS else skinny_linear.silu_and_mul(inputs)
            ref = reference(gate, dequantized)
        else:
            result = fp8_linear.linear(inputs, quantized, scale, group_k)
            ref = reference(inputs, dequantized)
        assert result.shape == (num_rows, n) and result.dtype == torch.bfloat16
        if w8a8:  # e4m3 activations: a few percent per product, averaged over K
            assert not result.isnan().any()
            assert (result.float() - ref).abs().max() <= 0.05 * ref.abs().max(), (num_rows, gated)
        elif dequantizing:
            assert not result.isnan().any()
            assert (result.float() - ref).abs().max() <= 2 ** -6 * ref.abs().max(), (num_rows, gated)
        else:
            assert_matches(result, ref, f"{num_rows} rows, gated={gated}")


def test_quantize_rows_round_trip():
    """Each row's group: its largest magnitude maps to 448 exactly, the rest within half of e4m3's
    step (2**-4 relative, 2**-9 of the scale below the normal range); an all-zero group keeps scale 1
    and stays zero."""
    weight = torch.randn(5, 300)
    weight[2, 128:256] = 0
    quantized, scale = quantize_rows(weight, 128)
    assert quantized.dtype == torch.float8_e4m3fn and scale.shape == (5, 3)
    assert scale[2, 1] == 1 and (quantized[2, 128:256].float() == 0).all()
    back = dequantize_rows(quantized, scale, 128, torch.float32)
    per_column = scale.repeat_interleave(128, dim=1)[:, :300]
    assert ((back - weight).abs() <= 2 ** -4 * weight.abs() + 2 ** -10 * per_column + 1e-7).all()
    assert quantized.float().abs().amax() == 448



@pytest.mark.parametrize("group_k", [None, 128, 100])
def test_dequantize_rows_rounds_once(group_k):
    """Dequantized to bf16, each weight is its float32 value (fp8 * scale) rounded once: the nearest
    bf16, what the weight-only kernel multiplies by, with no scale rounded to bf16 first."""
    quantized, scale = quantize_rows(torch.randn(64, 300) * 0.02, group_k)
    exact = dequantize_rows(quantized, scale, group_k, torch.float32)
    assert torch.equal(dequantize_rows(quantized, scale, group_k, torch.bfloat16), exact.to(torch.bfloat16))

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA: the model shapes are too large for the interpreter")
@pytest.mark.parametrize("n,k", MODEL_GEMM_SHAPES)
def test_fp8_skinny_gemm_model_shapes(n, k):
    from asyncllm.kernels.skinny_gemm import fp8_candidate_configs, skinny_gemm
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for group_k in (None, 128):
        quantized, scale, dequantized = fp8_weight(n, k, group_k)
        for num_rows in (1, 4, 16):
            x = torch.randn(num_rows, k, device=DEVICE).to(torch.bfloat16)
            for config in fp8_candidate_configs(num_rows, n, k, num_sms, group_k):
                out = torch.full((num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
                assert_matches(skinny_gemm(x, quantized, None, config, out=out, scale=scale, group_k=group_k),
                               reference(x, dequantized), f"{n}x{k} {config.label()}")


def w8a8_reference(x, quantized, scale, bias=None):
    """What W8A8 computes, written out: each row of x scaled to e4m3 by amax / 448 (the correctly
    rounded quotient: CUDA torch divides by a Python scalar as a product with its reciprocal, 1 ulp off
    for about half the rows, which moved one e4m3 activation a step in run AG and AH), clamped, rounded
    to nearest even; the e4m3 products summed in float32 and scaled by both rows' scales, then the
    bias, one rounding to x's dtype."""
    x32 = x.float()
    x_scale = (x32.abs().amax(-1, keepdim=True).double() / 448).float().clamp_min(1e-12)
    x8 = (x32 / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = (x8.float() @ quantized.float().T) * x_scale * scale.view(1, -1)
    return (out + bias.float() if bias is not None else out).to(x.dtype)


def _emulation_devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not CUDA or torch.cuda.get_device_capability() < (8, 9),
        reason="needs CUDA sm_89+: the W8A8 path itself, against the reference the CPU emulation matches"))]


@pytest.mark.parametrize("device", _emulation_devices())
@pytest.mark.parametrize("num_rows", [17, 200])
def test_w8a8_path_matches_per_token_reference(monkeypatch, device, num_rows):
    """Above 16 rows with per-row scales: CUDA's W8A8 path, and CPU under cuda_paths_on_cpu() (the
    quality benchmark's emulation of it), both equal the per-token e4m3 reference within an ulp or two
    (fp32 sums in another order). The weight-only reference is outside that bound: a wrong route fails.
    On CPU torch._scaled_mm raises as torch 2.11's CPU build does for row-wise scales (run AE): the
    emulation never calls it, and CUDA's W8A8 stays on."""
    if device == "cpu":
        def per_tensor_only(*args, **kwargs):
            raise RuntimeError("Now _scaled_mm only supports per-tensor")  # torch 2.11's CPU (mkldnn) build
        monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    else:  # the route W8A8 whatever the timing says (tests/test_fp8_route.py tests the choice)
        monkeypatch.setattr(fp8_linear, "_routes", {})
        monkeypatch.setattr(fp8_linear, "measure_route", lambda *args: fp8_linear.ROUTES.index("w8a8"))
    n, k = 96, 320
    quantized, scale = quantize_rows(torch.randn(n, k, device=device) / k ** 0.5, None)
    x = torch.randn(num_rows, k, device=device).to(torch.bfloat16)
    bias = torch.randn(n, device=device).to(torch.bfloat16)
    ref = w8a8_reference(x, quantized, scale, bias).float()
    weight_only = reference(x, dequantize_rows(quantized, scale, None, torch.float32), bias)
    bound = dict(rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
    assert not torch.allclose(weight_only, ref, **bound)  # e4m3 activations: ~2**-5 relative per product
    with fp8_linear.cuda_paths_on_cpu():
        result = fp8_linear.linear(x, quantized, scale, None, bias)
    assert result.dtype == torch.bfloat16 and not result.isnan().any()
    torch.testing.assert_close(result.float(), ref, **bound)
    assert not fp8_linear._scaled_mm_broken


@pytest.mark.parametrize("group_k", [None, 128])
@pytest.mark.parametrize("num_rows", [1, 16])
def test_cuda_paths_on_cpu_decode_is_weight_only(group_k, num_rows):
    """Up to 16 rows the emulation is the weight-only kernel's arithmetic: the float32 reference, one
    rounding (the dequantizing CPU path rounds the weights to bf16 first and differs). Bitwise, so the
    reference is computed on CPU too (a CUDA fp32 GEMM sums in another order)."""
    n, k = SHAPE
    quantized, scale, dequantized = (t.cpu() for t in fp8_weight(n, k, group_k))
    x = torch.randn(num_rows, k).to(torch.bfloat16)
    with fp8_linear.cuda_paths_on_cpu():
        result = fp8_linear.linear(x, quantized, scale, group_k)
        gated = fp8_linear.silu_mul_linear(torch.cat([x, x], -1), quantized, scale, group_k)
    assert torch.equal(result, reference(x, dequantized).to(torch.bfloat16))
    gate = skinny_linear.silu_and_mul(torch.cat([x, x], -1))
    assert torch.equal(gated, reference(gate, dequantized).to(torch.bfloat16))
