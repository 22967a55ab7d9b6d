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
