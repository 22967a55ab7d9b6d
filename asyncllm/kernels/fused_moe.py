"""The mixture-of-experts block's experts as two grouped GEMMs over expert-sorted token blocks.

layers/moe.py routes each token to top_k experts: T * top_k (token, expert) pairs. align_by_expert
sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M, so that every block of
BLOCK_M sorted rows belongs to one expert; then
- _gate_up_silu_kernel: for each block and BLOCK_N columns of the intermediate dimension, the rows'
  tokens times that expert's gate and up rows, and silu(gate) * up, written per pair (no gate/up
  tensor ever reaches memory);
- _down_weighted_kernel: for each block and BLOCK_N hidden columns, the pairs' intermediate rows times
  the expert's down projection, times the pair's routing weight, written per pair;
and the top_k pairs of each token are summed (a torch sum over a (T, top_k, H) view: deterministic,
no atomics). Each weight tile is read once per block of up to BLOCK_M tokens of its expert.

Everything is sized by the shapes alone (the padded length is its worst case, T * top_k + E *
(BLOCK_M - 1); blocks past the real ones exit at once), with no host synchronisation, so a decode
step with experts can be captured in a CUDA graph. The kernels do not take part in PDL chains
(kernels/pdl.py): they are launched plainly, after the router's torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# the interpreter's bf16 tl.dot workaround and fp32's exact dots, shared with the attention kernels
from asyncllm.kernels.fused_ops import _dot, _dot_config
from asyncllm.kernels.host import cdiv


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    # few pairs per expert (decode): small blocks waste less of each weight tile's reuse on padding
    return 16 if num_pairs <= 4 * num_experts else 64


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts): sorted_pairs (padded length,) int32 holds the pair indices
    (token * top_k + choice) grouped by expert, each expert's run padded with num_pairs to a multiple
    of block_m; block_experts (padded length / block_m,) int32 the expert of each block, num_experts
    for blocks past the last real one."""
    ids = topk_ids.flatten()
    num_pairs = ids.numel()
    padded_len = cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    order = ids.argsort(stable=True)
    sorted_ids = ids[order]
    # a pair's rank among its expert's pairs: its sorted position minus the pairs of lower experts
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[sorted_ids]
    destination = (padded_ends - padded_counts)[sorted_ids] + rank
    sorted_pairs = torch.full((padded_len,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs.scatter_(0, destination, order.to(torch.int32))
    block_starts = torch.arange(0, padded_len, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


@triton.jit
def _block_rows_and_cols(sorted_pairs_ptr, num_pairs, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's block of BLOCK_M sorted pairs (padding: num_pairs) and BLOCK_N output columns,
    with their masks."""
    pairs = tl.load(sorted_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, pairs < num_pairs, cols, cols < N


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr,
                         num_pairs, top_k, N, K, stride_x, stride_we, stride_wn, stride_o, num_experts,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    pairs, row_mask, cols, col_mask = _block_rows_and_cols(sorted_pairs_ptr, num_pairs, N, BLOCK_M, BLOCK_N)
    tokens = (pairs // top_k).to(tl.int64)
    w_gate = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
    w_up = w_gate + N * stride_wn  # gate_up stacks the N gate rows, then the N up rows
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        acc_gate += _dot(a, tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0), UPCAST, PRECISION)
        acc_up += _dot(a, tl.load(w_up + ks[:, None], mask=w_mask, other=0.0), UPCAST, PRECISION)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out, h.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_weighted_kernel(h_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
                          num_pairs, N, K, stride_h, stride_we, stride_wn, stride_o, num_experts,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    pairs, row_mask, cols, col_mask = _block_rows_and_cols(sorted_pairs_ptr, num_pairs, N, BLOCK_M, BLOCK_N)
    rows = pairs.to(tl.int64)
    w = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        acc += _dot(a, tl.load(w + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0), UPCAST,
                    PRECISION)
    acc = acc * tl.load(weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
    out = out_ptr + rows[:, None] * stride_o + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, intermediate: torch.Tensor | None = None,
              pair_out: torch.Tensor | None = None) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]): x (T, H); gate_up (E, 2I, H);
    down (E, H, I); topk_weights (T, k) float32; topk_ids (T, k). intermediate (T*k, I) and pair_out
    (T*k, H), allocated here where not given (the tests pass poisoned ones)."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter_size = two_i // 2
    top_k = topk_ids.size(1)
    num_pairs = num_tokens * top_k
    x = x if x.stride(1) == 1 else x.contiguous()
    block_m = choose_block_m(num_pairs, num_experts)
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    if intermediate is None:
        intermediate = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    if pair_out is None:
        pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    num_blocks = block_experts.numel()
    block_n, block_k = 64, 64
    upcast, precision = _dot_config(x.dtype)
    _gate_up_silu_kernel[(num_blocks, cdiv(inter_size, block_n))](
        x, gate_up, intermediate, sorted_pairs, block_experts, num_pairs, top_k, inter_size, hidden,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), intermediate.stride(0), num_experts,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision)
    weights = topk_weights.flatten().float()
    _down_weighted_kernel[(num_blocks, cdiv(hidden, block_n))](
        intermediate, down, pair_out, sorted_pairs, block_experts, weights, num_pairs, hidden, inter_size,
        intermediate.stride(0), down.stride(0), down.stride(1), pair_out.stride(0), num_experts,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1)
