"""Kernels on a step's logits, with the math of asyncllm.layers, used on CUDA.

- sample: the exponential race (layers/sampler.py) in one read of the logits, its noise drawn
  in the kernel from a Philox stream keyed per row.
- chunked_logprobs: log-probabilities, ranks and top alternatives in one read of the model's logits.
- penalize: repetition, frequency and presence penalties of the rows that have them, each row
  reading its token counts from its TokenCounts slot (layers/logits_adjustments.py); it reads the
  model's logits in their own dtype and writes the sampler's float32 copy, or works in place.
- apply_token_bitmask_: a grammar's allowed tokens, packed 32 to an int32 word, -inf elsewhere.

In PyTorch each is several to a dozen full passes over (rows, vocabulary) temporaries, gathered rows and
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
def _penalties_kernel(logits_ptr, stride_l, out_ptr, stride_o, rows_ptr, slots_ptr, counts_ptr, stride_c,
                      in_prompt_ptr, stride_p, presence_ptr, frequency_ptr, repetition_ptr, n_cols,
                      BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    # float32 of bf16/fp16 is exact: the same values as penalising the float32 copy
    logits = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
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
    tl.store(out_ptr + row * stride_o + cols, logits, mask=mask)


def penalize(logits: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
             output_counts: torch.Tensor, in_prompt: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
             repetition: torch.Tensor) -> None:
    """out[rows[i]] = logits[rows[i]] penalised with the counts of slot slots[i] (output_counts (S, V)
    int32, in_prompt (S, V) bool) and penalties presence/frequency/repetition[i]. logits (B, V) float32,
    bfloat16 or float16; out (B, V) float32, logits itself to work in place; other rows of out untouched."""
    assert out.dtype == torch.float32 and out.shape == logits.shape and out.stride(1) == 1 and logits.stride(1) == 1
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert output_counts.stride(1) == 1 and in_prompt.stride(1) == 1
    n_rows, n_cols = len(rows), logits.shape[1]
    if n_rows == 0:
        return
    in_prompt = in_prompt.view(torch.uint8)
    _penalties_kernel[(n_rows, cdiv(n_cols, _BLOCK))](
        logits, logits.stride(0), out, out.stride(0), rows, slots, output_counts, output_counts.stride(0), in_prompt,
        in_prompt.stride(0), presence, frequency, repetition, n_cols, BLOCK=_BLOCK, num_warps=8)


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


# ---- log-probabilities in one read of the logits ----

_LOGPROB_BLOCK = 4096


@triton.jit
def _logprob_partials_kernel(logits_ptr, stride_l, token_ids_ptr, part_max_ptr, part_sum_ptr, part_greater_ptr,
                             top_values_ptr, top_ids_ptr, n_cols, num_chunks, num_top,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    # the model's logits in their own dtype, in float32 from here on (exact for bf16/fp16)
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
    chosen = tl.load(logits_ptr + row * stride_l + tl.load(token_ids_ptr + row)).to(tl.float32)
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
    """(chosen log-probs, ranks, top ids, top log-probs) of logits (L, V) (float32, bfloat16 or
    float16, rows of stride(0) apart) as layers.sampler.gather_logprobs gives them, reading the
    logits once: each chunk of a row gives its max, sum of exponentials, count above the chosen
    token and its num_top best, then a few small PyTorch ops combine the chunks. All in float32:
    bf16 logits give what their float32 copy would."""
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1
    assert 0 <= num_top
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
    chosen = logits.gather(1, token_ids.unsqueeze(1)).float() - log_total
    ranks = part_greater.sum(dim=1, dtype=torch.int64) + 1
    best_values, best = top_values.topk(num_top, dim=-1)
    return chosen.squeeze(1), ranks, top_ids.gather(1, best), best_values - log_total


# ---- sampling in one read of the logits: the exponential race with Philox noise ----

_SAMPLE_QUARTER = 1024  # one Philox call gives 4 draws: a chunk is 4 quarters of this many tokens


@triton.jit
def _chunk_uniforms(key, chunk, QUARTER: tl.constexpr):
    """The uniform draws of chunk `chunk` of a row with Philox key `key`: four blocks, block q for
    tokens chunk * 4 * QUARTER + q * QUARTER + [0, QUARTER). One pure function of (key, token)."""
    return tl.rand4x(key, chunk * QUARTER + tl.arange(0, QUARTER))


@triton.jit
def _quarter_best(logits_ptr, row_offset, start, n_cols, u, temperature, sampled, cutoff,
                  HAS_CUTOFFS: tl.constexpr, QUARTER: tl.constexpr):
    cols = start + tl.arange(0, QUARTER)
    mask = cols < n_cols
    x = tl.load(logits_ptr + row_offset + cols, mask=mask, other=float("-inf")).to(tl.float32)
    scale = tl.where(sampled, temperature, 1.0)
    if HAS_CUTOFFS:  # z rounded as PyTorch's x / T, which the cutoffs are values of (sampling_filters)
        z = tl.math.div_rn(x, scale)
    else:
        z = x * (1.0 / scale)
    # argmax(z - log(-log u)) = argmax(p / E), E = -log u ~ Exp(1): a draw from softmax(z)
    race = z - tl.log(-tl.log(u))
    if HAS_CUTOFFS:
        race = tl.where(z >= cutoff, race, float("-inf"))
    score = tl.where(mask, tl.where(sampled, race, x), float("-inf"))
    best = tl.max(score, 0)
    return best, tl.min(tl.where(score == best, cols, n_cols), 0)


@triton.jit
def _sample_chunks_kernel(logits_ptr, stride_l, temperatures_ptr, keys_ptr, cutoffs_ptr, part_score_ptr,
                          part_id_ptr, n_cols, num_chunks, HAS_CUTOFFS: tl.constexpr, QUARTER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(temperatures_ptr + row)
    sampled = t > 0
    cutoff = float("-inf")
    if HAS_CUTOFFS:
        cutoff = tl.load(cutoffs_ptr + row)
    u0, u1, u2, u3 = _chunk_uniforms(tl.load(keys_ptr + row), chunk, QUARTER)
    start = chunk * 4 * QUARTER
    ro = row * stride_l
    best, at = _quarter_best(logits_ptr, ro, start, n_cols, u0, t, sampled, cutoff, HAS_CUTOFFS, QUARTER)
    b1, a1 = _quarter_best(logits_ptr, ro, start + QUARTER, n_cols, u1, t, sampled, cutoff, HAS_CUTOFFS, QUARTER)
    b2, a2 = _quarter_best(logits_ptr, ro, start + 2 * QUARTER, n_cols, u2, t, sampled, cutoff, HAS_CUTOFFS,
                           QUARTER)
    b3, a3 = _quarter_best(logits_ptr, ro, start + 3 * QUARTER, n_cols, u3, t, sampled, cutoff, HAS_CUTOFFS,
                           QUARTER)
    # strictly greater: on a tie the lower token wins, as torch.argmax's first maximum
    at = tl.where(b1 > best, a1, at)
    best = tl.maximum(best, b1)
    at = tl.where(b2 > best, a2, at)
    best = tl.maximum(best, b2)
    at = tl.where(b3 > best, a3, at)
    best = tl.maximum(best, b3)
    part = row * num_chunks + chunk
    tl.store(part_score_ptr + part, best)
    tl.store(part_id_ptr + part, at)


@triton.jit
def _sample_pick_kernel(part_score_ptr, part_id_ptr, token_ids_ptr, num_chunks, n_cols, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    mask = chunks < num_chunks
    scores = tl.load(part_score_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    ids = tl.load(part_id_ptr + row * num_chunks + chunks, mask=mask, other=n_cols)
    best = tl.max(scores, 0)
    # chunks hold ascending tokens, so the lowest id among the best is the first maximum; a row of
    # -inf only (every token forbidden) gives token 0, as torch.argmax would
    token = tl.min(tl.where(mask & (scores == best), ids, n_cols), 0)
    tl.store(token_ids_ptr + row, tl.where(token < n_cols, token, 0).to(tl.int64))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
           cutoffs: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) int64 token ids from logits (B, V) (float32 or bf16): row i draws from softmax(logits[i] /
    temperatures[i]) with the Philox stream of keys[i] (int64), or takes the argmax where temperatures[i]
    is 0. cutoffs (B,) float32, from top-k / top-p / min-p (kernels/sampling_filters.py): a sampled row
    draws only among the tokens whose logit / T (rounded as PyTorch's division) is >= its cutoff. The
    logits are read once: each chunk of a row races its tokens' scaled logits against Gumbel noise,
    then one small kernel picks each row's winner. The same (key, logits) always give the same token,
    whatever else is in the batch."""
    assert logits.stride(1) == 1 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    num_rows, n_cols = logits.shape
    chunk_cols = 4 * _SAMPLE_QUARTER
    num_chunks = cdiv(n_cols, chunk_cols)
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return token_ids
    part_score = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    part_id = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    _sample_chunks_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperatures, keys, temperatures if cutoffs is None else cutoffs, part_score,
        part_id, n_cols, num_chunks, HAS_CUTOFFS=cutoffs is not None, QUARTER=_SAMPLE_QUARTER, num_warps=4)
    _sample_pick_kernel[(num_rows,)](part_score, part_id, token_ids, num_chunks, n_cols,
                                     CHUNKS=triton.next_power_of_2(num_chunks), num_warps=1)
    return token_ids


