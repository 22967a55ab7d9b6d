"""Top-k, top-p and min-p as one cutoff per row on the temperature-scaled logits.

A row keeps exactly the tokens whose z = logit / T is >= its cutoff (-inf keeps all). In order:
top-k keeps the k largest z (ties at the k-th all stay); top-p then keeps the smallest set of the
largest of those whose probability mass (softmax over the top-k-kept tokens) reaches top_p: a token
stays when the mass strictly above it is < top_p, so the first always stays; min-p keeps the tokens
with probability >= min_p * the largest, z >= max z + log(min_p). The cutoff is the largest of the
three, so one comparison per token applies all of them.

filter_cutoffs_reference is the plain-PyTorch statement (it sorts the rows that use top-k or top-p)
and the CPU path; on CUDA, filter_cutoffs runs kernels/sampling_filters.py, which sorts nothing.
"""
from __future__ import annotations

import torch

from asyncllm.layers.fused import kernel_module


def filter_cutoffs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor | None = None,
                   top_ps: torch.Tensor | None = None, min_ps: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) float32 cutoffs: the Triton kernels on CUDA tensors, else the reference."""
    kernels = kernel_module("sampling_filters") if logits.is_cuda else None
    if kernels is not None:
        return kernels.filter_cutoffs(logits, temperatures, top_ks, top_ps, min_ps)
    return filter_cutoffs_reference(logits, temperatures, top_ks, top_ps, min_ps)


def filter_cutoffs_reference(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor | None = None,
                             top_ps: torch.Tensor | None = None, min_ps: torch.Tensor | None = None) -> torch.Tensor:
    """logits (B, V); temperatures (B,) (rows with T <= 0 get -inf); top_ks (B,) integer (< 1 or >= V:
    no limit); top_ps (B,) (1.0: no limit); min_ps (B,) (0: none); None: no row uses that filter."""
    num_rows, vocab_size = logits.shape
    sampled = temperatures > 0
    z = logits.float() / torch.where(sampled, temperatures, 1.0).unsqueeze(1)
    cutoffs = torch.full((num_rows,), float("-inf"), device=logits.device)
    no_rows = torch.zeros_like(sampled)
    use_k = sampled & (top_ks > 0) & (top_ks < vocab_size) if top_ks is not None else no_rows
    # top_p == 1 is no limit: a float32 cumulative sum can reach 1.0 before the tail
    use_p = sampled & (top_ps < 1.0) if top_ps is not None else no_rows
    rows = (use_k | use_p).nonzero().squeeze(1)
    if len(rows):
        ordered = z[rows].sort(dim=-1, descending=True).values
        cut = torch.full((len(rows),), float("-inf"), device=logits.device)
        if top_ks is not None:
            kth = ordered.gather(1, (top_ks[rows].clamp(1, vocab_size) - 1).unsqueeze(1)).squeeze(1)
            cut = torch.where(use_k[rows], kth, cut)
        if top_ps is not None:
            kept = ordered >= cut.unsqueeze(1)
            probs = ordered.masked_fill(~kept, float("-inf")).softmax(dim=-1)
            mass_above = probs.cumsum(dim=-1) - probs  # at the first of equal values: the mass strictly above
            stays = kept & (mass_above < top_ps[rows].unsqueeze(1))
            stays[:, 0] = True  # also where nothing is finite (every mass NaN)
            cut = torch.where(use_p[rows], ordered.masked_fill(~stays, float("inf")).amin(dim=-1), cut)
        cutoffs[rows] = cut
    if min_ps is not None:
        use_min_p = sampled & (min_ps > 0)
        min_p_cut = z.amax(dim=-1) + min_ps.float().log()
        cutoffs = torch.where(use_min_p, torch.maximum(cutoffs, min_p_cut), cutoffs)
    return cutoffs


def apply_cutoffs(z: torch.Tensor, cutoffs: torch.Tensor) -> torch.Tensor:
    """z (B, V) with every token below its row's cutoff set to -inf."""
    return z.masked_fill(z < cutoffs.unsqueeze(1), float("-inf"))
