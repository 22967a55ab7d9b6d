"""The mixture-of-experts block's experts for 1..MAX_TOKENS tokens (decode): stream the selected
experts' weights once, split finely enough to keep every SM reading.

At a few tokens the experts cost the bytes of the experts the tokens picked (Qwen3-30B-A3B at batch
1: 8 experts x 3 x 2048 x 768 bf16 = 75.5 MB a layer) and nothing else; kernels/fused_moe.py's
grouped GEMMs sort the pairs first and give each expert block one program per 64 columns, too few
programs to fill the SMs at batch 1. Here there is no sort: each program finds its expert and that
expert's tokens from the (T, top_k) routing table itself, in registers, and
- _skinny_gate_up_kernel, grid (pair, intermediate tiles): it reads a (T, top_k) table routed before
  (skinny_moe, the block's default); or (skinny_moe_routed, with ASYNCLLM_MOE_ROUTED_DECODE=1) every
  program routes the T <= 16 tokens itself from the router's logits, in registers (moe_router's
  topk_of_rows; program (0, 0) writes the table for the down kernel), so routing costs no launch of
  its own. The pair's expert, if the pair is the
  first to pick it ("leader"; later pairs with the same expert exit at once, so each selected
  expert's weights are read once however many tokens chose it), times every token that chose it,
  with silu(gate) * up fused; written per pair as fused_moe's intermediate;
- _skinny_down_kernel, grid (hidden tiles, splits): for its hidden columns, every selected expert
  (the leaders among the pairs of its split) times its tokens' intermediate rows, scaled by each
  token's routing weight and summed over the top_k choices in registers, so the weighted sum needs
  no per-pair output. With more than one split the fp32 partial sums go to a workspace, which
  skinny_gemm's split-K reduce adds (skinny_moe); skinny_moe_routed's down kernel adds them itself:
  the last of a tile's splits to finish (a per-tile arrival counter, which that program sets back to
  0 for the next call) sums them in split order, deterministic, no reduce launch.
Routed, the experts are two launches and the routing none: with the router's GEMM, three a layer
(five by default: the routing kernel and the reduce besides).
Both loops are tl.dot of a weight tile (BLOCK_N weight rows as the MMA's M) with the tokens padded
to 16 columns, as skinny_gemm's dot loop. Sized by the shapes alone, no host synchronisation: a
decode step captures it in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncllm.kernels.fused_ops import _dot, _dot_config
from asyncllm.kernels.host import cdiv, next_power_of_2
from asyncllm.kernels.moe_router import MAX_EXPERTS, topk_of_rows
# the split-K partial sums' reduce where the down kernel does not add them itself (skinny_moe)
from asyncllm.kernels.skinny_gemm import reduce_splits

MAX_TOKENS = 16  # the tokens are the dot's N dimension, padded to 16; more go to fused_moe.py


@dataclass(frozen=True)
class SkinnyMoeConfig:
    gate_up_block_n: int  # intermediate columns per gate_up program (each reads gate and up rows)
    down_block_n: int  # hidden columns per down program
    block_k: int
    down_split: int  # the down kernel's pairs dealt round-robin over this many programs per tile
    num_warps: int = 4
    num_stages: int = 3

    def label(self) -> str:
        return (f"gu n{self.gate_up_block_n} dn n{self.down_block_n} s{self.down_split} k{self.block_k} "
                f"w{self.num_warps} st{self.num_stages}")


def _floor_power_of_2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def choose_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                  num_sms: int) -> SkinnyMoeConfig:
    """About two programs per SM in each kernel: the gate_up tiles narrowed until the selected
    experts (at most T * top_k) fill them, the down tiles 16 to 64 wide and its pairs split until
    they do. (bench_moe.py --sweep times the neighbours.)"""
    target = 2 * num_sms
    experts = min(num_tokens * top_k, num_experts)
    gate_up_n = max(16, min(64, _floor_power_of_2(experts * inter // target)))
    down_n = max(16, min(64, _floor_power_of_2(hidden // target)))
    split = 1
    while cdiv(hidden, down_n) * split < target and split < min(8, experts):
        split *= 2
    return SkinnyMoeConfig(gate_up_n, down_n, 128, split)


def candidate_configs(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                      num_sms: int) -> list[SkinnyMoeConfig]:
    """choose_config's tiling and its neighbours: tiles twice as wide or half, another split, other
    K tiles, 8 warps."""
    first = choose_config(num_tokens, top_k, num_experts, hidden, inter, num_sms)
    configs = [first]
    for gate_up_n in (first.gate_up_block_n // 2, first.gate_up_block_n * 2):
        configs.append(SkinnyMoeConfig(max(16, gate_up_n), first.down_block_n, first.block_k, first.down_split))
    for down_n in (16, 32, 64):
        for split in (1, 2, 4, 8):
            configs.append(SkinnyMoeConfig(first.gate_up_block_n, down_n, first.block_k, split))
    for block_k in (64, 256):
        configs.append(SkinnyMoeConfig(first.gate_up_block_n, first.down_block_n, block_k, first.down_split))
    configs.append(SkinnyMoeConfig(first.gate_up_block_n, first.down_block_n, first.block_k, first.down_split,
                                   num_warps=8))
    configs.append(SkinnyMoeConfig(first.gate_up_block_n, first.down_block_n, first.block_k, first.down_split,
                                   num_stages=4))
    unique = []
    for config in configs:
        if config not in unique:
            unique.append(config)
    return unique


@triton.jit
def _routing_table(ids_ptr, weights_ptr, stride_ids, stride_weights, num_tokens, top_k,
                   BLOCK_T: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """The (BLOCK_T, BLOCK_TOPK) tiles of expert ids (padding: -1, no expert), routing weights
    (padding: 0) and pair indices token * top_k + choice."""
    tokens = tl.arange(0, BLOCK_T)
    choices = tl.arange(0, BLOCK_TOPK)
    valid = (tokens[:, None] < num_tokens) & (choices[None, :] < top_k)
    ids = tl.load(ids_ptr + tokens[:, None] * stride_ids + choices[None, :], mask=valid, other=-1)
    weights = tl.load(weights_ptr + tokens[:, None] * stride_weights + choices[None, :], mask=valid, other=0.0)
    return ids, weights, tokens[:, None] * top_k + choices[None, :]


@triton.jit
def _routed_table(logits_ptr, stride_logits, num_experts, num_tokens, top_k, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_TOPK: tl.constexpr):
    """_routing_table's tiles, routed here from the (T, E) router logits (route()'s softmax, top-k
    and renormalisation)."""
    tokens = tl.arange(0, BLOCK_T)[:, None]
    experts = tl.arange(0, BLOCK_E)[None, :]
    valid = (tokens < num_tokens) & (experts < num_experts)
    logits = tl.load(logits_ptr + tokens * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    logits = tl.where(tokens < num_tokens, logits, 0.0)  # a padding token's row: finite, and masked below
    weights, ids = topk_of_rows(logits, experts < num_experts, TOP_K, BLOCK_E, BLOCK_TOPK, RENORMALIZE)
    choices = tl.arange(0, BLOCK_TOPK)[None, :]
    real = (tokens < num_tokens) & (choices < top_k)
    return tl.where(real, ids, -1), tl.where(real, weights, 0.0), tokens * top_k + choices


@triton.jit
def _expert_of_pair(ids, pair_index, pair, BLOCK_T: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """pair's expert, and whether pair is the first pair (lowest index) that picked it."""
    expert = tl.max(tl.max(tl.where(pair_index == pair, ids, -1), 1), 0)
    first = tl.min(tl.min(tl.where(ids == expert, pair_index, BLOCK_T * BLOCK_TOPK), 1), 0)
    return expert, first == pair


