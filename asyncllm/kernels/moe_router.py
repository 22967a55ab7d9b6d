"""The mixture-of-experts router's top-k in one kernel: layers/moe.py's route (softmax over every
expert in float32, the k most probable, optionally renormalised over the k) for a (T, E) block of
router logits.

In PyTorch that is a cast, a softmax, a topk and a division with its sum: four to six launches a
layer, some 0.3 ms a token at batch 1 over Qwen3-30B-A3B's 48 layers inside the decode graph. Here
one program per token holds the token's E <= MAX_EXPERTS logits in registers: max, exp, sum, then
k rounds of argmax, each taking the most probable expert not yet taken, lowest index among equal
probabilities (so exact ties go to the lower expert id; torch.topk leaves their order unspecified).
It writes topk_weights (T, k) float32 and topk_ids (T, k) int64, what the expert kernels take
(fused_moe's sort indexes with the ids, so int64).

A token whose logits hold a NaN or +inf has NaN probabilities, as in PyTorch; its weights come out
NaN, but its ids are still k distinct experts in range (the lowest not yet taken), so a broken
row cannot send the expert kernels out of bounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels.host import next_power_of_2

MAX_EXPERTS = 256  # the logits of a token live in one program's registers


@triton.jit
def topk_of_rows(logits, valid, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                 RENORMALIZE: tl.constexpr):
    """route() for a (rows, BLOCK_E) tile of float32 logits, `valid` marking the real experts (the
    padding holds -inf): (weights (rows, BLOCK_K) float32, ids (rows, BLOCK_K) int32), the columns
    past TOP_K 0. Also kernels/skinny_moe.py's, which routes inside its first experts kernel."""
    experts = tl.arange(0, BLOCK_E)[None, :]
    exps = tl.exp(logits - tl.max(logits, 1)[:, None])  # the padding's exp(-inf) is 0
    probs = exps / tl.sum(exps, 1)[:, None]
    # what the argmax rounds compare: a NaN probability ranks below every real one (>= 0) and above
    # the padding and the experts already taken (-1), so each round still takes a valid new expert
    keys = tl.where(valid, tl.where(probs == probs, probs, -0.5), -1.0)
    choices = tl.arange(0, BLOCK_K)[None, :]
    top_weights = tl.zeros((logits.shape[0], BLOCK_K), dtype=tl.float32)
    top_ids = tl.zeros((logits.shape[0], BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(keys, 1)[:, None]
        chosen = tl.min(tl.where(keys == best, experts, BLOCK_E), 1)[:, None]
        picked = experts == chosen
        top_weights = tl.where(choices == k, tl.sum(tl.where(picked, probs, 0.0), 1)[:, None], top_weights)
        top_ids = tl.where(choices == k, chosen, top_ids)
        keys = tl.where(picked, -1.0, keys)
    if RENORMALIZE:  # the choices past TOP_K hold 0 and add nothing
        top_weights = top_weights / tl.sum(top_weights, 1)[:, None]
    return top_weights, top_ids


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits, stride_weights, stride_ids,
                       TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       RENORMALIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)[None, :]
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    top_weights, top_ids = topk_of_rows(logits, valid, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE)
    choices = tl.arange(0, BLOCK_K)[None, :]
    mask = choices < TOP_K
    tl.store(weights_ptr + token * stride_weights + choices, top_weights, mask=mask)
    tl.store(ids_ptr + token * stride_ids + choices, top_ids.to(ids_ptr.dtype.element_ty), mask=mask)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, topk_weights: torch.Tensor | None = None,
               topk_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.py route's (weights (T, k) float32, expert ids (T, k) int64) for router_logits
    (T, E), E <= MAX_EXPERTS, in any float dtype. topk_weights and topk_ids are allocated here where
    not given (the tests pass poisoned ones)."""
    num_tokens, num_experts = router_logits.shape
    assert 0 < top_k <= num_experts <= MAX_EXPERTS, (top_k, num_experts)
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    if topk_weights is None:
        topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if topk_ids is None:
        topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    assert topk_weights.dtype == torch.float32 and topk_weights.shape == (num_tokens, top_k)
    assert topk_ids.shape == (num_tokens, top_k) and topk_weights.stride(1) == 1 and topk_ids.stride(1) == 1
    if num_tokens == 0:
        return topk_weights, topk_ids
    block_e = next_power_of_2(num_experts)
    _route_topk_kernel[(num_tokens,)](
        logits, topk_weights, topk_ids, num_experts, logits.stride(0), topk_weights.stride(0), topk_ids.stride(0),
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=next_power_of_2(top_k), RENORMALIZE=renormalize,
        num_warps=1 if block_e <= 128 else 2)
    return topk_weights, topk_ids
