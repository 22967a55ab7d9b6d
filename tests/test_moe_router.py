"""kernels/moe_router.py (the router's softmax, top-k and renormalisation in one kernel) against
layers/moe.py's route (the PyTorch ops, whose block tests/test_moe.py checks against HF transformers),
its outputs poisoned first (ids -1, weights NaN) so that an entry the kernel never writes fails.

Qwen3-MoE's shape (128 experts, top-8) and Mixtral's (8, top-2), norm_topk_prob on and off, float32
and bf16 logits, 1 / 3 / 16 / 100 tokens; logits with no ties (bf16's 8-bit mantissa ties often
among 128 random logits, and torch.topk leaves the order of ties unspecified), then near-ties one
bf16 step apart, exact ties (lowest expert first) and NaN rows (ids still valid). Then the whole MoE
block with the kernel router against the block with PyTorch's. Without CUDA through Triton's
interpreter, with an sm_90 compile-only check; with CUDA also Qwen3-30B-A3B's layer at up to 4,096
tokens and inside a CUDA graph.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`
pytest.importorskip("triton")

from asyncllm.kernels.moe_router import MAX_EXPERTS, route_topk  # noqa: E402
from asyncllm.layers.moe import SparseMoeBlock, route  # noqa: E402
from helpers import compile_for_sm90_in_subprocess, seed_every_test  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
_seed = seed_every_test(0)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA: the 30B-A3B layer and CUDA graphs")

SHAPES = {"qwen3moe": (128, 8), "mixtral": (8, 2)}  # (experts, top_k)


def distinct_logits(num_tokens: int, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Random logits with no two alike in a row: float32 normals (ties have probability ~0), or in
    bf16 a random permutation of a grid of exactly representable values 8 / E apart in [-4, 4)."""
    if dtype == torch.float32:
        return (2 * torch.randn(num_tokens, num_experts)).to(DEVICE)
    grid = torch.stack([torch.randperm(num_experts) for _ in range(num_tokens)]).float() * (8 / num_experts) - 4
    logits = grid.to(DEVICE, dtype)
    assert torch.equal(logits.float(), grid.to(DEVICE)) and all(len(set(r)) == num_experts for r in logits.tolist())
    return logits


def poisoned(num_tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((num_tokens, top_k), float("nan"), device=DEVICE),
            torch.full((num_tokens, top_k), -1, dtype=torch.int64, device=DEVICE))


def kernel_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = poisoned(logits.size(0), top_k)
    got_weights, got_ids = route_topk(logits, top_k, renormalize, weights, ids)
    assert got_weights.data_ptr() == weights.data_ptr() and got_ids.data_ptr() == ids.data_ptr()
    assert not weights.isnan().any(), "a weight the kernel did not write"
    assert (ids >= 0).all(), "an id the kernel did not write"
    return weights, ids


