"""In-place kernels on a step's float32 logits, with the math of asyncllm.layers, used on CUDA.

- apply_penalties_: repetition, frequency and presence penalties of the rows that have them, each
  row reading its token counts from its TokenCounts slot (layers/logits_adjustments.py).
- apply_token_bitmask_: a grammar's allowed tokens, packed 32 to an int32 word, -inf elsewhere.

In PyTorch each is a dozen full passes over (rows, vocabulary) temporaries, gathered rows and
scattered results (some 3 GB a step at 256 rows of Qwen3's 151,936 tokens); here each reads its
inputs once and writes only what changes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels.host import cdiv

_BLOCK = 2048


@triton.jit
def _penalties_kernel(logits_ptr, stride_l, rows_ptr, slots_ptr, counts_ptr, stride_c, in_prompt_ptr, stride_p,
                      presence_ptr, frequency_ptr, repetition_ptr, n_cols, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    logits = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=0.0)
    counts = tl.load(counts_ptr + slot * stride_c + cols, mask=mask, other=0)
    in_prompt = tl.load(in_prompt_ptr + slot * stride_p + cols, mask=mask, other=0)
    repetition = tl.load(repetition_ptr + i)
    generated = counts > 0
    seen = generated | (in_prompt != 0)
    # IEEE division, as PyTorch's (Triton's `/` on fp32 is the approximate one)
    penalized = tl.where(logits > 0, tl.math.div_rn(logits, repetition), logits * repetition)
    logits = tl.where(seen, penalized, logits)
    logits = logits - tl.load(frequency_ptr + i) * counts.to(tl.float32)
    logits = logits - tl.load(presence_ptr + i) * generated.to(tl.float32)
    tl.store(logits_ptr + row * stride_l + cols, logits, mask=mask)


def apply_penalties_(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, output_counts: torch.Tensor,
                     in_prompt: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                     repetition: torch.Tensor) -> None:
    """logits (B, V) float32, in place: row rows[i] penalised with the counts of slot slots[i]
    (output_counts (S, V) int32, in_prompt (S, V) bool) and penalties presence/frequency/repetition[i]."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert output_counts.stride(1) == 1 and in_prompt.stride(1) == 1
    n_rows, n_cols = len(rows), logits.shape[1]
    if n_rows == 0:
        return
    in_prompt = in_prompt.view(torch.uint8)
    _penalties_kernel[(n_rows, cdiv(n_cols, _BLOCK))](
        logits, logits.stride(0), rows, slots, output_counts, output_counts.stride(0), in_prompt, in_prompt.stride(0),
        presence, frequency, repetition, n_cols, BLOCK=_BLOCK, num_warps=8)


@triton.jit
def _token_bitmask_kernel(logits_ptr, stride_l, rows_ptr, bitmask_ptr, stride_b, n_cols,
                          ALL_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    if ALL_ROWS:
        row = i.to(tl.int64)
    else:
        row = tl.load(rows_ptr + i).to(tl.int64)
    words = tl.load(bitmask_ptr + i.to(tl.int64) * stride_b + cols // 32, mask=mask, other=-1)
    forbidden = ((words >> (cols % 32)) & 1) == 0
    # only forbidden tokens are written: the logits are not read at all
    tl.store(logits_ptr + row * stride_l + cols, tl.full([BLOCK], float("-inf"), tl.float32), mask=mask & forbidden)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> None:
    """logits (B, V) float32, in place: in row rows[i] (row i when rows is None) each token whose
    bit is 0 in bitmask[i] ((M, ceil(V / 32)) int32; bit j of word w is token 32 * w + j) is -inf."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bitmask.dtype == torch.int32
    bitmask = bitmask.contiguous()
    n_rows, n_cols = len(bitmask), logits.shape[1]
    assert bitmask.shape[1] * 32 >= n_cols, "the bitmask must cover every column of the logits"
    if n_rows == 0:
        return
    _token_bitmask_kernel[(n_rows, cdiv(n_cols, _BLOCK))](
        logits, logits.stride(0), bitmask if rows is None else rows, bitmask, bitmask.stride(0), n_cols,
        ALL_ROWS=rows is None, BLOCK=_BLOCK, num_warps=8)


# ---- log-probabilities in one read of the logits (not wired in yet: see chunked_logprobs) ----

_LOGPROB_BLOCK = 4096


@triton.jit
def _logprob_partials_kernel(logits_ptr, stride_l, token_ids_ptr, part_max_ptr, part_sum_ptr, part_greater_ptr,
                             top_values_ptr, top_ids_ptr, n_cols, num_chunks, num_top,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf"))
    chosen = tl.load(logits_ptr + row * stride_l + tl.load(token_ids_ptr + row))
    part = row * num_chunks + chunk
    chunk_max = tl.max(x, 0)
    tl.store(part_max_ptr + part, chunk_max)
    tl.store(part_sum_ptr + part, tl.sum(tl.exp(x - chunk_max), 0))
    tl.store(part_greater_ptr + part, tl.sum((x > chosen).to(tl.int32), 0))
    # the chunk's num_top best, one max-reduction each (num_top <= 20)
    for i in range(num_top):
        best = tl.max(x, 0)
        at = tl.min(tl.where(mask & (x == best), cols, n_cols), 0)
        tl.store(top_values_ptr + part * num_top + i, best)
        tl.store(top_ids_ptr + part * num_top + i, tl.minimum(at, n_cols - 1).to(tl.int64))
        x = tl.where(cols == at, float("-inf"), x)


def chunked_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    """(chosen log-probs, ranks, top ids, top log-probs) of float32 logits (L, V) as
    layers.sampler.gather_logprobs gives them, reading the logits once: each chunk of a row gives
    its max, sum of exponentials, count above the chosen token and its num_top best, then a few
    small PyTorch ops combine the chunks. Not used by the sampler until it has measured faster on
    a GPU than log_softmax + torch.topk (docs/BENCHMARKS.md, run H)."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and 0 <= num_top
    num_rows, n_cols = logits.shape
    num_chunks = cdiv(n_cols, _LOGPROB_BLOCK)
    device = logits.device
    part_max = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_greater = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=device)
    top_values = torch.empty((num_rows, num_chunks * num_top), dtype=torch.float32, device=device)
    top_ids = torch.empty((num_rows, num_chunks * num_top), dtype=torch.int64, device=device)
    if num_rows:
        _logprob_partials_kernel[(num_rows, num_chunks)](
            logits, logits.stride(0), token_ids, part_max, part_sum, part_greater, top_values, top_ids,
            n_cols, num_chunks, num_top, BLOCK=_LOGPROB_BLOCK, num_warps=8)
    row_max = part_max.amax(dim=1, keepdim=True)
    log_total = row_max + (part_sum * (part_max - row_max).exp()).sum(dim=1, keepdim=True).log()
    chosen = logits.gather(1, token_ids.unsqueeze(1)) - log_total
    ranks = part_greater.sum(dim=1, dtype=torch.int64) + 1
    best_values, best = top_values.topk(num_top, dim=-1)
    return chosen.squeeze(1), ranks, top_ids.gather(1, best), best_values - log_total