@triton.jit
def _tokens_of(ids, pair_index, expert):
    """Per token (BLOCK_T,): whether it picked expert, and that (token, choice) pair's index."""
    match = ids == expert
    return tl.max(match.to(tl.int32), 1) > 0, tl.sum(tl.where(match, pair_index, 0), 1)


@triton.jit
def _skinny_gate_up_kernel(x_ptr, w_ptr, h_ptr, ids_ptr, weights_ptr, logits_ptr, num_tokens, top_k, num_experts,
                           N, K, stride_x, stride_ids, stride_weights, stride_logits, stride_we, stride_wn, stride_h,
                           ROUTE: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                           RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                           PRECISION: tl.constexpr):
    pair = tl.program_id(0)
    if ROUTE:
        ids, route_weights, pair_index = _routed_table(logits_ptr, stride_logits, num_experts, num_tokens, top_k,
                                                       TOP_K, BLOCK_E, RENORMALIZE, BLOCK_T, BLOCK_TOPK)
        if (pair == 0) & (tl.program_id(1) == 0):  # the table the down kernel (and the caller) read
            real = ids >= 0
            tl.store(ids_ptr + (pair_index // top_k) * stride_ids + pair_index % top_k,
                     ids.to(ids_ptr.dtype.element_ty), mask=real)
            tl.store(weights_ptr + (pair_index // top_k) * stride_weights + pair_index % top_k, route_weights,
                     mask=real)
    else:
        ids, _, pair_index = _routing_table(ids_ptr, weights_ptr, stride_ids, stride_weights, num_tokens, top_k,
                                            BLOCK_T, BLOCK_TOPK)
    expert, leader = _expert_of_pair(ids, pair_index, pair, BLOCK_T, BLOCK_TOPK)
    if not leader:  # an earlier pair's programs do this expert for every token that picked it
        return
    has, pairs = _tokens_of(ids, pair_index, expert)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    tokens = tl.arange(0, BLOCK_T)
    w_gate = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    w_up = w_gate + N * stride_wn  # gate_up stacks the N gate rows, then the N up rows
    xt = x_ptr + tokens[None, :] * stride_x + ks[:, None]  # x^T tiles (BLOCK_K, BLOCK_T)
    acc_gate = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + ks < K
        a = tl.load(xt + k0, mask=k_mask[:, None] & has[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_gate += _dot(tl.load(w_gate + k0, mask=w_mask, other=0.0), a, UPCAST, PRECISION)
        acc_up += _dot(tl.load(w_up + k0, mask=w_mask, other=0.0), a, UPCAST, PRECISION)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = h_ptr + pairs.to(tl.int64)[None, :] * stride_h + cols[:, None]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=n_mask[:, None] & has[None, :])


@triton.jit
def _skinny_down_kernel(h_ptr, w_ptr, out_ptr, partial_ptr, counters_ptr, ids_ptr, weights_ptr, num_tokens, top_k,
                        N, K,
                        stride_h, stride_ids, stride_weights, stride_we, stride_wn, stride_o,
                        SPLIT: tl.constexpr, SUM_SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    split = tl.program_id(1)
    ids, route_weights, pair_index = _routing_table(ids_ptr, weights_ptr, stride_ids, stride_weights, num_tokens,
                                                    top_k, BLOCK_T, BLOCK_TOPK)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for pair in range(split, num_tokens * top_k, SPLIT):
        expert, leader = _expert_of_pair(ids, pair_index, pair, BLOCK_T, BLOCK_TOPK)
        if leader:
            has, pairs = _tokens_of(ids, pair_index, expert)
            token_weights = tl.sum(tl.where(ids == expert, route_weights, 0.0), 1)
            w = w_rows + expert.to(tl.int64) * stride_we
            ht = h_ptr + pairs.to(tl.int64)[None, :] * stride_h + ks[:, None]  # (BLOCK_K, BLOCK_T)
            part = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_mask = k0 + ks < K
                a = tl.load(ht + k0, mask=k_mask[:, None] & has[None, :], other=0.0)
                part += _dot(tl.load(w + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0), a, UPCAST,
                             PRECISION)
            acc += part * token_weights[None, :]
    tokens = tl.arange(0, BLOCK_T)
    mask = n_mask[:, None] & (tokens < num_tokens)[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + tokens[None, :] * stride_o + cols[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # this split's fp32 partial sums at partial[split, token, column]
        offsets = (tokens[None, :]).to(tl.int64) * N + cols[:, None]
        tl.store(partial_ptr + split.to(tl.int64) * num_tokens * N + offsets, acc, mask=mask)
        if SUM_SPLITS:  # else skinny_gemm's split-K reduce adds them, a launch of its own
            # every thread's stores before the release below (the CUDA __syncthreads, __threadfence pattern)
            tl.debug_barrier()
            arrived = tl.atomic_add(counters_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:  # the tile's last split: the others' partial sums are written
                total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # in split order, whichever program came last
                    # .cg: from L2, never a line this SM's L1 may hold from an earlier use of the workspace
                    total += tl.load(partial_ptr + s * num_tokens * N + offsets, mask=mask, other=0.0,
                                     cache_modifier=".cg")
                tl.store(out_ptr + tokens[None, :] * stride_o + cols[:, None], total.to(out_ptr.dtype.element_ty),
                         mask=mask)
                tl.atomic_xchg(counters_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")  # for the next call


def skinny_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, config: SkinnyMoeConfig, intermediate: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe.fused_moe's result for x (T, H) with T <= MAX_TOKENS: gate_up (E, 2I, H); down (E, H, I);
    topk_weights (T, k) float32; topk_ids (T, k). intermediate (T*k, I) and out (T, H), allocated here
    where not given (the tests pass poisoned ones). Split-K sums added by skinny_gemm's reduce."""
    assert topk_ids.stride(1) == 1 and topk_weights.stride(1) == 1 and topk_weights.dtype == torch.float32
    return _experts(x, gate_up, down, topk_weights, topk_ids, config, None, False, intermediate, out, None)


def skinny_moe_routed(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                      gate_up: torch.Tensor, down: torch.Tensor, config: SkinnyMoeConfig,
                      tile_counters: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                      topk_ids: torch.Tensor | None = None, intermediate: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """skinny_moe's result for the routing layers/moe.py's route(router_logits (T, E), top_k,
    renormalize) gives, routed inside the gate_up kernel: two launches in all. topk_weights (T, k)
    float32 and topk_ids (T, k) int64 receive that routing (allocated here where not given)."""
    num_tokens, num_experts = router_logits.shape
    assert 0 < top_k <= num_experts <= MAX_EXPERTS, (top_k, num_experts)
    assert num_tokens == x.size(0), (num_tokens, x.size(0))
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    if topk_weights is None:
        topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    if topk_ids is None:
        topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    assert topk_weights.dtype == torch.float32 and topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    assert topk_ids.stride(1) == 1 and topk_weights.stride(1) == 1
    return _experts(x, gate_up, down, topk_weights, topk_ids, config, logits, renormalize, intermediate, out,
                    tile_counters)


def new_tile_counters(hidden: int, configs, device) -> torch.Tensor:
    """The down kernel's per-tile arrival counters for any of configs at this hidden size: zeros,
    made once (each call leaves them at zero again)."""
    tiles = max([cdiv(hidden, config.down_block_n) for config in configs], default=0)
    return torch.zeros(tiles, dtype=torch.int32, device=device)


def _experts(x, gate_up, down, topk_weights, topk_ids, config, router_logits, renormalize, intermediate, out,
             tile_counters):
    num_tokens, hidden = x.shape
    inter_size = gate_up.shape[1] // 2
    top_k = topk_ids.size(1)
    assert num_tokens <= MAX_TOKENS, num_tokens
    assert gate_up.stride(2) == 1 and down.stride(2) == 1
    x = x if x.stride(1) == 1 else x.contiguous()
    if intermediate is None:
        intermediate = torch.empty(num_tokens * top_k, inter_size, dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    tiles, split = cdiv(hidden, config.down_block_n), config.down_split
    route = router_logits is not None
    if route:  # the down kernel adds its splits itself
        if tile_counters is None:
            tile_counters = new_tile_counters(hidden, [config], x.device)
        assert tile_counters.dtype == torch.int32 and tile_counters.numel() >= tiles, "tile_counters: too few"
    upcast, precision = _dot_config(x.dtype)
    shared = dict(BLOCK_T=MAX_TOKENS, BLOCK_TOPK=next_power_of_2(top_k), BLOCK_K=config.block_k, UPCAST=upcast,
                  PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages)
    logits = router_logits if route else topk_weights  # not read without ROUTE
    num_experts = logits.size(1) if route else 1
    _skinny_gate_up_kernel[(num_tokens * top_k, cdiv(inter_size, config.gate_up_block_n))](
        x, gate_up, intermediate, topk_ids, topk_weights, logits, num_tokens, top_k, num_experts, inter_size, hidden,
        x.stride(0), topk_ids.stride(0), topk_weights.stride(0), logits.stride(0), gate_up.stride(0),
        gate_up.stride(1), intermediate.stride(0), ROUTE=route, TOP_K=top_k, BLOCK_E=next_power_of_2(num_experts),
        RENORMALIZE=bool(renormalize), BLOCK_N=config.gate_up_block_n, **shared)
    partial = torch.empty((split, num_tokens, hidden), dtype=torch.float32, device=x.device) if split > 1 else out
    _skinny_down_kernel[(tiles, split)](
        # counters_ptr: unread without SUM_SPLITS, any tensor stands in
        intermediate, down, out, partial, tile_counters if route else topk_ids, topk_ids, topk_weights, num_tokens,
        top_k, hidden, inter_size, intermediate.stride(0), topk_ids.stride(0), topk_weights.stride(0),
        down.stride(0), down.stride(1), out.stride(0), SPLIT=split, SUM_SPLITS=route, BLOCK_N=config.down_block_n,
        **shared)
    if split > 1 and not route:
        reduce_splits(partial, out)
    return out
