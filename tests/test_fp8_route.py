"""FP8 weights above 16 rows (layers/fp8_linear.py): the conversions' kernels (kernels/fp8_quant.py:
activations quantized per token for W8A8, weights dequantized for the bf16 GEMM) against their PyTorch
references, bit for bit, into NaN-poisoned outputs (on CPU through Triton's interpreter, plus a
compile for sm_90); and the per-shape route choice between the two, kept in the start-up cache.
"""
from __future__ import annotations

import json

import pytest
import torch

from test_kernels import CUDA, DEVICE, _compile_for_sm90  # noqa: E402  (sets the interpreter up)

from asyncllm.layers import fp8_linear, skinny_linear  # noqa: E402
from asyncllm.layers.fp8_linear import ROUTE_BUCKETS, ROUTES, quantize_rows  # noqa: E402
from asyncllm.startup_cache import StartupDecisions  # noqa: E402
from helpers import LaunchRecorder, compile_for_sm90_in_subprocess, seed_every_test  # noqa: E402

_seed = seed_every_test(4848)


def torch_quantize_per_token(x: torch.Tensor):
    """fp8_linear's PyTorch arithmetic (its CPU path), whatever device x is on."""
    return fp8_linear._quantize_per_token(x.cpu())


def activations(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes, one all zero (scale clamped to 1e-12), one with a value past
    what a bf16 of 448 * scale would hold, and rows wider than their view (a row stride > cols)."""
    x = torch.randn(rows, cols + 3) * torch.logspace(-6, 4, rows)[:, None]
    x[min(1, rows - 1)] = 0
    x[-1, 0] = 3e4
    return x.to(dtype).to(DEVICE)[:, :cols]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [1, 200, 9000])  # one element; one tile; more than MAX_ONE_TILE: two passes
def test_quantize_per_token_kernel_matches_pytorch(dtype, cols):
    from asyncllm.kernels.fp8_quant import MAX_ONE_TILE, quantize_per_token
    assert (cols > MAX_ONE_TILE) == (cols == 9000)
    rows = 3 if cols > MAX_ONE_TILE else 6
    x = activations(rows, cols, dtype)
    out = torch.full((rows, cols), float("nan"), device=DEVICE).to(torch.float8_e4m3fn)  # poisoned
    scale = torch.full((rows, 1), float("nan"), device=DEVICE)
    quantized, x_scale = quantize_per_token(x, out=out, scale=scale)
    assert quantized is out and x_scale is scale
    want, want_scale = torch_quantize_per_token(x)
    assert torch.equal(x_scale.cpu(), want_scale), (x_scale.flatten(), want_scale.flatten())
    assert not quantized.float().isnan().any()  # every element written
    # bit for bit, signed zeros included, here and on CUDA: the kernel rounds onto e4m3's grid itself
    # (the interpreter's own fp32 -> e4m3 cast rounds ties away from zero and mis-carries)
    assert torch.equal(quantized.cpu().view(torch.uint8), want.view(torch.uint8))
    assert quantized[1].float().abs().max() == 0 and x_scale[1] == 1e-12  # the zero row
    assert quantized.float().abs().amax(-1).cpu().tolist() == [448.0 if r != 1 else 0.0 for r in range(rows)]


def test_quantize_per_token_rounds_like_pytorch_at_every_tie_and_edge():
    """Every e4m3 value, the midpoints between neighbours (ties: to even), one fp32 ulp either side of
    them, subnormals (spacing 2**-9) and what rounds to 0, carries into the next binade (15.5 * 2**k),
    and both zeros, with a row amax of 448 so that the scale is 1 and x / scale is x: bit for bit
    PyTorch's cast, on CPU (the interpreter) and CUDA."""
    from asyncllm.kernels.fp8_quant import quantize_per_token
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending
    ties = (grid[:-1] + grid[1:]) / 2
    below, above = torch.nextafter(ties, torch.zeros(())), torch.nextafter(ties, torch.full((), 1e3))
    edges = torch.tensor([2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11, 1e-40, 2.0 ** -6 - 2.0 ** -12, 31.0, 15.5, 0.0])
    values = torch.cat([grid, ties, below, above, edges])
    values = torch.cat([values, -values])
    x = torch.cat([torch.tensor([448.0]), values])[None].to(DEVICE)
    out = torch.full(x.shape, float("nan"), device=DEVICE).to(torch.float8_e4m3fn)  # poisoned
    quantized, scale = quantize_per_token(x, out=out)
    assert scale.item() == 1.0
    want = x.cpu().to(torch.float8_e4m3fn)
    assert torch.equal(quantized.cpu().view(torch.uint8), want.view(torch.uint8)), \
        [(v, g, w) for v, g, w in zip(x.cpu()[0].tolist(), quantized.cpu().float()[0].tolist(),
                                      want.float()[0].tolist()) if g != w or str(g) != str(w)][:8]


def test_quantize_per_token_refuses_a_transposed_input():
    from asyncllm.kernels.fp8_quant import quantize_per_token
    with pytest.raises(ValueError, match="quantize_per_token: x must be 2-D with unit column stride"):
        quantize_per_token(torch.randn(8, 4, device=DEVICE).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_k", [None, 128, 32])
def test_dequantize_rows_kernel_matches_pytorch(dtype, group_k):
    """fp8 * scale in fp32, one rounding (200 columns: a partial last group of 128, several tiles with
    DEQUANT_BLOCK lowered). bf16 in the interpreter within an ulp: it truncates where the GPU rounds."""
    from asyncllm.kernels import fp8_quant
    quantized, scale = quantize_rows(torch.randn(37, 200) * 0.02, group_k)
    want = fp8_linear.dequantize_rows(quantized, scale, group_k, dtype)  # CPU tensors: PyTorch's arithmetic
    for block in (fp8_quant.DEQUANT_BLOCK, 64):
        out = torch.full((37, 200), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
        original, fp8_quant.DEQUANT_BLOCK = fp8_quant.DEQUANT_BLOCK, block
        try:
            got = fp8_quant.dequantize_rows(quantized.to(DEVICE), scale.to(DEVICE), group_k, dtype, out=out)
        finally:
            fp8_quant.DEQUANT_BLOCK = original
        assert got is out and not got.isnan().any()
        if dtype == torch.float32 or CUDA:
            assert torch.equal(got.cpu(), want), (group_k, block)
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=2 ** -7, atol=0)


def compile_fp8_conversions_for_sm90() -> int:
    """The conversions' kernels as quantize_per_token and dequantize_rows launch them at the 0.6B / 8B
    widths, each built for sm_90 (test_kernels._compile_for_sm90)."""
    from asyncllm.kernels import fp8_quant
    launches = []

    kernels = ("_quantize_per_token_kernel", "_dequantize_rows_kernel")
    originals = [getattr(fp8_quant, name) for name in kernels]
    for name, kernel in zip(kernels, originals):
        setattr(fp8_quant, name, LaunchRecorder(kernel, launches))
    try:
        for cols in (1024, 3072, 12288):  # one tile (2 widths), two passes
            fp8_quant.quantize_per_token(torch.empty(32, cols, dtype=torch.bfloat16))
        weight = torch.empty(256, 1024, dtype=torch.float8_e4m3fn)
        fp8_quant.dequantize_rows(weight, torch.ones(256, 1), None, torch.bfloat16)
        fp8_quant.dequantize_rows(weight, torch.ones(256, 8), 128, torch.bfloat16)
    finally:
        for name, kernel in zip(kernels, originals):
            setattr(fp8_quant, name, kernel)
    for kernel, args, kwargs in launches:
        _compile_for_sm90(kernel, args, kwargs)
    return len(launches)


@pytest.mark.skipif(CUDA, reason="on CUDA the tests above compile the kernels for real")
def test_fp8_conversions_compile_for_sm90():
    assert compile_for_sm90_in_subprocess("test_fp8_route", "compile_fp8_conversions_for_sm90") == 5


# ---- the route per (shape, row bucket) ----
def test_choose_route_takes_w8a8_only_where_clearly_faster():
    w8a8, dequantize = ROUTES.index("w8a8"), ROUTES.index("dequantize")
    assert fp8_linear.choose_route([1.0, 2.0]) == w8a8
    assert fp8_linear.choose_route([2.0, 1.0]) == dequantize
    assert fp8_linear.choose_route([0.99, 1.0]) == dequantize  # a tie: the weight-only arithmetic's quality


def test_route_bucket_is_the_smallest_that_holds_the_rows():
    assert all(b & (b - 1) == 0 for b in ROUTE_BUCKETS)  # route_bucket's rounding assumes powers of two
    for rows in range(17, 3000):
        bucket = fp8_linear.route_bucket(rows)
        holding = [b for b in ROUTE_BUCKETS if b >= rows]
        assert bucket == (holding[0] if holding else ROUTE_BUCKETS[-1]), rows


class FakeTimings:
    """measure_route's stand-in: W8A8 'faster' from 256 rows on, as a calls log."""

    def __init__(self):
        self.rows = []

    def __call__(self, x, weight, scale):
        self.rows.append(x.shape[0])
        assert x.shape[1] == weight.shape[1] and x.dtype == torch.bfloat16
        return fp8_linear.choose_route([1.0, 2.0] if x.shape[0] >= 256 else [2.0, 1.0])


@pytest.fixture
def startup_cache(tmp_path):
    """A start-up cache file as an engine's runner would give skinny_linear (use_decisions)."""
    def opened():
        return StartupDecisions(str(tmp_path / "startup" / "decisions.json"), {"gpu": "test"})
    previous = skinny_linear.startup_decisions()
    try:
        yield opened
    finally:
        skinny_linear.use_decisions(previous)


def test_routes_measured_once_then_read_from_the_startup_cache(startup_cache):
    weight, scale = quantize_rows(torch.randn(64, 96), None)
    skinny_linear.use_decisions(startup_cache())
    timings = FakeTimings()
    routes = fp8_linear._routes_for(DEVICE, weight, scale, timings)
    assert timings.rows == list(ROUTE_BUCKETS)
    assert routes == {(DEVICE, 64, 96, b): "w8a8" if b >= 256 else "dequantize" for b in ROUTE_BUCKETS}
    skinny_linear.use_decisions(startup_cache())  # a warm start: nothing measured
    again = FakeTimings()
    assert fp8_linear._routes_for(DEVICE, weight, scale, again) == routes and again.rows == []
    assert skinny_linear.startup_decisions().num_read == len(ROUTE_BUCKETS)
    other, other_scale = quantize_rows(torch.randn(32, 96), None)  # another shape: its own questions
    assert fp8_linear._routes_for(DEVICE, other, other_scale, again) and again.rows == list(ROUTE_BUCKETS)


def test_a_bad_cached_route_is_measured_again(startup_cache):
    weight, scale = quantize_rows(torch.randn(64, 96), None)
    skinny_linear.use_decisions(startup_cache())
    fp8_linear._routes_for(DEVICE, weight, scale, FakeTimings())
    path = skinny_linear.startup_decisions().path
    with open(path) as f:
        content = json.load(f)
    answers = content["decisions"]["FP8 GEMM route"]
    assert len(answers) == len(ROUTE_BUCKETS) and set(answers.values()) == {0, 1}
    bad = {}
    for question, value in zip(sorted(answers), (len(ROUTES), -1, "w8a8", None, 0.0)):
        answers[question] = value
        bad[json.loads(question)["rows"]] = value
    with open(path, "w") as f:
        json.dump(content, f)
    skinny_linear.use_decisions(startup_cache())
    timings = FakeTimings()
    routes = fp8_linear._routes_for(DEVICE, weight, scale, timings)
    assert sorted(timings.rows) == sorted(bad)  # only the bad answers, each once
    assert routes == {(DEVICE, 64, 96, b): "w8a8" if b >= 256 else "dequantize" for b in ROUTE_BUCKETS}


def test_cpu_keeps_its_routes_without_timing(monkeypatch):
    """On CPU nothing is timed and nothing decided: the dequantizing path (bitwise the dequantized
    reference in fp32), or the W8A8 emulation under cuda_paths_on_cpu, as before."""
    def never(*args):
        raise AssertionError("a route was timed on CPU")
    monkeypatch.setattr(fp8_linear, "measure_route", never)
    monkeypatch.setattr(fp8_linear, "_routes", {})
    weight, scale = quantize_rows(torch.randn(64, 96), None)
    x = torch.randn(40, 96).to(torch.bfloat16)
    assert fp8_linear._route(x, weight, scale) == "dequantize"
    dequantized = fp8_linear.dequantize_rows(weight, scale, None, torch.bfloat16)
    assert torch.equal(fp8_linear.linear(x, weight, scale, None), torch.nn.functional.linear(x, dequantized))
    with fp8_linear.cuda_paths_on_cpu():
        emulated = fp8_linear.linear(x, weight, scale, None)
    assert torch.equal(emulated, fp8_linear._w8a8_emulated(x, weight, scale, None))
    assert fp8_linear._routes == {}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs CUDA sm_89+: the timing of W8A8 against dequantize + bf16 GEMM")
def test_routes_timed_on_cuda(startup_cache):
    """On the GPU each bucket gets a route by timing, each route computes its product, and a second
    start-up reads them all."""
    weight, scale = quantize_rows(torch.randn(1024, 2048, device=DEVICE) / 2048 ** 0.5, None)
    skinny_linear.use_decisions(startup_cache())
    routes = fp8_linear._routes_for(DEVICE, weight, scale, fp8_linear.measure_route)
    assert set(routes.values()) <= set(ROUTES) and len(routes) == len(ROUTE_BUCKETS)
    skinny_linear.use_decisions(startup_cache())
    assert fp8_linear._routes_for(DEVICE, weight, scale, FakeTimings()) == routes