def assert_routes_alike(logits: torch.Tensor, top_k: int, renormalize: bool):
    weights, ids = kernel_route(logits, top_k, renormalize)
    want_weights, want_ids = route(logits, top_k, renormalize)
    assert ids.dtype == want_ids.dtype == torch.int64 and weights.dtype == want_weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_router_kernel_matches_the_torch_route(shape, renormalize, dtype, num_tokens):
    experts, top_k = SHAPES[shape]
    assert_routes_alike(distinct_logits(num_tokens, experts, dtype), top_k, renormalize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_kernel_orders_near_ties_as_torch(dtype):
    """Logits one bf16 step apart at the top (1/64 at 2.0) and at the top-8 boundary (1/128 at 1.5),
    the higher expert id the larger: an argmax that lost the difference would take the lower id."""
    logits = distinct_logits(4, 128, torch.bfloat16).float() / 4  # k / 64 in [-1, 1)
    logits[:, 10], logits[:, 90] = 2.0, 2.0 + 2.0 ** -6  # choices 1 and 2
    logits[:, 30:35] = 1.75 + torch.arange(5, dtype=torch.float32) / 32  # choices 3-7
    logits[:, 20], logits[:, 100] = 1.5, 1.5 + 2.0 ** -7  # choice 8, and the first one left out
    logits = logits.to(dtype)
    assert len(set(logits[0].tolist())) == 128
    for renormalize in (True, False):
        assert_routes_alike(logits, 8, renormalize)
    _, ids = kernel_route(logits, 8, True)
    assert ids.tolist() == [[90, 10, 34, 33, 32, 31, 30, 100]] * 4


def test_router_kernel_breaks_exact_ties_by_the_lowest_expert():
    """Equal logits have equal probabilities: the kernel takes them lowest id first (torch.topk's
    order among ties is unspecified, so this is checked against the rule, not against torch)."""
    logits = torch.full((2, 8), -1.0, device=DEVICE)
    logits[0, [6, 2, 4]] = 1.0  # three tied for top-2: experts 2 and 4
    logits[1, [7, 5]] = 3.0  # tied first and second; then a tie of the six others at the boundary
    weights, ids = kernel_route(logits, 2, False)
    assert ids.tolist() == [[2, 4], [5, 7]]
    assert weights[0, 0] == weights[0, 1] and weights[1, 0] == weights[1, 1]
    _, ids = kernel_route(logits, 3, False)
    assert ids.tolist() == [[2, 4, 6], [5, 7, 0]]


def test_router_kernel_keeps_ids_valid_for_a_nan_row():
    """A NaN logit makes the token's probabilities NaN (as in PyTorch); its ids are still distinct
    experts in range, so the expert kernels never index past the stack, and other tokens are untouched."""
    logits = distinct_logits(3, 8, torch.float32)
    logits[1, 3] = float("nan")
    weights, ids = poisoned(3, 2)
    route_topk(logits, 2, True, weights, ids)
    assert weights[1].isnan().all() and ids[1].tolist() == [0, 1]
    want_weights, want_ids = route(logits[[0, 2]], 2, True)
    assert torch.equal(ids[[0, 2]], want_ids)
    torch.testing.assert_close(weights[[0, 2]], want_weights, rtol=1e-5, atol=1e-7)


def test_router_kernel_refuses_more_experts_than_its_registers_hold():
    with pytest.raises(AssertionError):
        route_topk(torch.zeros(1, MAX_EXPERTS + 1, device=DEVICE), 8, True)
    with pytest.raises(AssertionError):
        route_topk(torch.zeros(1, 8, device=DEVICE), 9, True)


def make_block(hidden: int, experts: int, top_k: int, inter: int, renormalize: bool,
               dtype=torch.float32) -> SparseMoeBlock:
    with torch.device(DEVICE):
        block = SparseMoeBlock(hidden, experts, top_k, inter, renormalize)
    for p in block.parameters():
        p.data = p.data.to(dtype).normal_(0, hidden ** -0.5)
    return block


@pytest.mark.parametrize("renormalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_moe_block_with_the_kernel_router_matches_the_torch_route(shape, renormalize):
    experts, top_k = SHAPES[shape]
    block = make_block(64, experts, top_k, 48, renormalize)
    from asyncllm.kernels import moe_router
    if CUDA:  # the block picks the kernel itself on CUDA
        assert block._router is moe_router
    block._router = moe_router  # on CPU the experts stay forward_native; only the router changes
    x = torch.randn(5, 64, device=DEVICE)
    got = block(x)
    weights, ids = route(block.gate(x), top_k, renormalize)
    torch.testing.assert_close(got, block.forward_native(x, weights, ids), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="on CUDA the block takes the kernel (the test above)")
def test_moe_block_keeps_the_torch_route_on_cpu():
    assert make_block(64, 8, 2, 48, True)._router is None


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 8, 16, 64, 256, 1000, 4096])
def test_router_kernel_on_the_30b_a3b_shape(num_tokens):
    for dtype in (torch.bfloat16, torch.float32):
        assert_routes_alike(distinct_logits(num_tokens, 128, dtype), 8, True)
    assert_routes_alike(distinct_logits(num_tokens, MAX_EXPERTS, torch.float32), 8, False)


@needs_cuda
@pytest.mark.gpu
def test_router_kernel_replays_in_a_cuda_graph():
    logits = distinct_logits(4, 128, torch.bfloat16)
    route_topk(logits, 8, True)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_topk(logits, 8, True)
    for _ in range(2):
        logits.copy_(distinct_logits(4, 128, torch.bfloat16))
        graph.replay()
        want_weights, want_ids = route(logits, 8, True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-7)


def compile_all_for_sm90() -> int:
    """The kernel for Qwen3-MoE (128 experts, top-8, bf16, renormalised), Mixtral (8, top-2, fp32
    logits, raw) and the largest (256 experts, two warps), built for sm_90."""
    from test_kernels import _compile_for_sm90
    from asyncllm.kernels import moe_router
    count = 0
    for experts, top_k, dtype, renormalize in ((128, 8, torch.bfloat16, True), (8, 2, torch.float32, False),
                                               (MAX_EXPERTS, 8, torch.bfloat16, False)):
        tokens = 4
        logits = torch.empty(tokens, experts, dtype=dtype)
        weights, ids = torch.empty(tokens, top_k), torch.empty(tokens, top_k, dtype=torch.int64)
        block_e = 1 << (experts - 1).bit_length()
        _compile_for_sm90(moe_router._route_topk_kernel, (logits, weights, ids, experts, experts, top_k, top_k),
                          dict(TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=1 << (top_k - 1).bit_length(),
                               RENORMALIZE=renormalize, num_warps=1 if block_e <= 128 else 2))
        count += 1
    return count


@pytest.mark.skipif(CUDA, reason="on CUDA the tests above compile the kernel for real")
def test_router_kernel_compiles_for_sm90():
    """The interpreter never compiles: build the kernel for sm_90 in a subprocess, so compile-only
    errors surface on CPU too."""
    assert compile_for_sm90_in_subprocess("test_moe_router", "compile_all_for_sm90") == 3
