"""Top-k / top-p / min-p cutoffs: the sort-free kernels (kernels/sampling_filters.py) against the
plain-PyTorch reference (layers/sampling_filters.py), and the reference against the sampler's
sort-based top-k/top-p and min-p.

Without CUDA the kernels run through Triton's interpreter on small vocabularies split into several
chunks; with CUDA over Qwen3's vocabulary (151,936) at batches 1 to 256.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`
pytest.importorskip("triton")

from asyncllm.kernels import sampling_filters as kernels  # noqa: E402
from asyncllm.layers.sampling_filters import (apply_cutoffs, filter_cutoffs,  # noqa: E402
                                              filter_cutoffs_reference)
from helpers import LaunchRecorder, compile_for_sm90_in_subprocess, seed_every_test  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
_AOT_SUBPROCESS = os.environ.get("ASYNCLLM_KERNELS_AOT") == "1"  # test_filters_compile_for_sm90's child
if not CUDA and not _AOT_SUBPROCESS:
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(kernels._chunk_kernel, InterpretedFunction):
        pytest.skip("asyncllm.kernels was imported before TRITON_INTERPRET=1 was set and cannot run on CPU; "
                    "export TRITON_INTERPRET=1", allow_module_level=True)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
INF = float("inf")
MASS_TOL = 1e-3 if CUDA else 1e-4  # float32 sums over 151,936 tokens (CUDA) or a few thousand

_seed = seed_every_test(22)


@pytest.fixture
def small_chunks(monkeypatch):
    """On CPU: a few thousand tokens split into several chunks of few cached candidates, so that
    both the cached path and the whole-row search run."""
    if not CUDA:
        monkeypatch.setattr(kernels, "CHUNK", 512)
        monkeypatch.setattr(kernels, "PER_CHUNK", 16)


# ----------------------------------------------------------------------------- helpers

def make_rows(num_rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Logits of several shapes by row: random, peaked (a few far above the rest), flat, with a
    masked (-inf) half, and coarse (many exact ties)."""
    logits = 3 * torch.randn(num_rows, vocab, device=DEVICE)
    for row in range(num_rows):
        kind = row % 5
        if kind == 1:
            logits[row, torch.randperm(vocab, device=DEVICE)[:5]] += 15
        elif kind == 2:
            logits[row] *= 0.05
        elif kind == 3:
            logits[row, torch.randperm(vocab, device=DEVICE)[:vocab // 2]] = -INF
        elif kind == 4:
            logits[row] = logits[row].round()
    return logits.to(dtype)


def pick(values, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([values[(7 * i + 3) % len(values)] for i in range(num_rows)], dtype=dtype, device=DEVICE)


def settings(num_rows: int, vocab: int, filters: str):
    temperatures = pick([0.5, 0.7, 1.0, 1.3, 2.0], num_rows, torch.float32)
    temperatures[num_rows // 2] = 0.0  # a greedy row
    top_ks = pick([0, 1, 7, 50, vocab // 3, vocab], num_rows, torch.int64) if "k" in filters else None
    top_ps = pick([1.0, 0.3, 0.9, 0.95, 1.0, 0.999], num_rows, torch.float32) if "p" in filters else None
    min_ps = pick([0.0, 0.05, 0.2, 0.5], num_rows, torch.float32) if "m" in filters else None
    return temperatures, top_ks, top_ps, min_ps


def scaled(logits, temperatures):
    return logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)


def assert_same_kept(logits, temperatures, top_ks, top_ps, min_ps, got, ref):
    """The kept sets z >= cutoff agree, except for tokens at a boundary within float32 rounding: a
    token whose mass strictly above it (float64) is within MASS_TOL of top_p, or whose z is within
    rounding of max z + log(min_p); few of them. Greedy rows get -inf; top-k alone agrees exactly."""
    assert not got.isnan().any(), "NaN cutoffs"
    z = scaled(logits, temperatures)
    assert (got[temperatures <= 0] == -INF).all()
    if top_ps is None and min_ps is None:
        assert torch.equal(got, ref)
    for row in range(len(z)):
        differ = ((z[row] >= got[row]) ^ (z[row] >= ref[row])).nonzero().squeeze(1)
        if len(differ) == 0:
            continue
        few = max(3, z.shape[1] // 1000)  # flat rows: many tokens of tiny mass sit near the top-p boundary
        assert len(differ) <= few, f"row {row}: {len(differ)} tokens differ ({got[row]} vs {ref[row]})"
        zz = z[row].double()
        k_cut = -INF
        if top_ks is not None and 0 < top_ks[row] < z.shape[1]:
            k_cut = zz.sort(descending=True).values[top_ks[row] - 1].item()
        probs = zz.masked_fill(zz < k_cut, -INF).softmax(dim=-1)
        for token in differ.tolist():
            ambiguous = False
            if top_ps is not None and top_ps[row] < 1:
                above = probs[zz > zz[token]].sum().item()
                ambiguous |= abs(above - top_ps[row].item()) <= MASS_TOL
            if min_ps is not None and min_ps[row] > 0:
                threshold = zz.max().item() + math.log(min_ps[row].item())
                ambiguous |= abs(zz[token].item() - threshold) <= 1e-5 * max(1.0, abs(threshold))
            assert ambiguous, f"row {row}, token {token}: kept by one side only ({got[row]} vs {ref[row]})"


def run_kernel(logits, temperatures, top_ks, top_ps, min_ps):
    """The kernels with every output and scratch buffer poisoned with NaN first."""
    workspace = tuple(t.fill_(float("nan")) for t in kernels.filter_workspace(*logits.shape, logits.device))
    out = torch.full((len(logits),), float("nan"), device=logits.device)
    result = kernels.filter_cutoffs(logits, temperatures, top_ks, top_ps, min_ps, out=out, workspace=workspace)
    assert result is out
    return out, kernels.searched_whole_rows(workspace)


# ----------------------------------------------------------------------------- the reference

def sort_based_top_k_top_p(z: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """The sampler's sort-based top-k / top-p before the cutoffs replaced it: an independent
    statement to check the reference against."""
    sorted_z, order = z.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_z, dtype=torch.bool)
    if top_ks is not None:
        remove |= torch.arange(z.shape[-1], device=z.device).unsqueeze(0) >= top_ks.unsqueeze(1)
    if top_ps is not None:
        probs = sorted_z.masked_fill(remove, -INF).softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        remove |= (mass_above >= top_ps.unsqueeze(1)) & (top_ps < 1.0).unsqueeze(1)
    return torch.empty_like(z).scatter_(-1, order, sorted_z.masked_fill(remove, -INF))


def test_reference_matches_the_sort_based_sampler():
    """On random logits (no ties): the reference keeps the tokens that the sampler's former
    sort-based top-k/top-p, then min-p on the renormalised probabilities, kept."""
    num_rows, vocab = 24, 5000
    logits = 3 * torch.randn(num_rows, vocab, device=DEVICE)
    temperatures, top_ks, top_ps, min_ps = settings(num_rows, vocab, "kpm")
    temperatures[temperatures == 0] = 0.8
    z = scaled(logits, temperatures)
    for ks, ps, mps in [(top_ks, None, None), (None, top_ps, None), (top_ks, top_ps, None), (None, None, min_ps),
                        (top_ks, top_ps, min_ps)]:
        cutoffs = filter_cutoffs_reference(logits, temperatures, ks, ps, mps)
        expected = z
        if ks is not None or ps is not None:
            expected = sort_based_top_k_top_p(z, ks.masked_fill(ks == 0, vocab) if ks is not None else None, ps)
        if mps is not None:
            probs = expected.softmax(dim=-1)
            expected = expected.masked_fill(probs < mps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), -INF)
        assert torch.equal(apply_cutoffs(z, cutoffs) > -INF, expected > -INF)


def test_reference_semantics_on_ties_and_masks():
    """Ties at the k-th value all stay; top-p counts the mass strictly above; masked rows keep all."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, -INF],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [-INF] * 6])
    temperatures = torch.tensor([1.0, 1.0, 1.0])
    cut = filter_cutoffs_reference(logits, temperatures, top_ks=torch.tensor([2, 3, 2]))
    assert cut.tolist() == [2.0, 0.0, -INF]
    # row 0: mass above the 2.0s is e^3 / (e^3 + 3 e^2 + e) = 0.447 < 0.5: all three stay
    cut = filter_cutoffs_reference(logits, temperatures, top_ps=torch.tensor([0.5, 0.1, 0.5]))
    assert cut.tolist() == [2.0, 0.0, -INF]
    cut = filter_cutoffs_reference(logits, temperatures, top_ps=torch.tensor([0.44, 1.0, 0.5]))
    assert cut.tolist() == [3.0, -INF, -INF]
    cut = filter_cutoffs_reference(logits, temperatures, min_ps=torch.tensor([math.exp(-1.5), 0.0, 0.5]))
    assert cut.tolist() == pytest.approx([1.5, -INF, -INF])
    assert filter_cutoffs(logits, temperatures, torch.tensor([2, 3, 2])).tolist() == [2.0, 0.0, -INF]


# ----------------------------------------------------------------------------- the kernels

FILTERS = ["k", "p", "m", "kp", "km", "pm", "kpm", ""]


@pytest.mark.parametrize("filters,dtype", [(f, d) for f in FILTERS for d in (torch.float32, torch.bfloat16)]
                         + [("kpm", torch.float16)])
def test_kernel_matches_reference(small_chunks, filters, dtype):
    """Every combination of filters (rows mixing limits, no-limit values and a greedy row), random,
    peaked, flat, half-masked and tied rows; the vocabulary is not a multiple of the chunk."""
    num_rows, vocab = (37, 151936) if CUDA else (10, 3000 + 37)
    logits = make_rows(num_rows, vocab, dtype)
    limits = settings(num_rows, vocab, filters)
    got, _ = run_kernel(logits, *limits)
    assert_same_kept(logits, *limits, got, filter_cutoffs_reference(logits, *limits))


def test_kernel_takes_both_paths(small_chunks):
    """A random row with a small top-k and a peaked row with top-p find their cutoff among the cached
    candidates; a flat row with a wide top-p, and a top-k larger than the cache, search the whole row.
    Both agree with the reference."""
    vocab = 151936 if CUDA else 3000
    logits = 3 * torch.randn(4, vocab, device=DEVICE)
    logits[1, torch.randperm(vocab, device=DEVICE)[:5]] += 15
    logits[2:] *= 0.02
    temperatures = torch.ones(4, device=DEVICE)
    top_ks = torch.tensor([20, 0, 0, vocab // 2], device=DEVICE)
    top_ps = torch.tensor([0.9, 0.8, 0.95, 1.0], device=DEVICE)
    got, whole = run_kernel(logits, temperatures, top_ks, top_ps, None)
    assert whole.tolist() == [False, False, True, True]
    assert_same_kept(logits, temperatures, top_ks, top_ps, None, got,
                     filter_cutoffs_reference(logits, temperatures, top_ks, top_ps))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf - -inf, masked out
def test_kernel_edge_rows(small_chunks):
    """All masked, one finite token, fewer finite tokens than k, ties straddling the k-th value and
    a tiny top-p over ties at the max (all stay), and a whole chunk of ties at the max (more than it
    caches)."""
    vocab = 2000
    logits = torch.randn(6, vocab, device=DEVICE)
    logits[0] = -INF
    logits[1, :] = -INF
    logits[1, 77] = 1.0
    logits[2, 10:] = -INF
    logits[3, :100] = 5.0
    logits[4, :] = 0.5
    logits[5, 600:1200] = 9.0
    temperatures = torch.tensor([1.0, 0.5, 1.0, 1.0, 2.0, 1.0], device=DEVICE)
    top_ks = torch.tensor([5, 5, 50, 30, 10, 40], device=DEVICE)
    top_ps = torch.tensor([0.9, 0.9, 0.9, 1e-6, 0.9, 0.3], device=DEVICE)
    min_ps = torch.tensor([0.1, 0.1, 0.1, 0.0, 0.5, 0.0], device=DEVICE)
    for ks, ps, mps in [(top_ks, None, None), (None, top_ps, None), (top_ks, top_ps, min_ps)]:
        got, _ = run_kernel(logits, temperatures, ks, ps, mps)
        ref = filter_cutoffs_reference(logits, temperatures, ks, ps, mps)
        assert_same_kept(logits, temperatures, ks, ps, mps, got, ref)
        assert got[0] == -INF
        if ps is None:
            assert got[2] == -INF  # 10 finite tokens, k = 50
        else:
            assert got[3] == 5.0 * 1.0  # the tied max
    assert len(kernels.filter_cutoffs(logits[:0], temperatures[:0], top_ks[:0])) == 0


@gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 7, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference_on_qwen3_vocab(num_rows, dtype):
    vocab = 151936
    logits = make_rows(num_rows, vocab, dtype)
    limits = settings(num_rows, vocab, "kpm")
    if num_rows == 1:
        limits = (torch.tensor([0.7], device=DEVICE), torch.tensor([50], device=DEVICE),
                  torch.tensor([0.9], device=DEVICE), torch.tensor([0.05], device=DEVICE))
    got, _ = run_kernel(logits, *limits)
    assert_same_kept(logits, *limits, got, filter_cutoffs_reference(logits, *limits))
    for single in ("k", "p", "m"):
        limits = settings(num_rows, vocab, single)
        got, _ = run_kernel(logits, *limits)
        assert_same_kept(logits, *limits, got, filter_cutoffs_reference(logits, *limits))


# ----------------------------------------------------------------------------- sm_90 compile check

def compile_filters_for_sm90() -> int:
    """Every launch configuration of filter_cutoffs (each filter set, fp32 and bf16 logits), compiled
    for sm_90 with ptxas, as tests/test_kernels.py does for the other kernels."""
    from test_kernels import _compile_for_sm90
    calls = []

    originals = kernels._chunk_kernel, kernels._cutoff_kernel
    kernels._chunk_kernel, kernels._cutoff_kernel = (LaunchRecorder(k, calls) for k in originals)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(3, 151936).to(dtype)
            for filters in FILTERS:
                kernels.filter_cutoffs(logits, *settings(3, 151936, filters))
    finally:
        kernels._chunk_kernel, kernels._cutoff_kernel = originals
    for kernel, args, kwargs in calls:
        _compile_for_sm90(kernel, args, kwargs)
    return len(calls)


@pytest.mark.skipif(CUDA, reason="on CUDA the other tests compile the kernels for real")
def test_filters_compile_for_sm90():
    assert compile_for_sm90_in_subprocess("test_sampling_filters", "compile_filters_for_sm90") == 2 * 2 * len(FILTERS)
