"""The mixture-of-experts block that replaces the MLP in Qwen3-MoE and Mixtral layers.

A router picks top_k of num_experts SiLU-gated MLPs for each token and weights their outputs by
its softmax probabilities (renormalised over the chosen k where the model says so). The experts'
weights are stacked, gate_up (E, 2*I, H) and down (E, H, I), the layout a grouped-GEMM kernel
reads. Under tensor parallelism each rank keeps every expert's slice of the intermediate dimension
(as the dense MLP is split), so tokens never move between ranks: one all-reduce of the weighted sum.

The router's softmax and top-k are route() in PyTorch on CPU and kernels/moe_router.py's one kernel
on CUDA (the same result in one launch instead of four to six a layer). forward_native is the
experts' CPU path and their reference: tokens sorted by expert id, then one pair of matmuls per
expert that has tokens (it reads the counts on the host). On CUDA the experts run as
kernels/fused_moe.py's two grouped GEMMs, or at up to skinny_moe.MAX_TOKENS tokens (decode) as
kernels/skinny_moe.py's, which stream each selected expert once with no sort. With
ASYNCLLM_MOE_ROUTED_DECODE=1 those route inside the first of their two kernels and sum the split-K
parts in the second: the router's GEMM (layers/skinny_linear.py) and those two are the block's three
launches at decode, against five (a routing kernel and a split-K reduce besides); off until checked and
timed on a GPU. Neither path waits on the host (CUDA graphs capture them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm import settings
from asyncllm.distributed import all_reduce, get_tp_rank, get_tp_size
from asyncllm.layers.fused import fused_moe_for, moe_router_for, skinny_moe_for
from asyncllm.layers.linear import LinearBase, check_loaded_shape
from asyncllm.layers.skinny_linear import num_sms

GATE, UP = 0, 1  # the halves of gate_up_proj's rows; down_proj's one part is 0


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) float32, expert ids (T, k) int64): softmax over all experts in float32, the k
    most probable, optionally renormalised to sum to 1 (as Hugging Face's Qwen3-MoE and Mixtral do)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class StackedExperts(nn.Module):
    """Every expert's gate/up and down projections as two stacked parameters, this rank's slice of
    the intermediate dimension. Loaded one checkpoint tensor at a time: shard (expert, GATE or UP)
    of gate_up_proj, (expert, 0) of down_proj; or the stacked tensor whole (no shard id)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        shard = intermediate_size // self.tp_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * shard, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, shard), requires_grad=False)
        for param, parts in ((self.gate_up_proj, (GATE, UP)), (self.down_proj, (0,))):
            param.weight_loader = self.weight_loader
            # what load_weights checks off: a stacked parameter is whole only with every expert's every part
            param.required_shards = frozenset((e, p) for e in range(num_experts) for p in parts)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None):
        down = param is self.down_proj
        shard = param.size(2) if down else param.size(1) // 2
        if shard_id is None:  # the whole stack, as transformers 5 names it in memory
            full = (self.num_experts, self.hidden_size, self.intermediate_size) if down else \
                (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
            check_loaded_shape(loaded, full)
            if down:
                param.data.copy_(loaded.narrow(2, self.tp_rank * shard, shard))
            else:
                for part in (GATE, UP):
                    rows = loaded.narrow(1, part * self.intermediate_size + self.tp_rank * shard, shard)
                    param.data.narrow(1, part * shard, shard).copy_(rows)
            return
        expert, part = shard_id  # load_weights has checked it is one of required_shards
        if down:
            check_loaded_shape(loaded, (self.hidden_size, self.intermediate_size))
            param.data[expert].copy_(loaded.narrow(1, self.tp_rank * shard, shard))
        else:
            check_loaded_shape(loaded, (self.intermediate_size, self.hidden_size))
            param.data[expert].narrow(0, part * shard, shard).copy_(loaded.narrow(0, self.tp_rank * shard, shard))


class SparseMoeBlock(nn.Module):
    """router (`gate`, replicated on every rank) -> top-k experts -> their weighted sum."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = LinearBase(hidden_size, num_experts, bias=False, tp_dim=None)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)
        # chosen once, by where the weights live (the runner builds the model on its device)
        self._router = moe_router_for(self.gate.weight, num_experts)
        self._fused = fused_moe_for(self.experts.down_proj)
        self._skinny = skinny_moe_for(self.experts.down_proj)
        # the small path's tiling per token count, chosen once (its rule needs only the shapes)
        self._skinny_configs = []
        self._tile_counters = None  # set where the decode path routes inside the experts' first kernel
        if self._skinny is not None:
            device, shard = self.experts.down_proj.device, self.experts.down_proj.size(2)
            self._skinny_configs = [self._skinny.choose_config(t, top_k, num_experts, hidden_size, shard,
                                                               num_sms(device))
                                    for t in range(self._skinny.MAX_TOKENS + 1)]
            if self._router is not None and settings.MOE_ROUTED_DECODE.read():  # it routes as the router kernel
                # this block's own (two streams' blocks never share one); made here, so no step zeroes them
                self._tile_counters = self._skinny.new_tile_counters(hidden_size, self._skinny_configs, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        experts = self.experts
        decode = x.size(0) < len(self._skinny_configs)
        if decode and self._tile_counters is not None:  # routed inside the experts' first kernel
            return all_reduce(self._skinny.skinny_moe_routed(
                x, logits, self.top_k, self.renormalize, experts.gate_up_proj, experts.down_proj,
                self._skinny_configs[x.size(0)], self._tile_counters))
        if self._router is not None:
            weights, ids = self._router.route_topk(logits, self.top_k, self.renormalize)
        else:
            weights, ids = route(logits, self.top_k, self.renormalize)
        if decode:
            out = self._skinny.skinny_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids,
                                          self._skinny_configs[x.size(0)])
        elif self._fused is not None:
            out = self._fused.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
        else:
            out = self.forward_native(x, weights, ids)
        return all_reduce(out)

    def forward_native(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]), on this rank's intermediate slice."""
        top_k = ids.size(1)
        # every (token, choice) pair, grouped by expert: a stable sort keeps token order within an expert
        order = ids.flatten().argsort(stable=True)
        token_of = order // top_k
        pair_weights = weights.flatten()[order].to(x.dtype).unsqueeze(1)
        counts = torch.bincount(ids.flatten(), minlength=self.experts.num_experts).tolist()
        sorted_x = x.index_select(0, token_of)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate, up = F.linear(sorted_x[rows], self.experts.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.down_proj[expert])
            out.index_add_(0, token_of[rows], y * pair_weights[rows])
            start += count
        return out