@triton.jit
def _uniforms_kernel(keys_ptr, out_ptr, stride_o, n_cols, QUARTER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    u0, u1, u2, u3 = _chunk_uniforms(tl.load(keys_ptr + row), chunk, QUARTER)
    start = chunk * 4 * QUARTER + tl.arange(0, QUARTER)
    base = out_ptr + row * stride_o
    tl.store(base + start, u0, mask=start < n_cols)
    tl.store(base + start + QUARTER, u1, mask=start + QUARTER < n_cols)
    tl.store(base + start + 2 * QUARTER, u2, mask=start + 2 * QUARTER < n_cols)
    tl.store(base + start + 3 * QUARTER, u3, mask=start + 3 * QUARTER < n_cols)


def sample_uniforms(keys: torch.Tensor, n_cols: int) -> torch.Tensor:
    """(B, n_cols) float32: the uniform draws `sample` races with for each row's key, for checking it
    against PyTorch."""
    out = torch.empty((len(keys), n_cols), dtype=torch.float32, device=keys.device)
    if len(keys):
        _uniforms_kernel[(len(keys), cdiv(n_cols, 4 * _SAMPLE_QUARTER))](keys, out, out.stride(0), n_cols,
                                                                           QUARTER=_SAMPLE_QUARTER)
    return out
