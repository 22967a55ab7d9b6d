"""Per-row cutoffs for top-k, top-p and min-p without sorting the vocabulary, used on CUDA.

filter_cutoffs gives each row one threshold on its temperature-scaled logits z = logit / T: the row
keeps exactly the tokens with z >= cutoff (-inf keeps all). The semantics, with
asyncllm.layers.sampling_filters.filter_cutoffs_reference as the plain-PyTorch statement:
top-k keeps the k largest z (ties at the k-th all stay); top-p then keeps, among those, each token
whose probability mass strictly above it (softmax over the top-k-kept tokens) is < top_p; min-p keeps
z >= max z + log(min_p). The cutoff is the largest of the three.

Division by T > 0, rounded, is monotone, so every selection runs on the raw logits x and only the
chosen value is divided (IEEE division, as PyTorch's): the kth-largest z is exactly
div_rn(kth-largest x, T). A consumer that compares div_rn(logit, T) >= cutoff keeps exactly the
reference's set; the only differences come from float32 rounding of masses (a token whose mass above
is within rounding of top_p) and of log(min_p) (a token within an ulp of the min-p threshold).

Two launches:
1. per (row, chunk of CHUNK tokens), the chunk held in registers: its max, its sum of exp(z - its
   max), and a cache of its largest tokens: every token >= a threshold tau_c that at most PER_CHUNK
   tokens pass (see _chunk_threshold).
2. per row: the union of the caches holds every token >= tau = max_c tau_c. When that is enough
   (>= k tokens for top-k, or mass >= top_p * total for top-p alone) the selections run on that small
   union; otherwise on the whole row (flat distributions, very large k). A selection finds the
   largest value v with weight(x >= v) >= target (count for top-k, mass for top-p) by bisection on
   the float's ordered bits, each probe snapping to the nearest data values, so it ends on a value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels.host import cdiv, next_power_of_2

CHUNK = 2048  # tokens per program of the first launch, held in registers
PER_CHUNK = 32  # cached candidates per chunk
_ROW_BLOCK = 8192  # tokens per step of a selection over a whole row
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _row_settings(row, n_cols, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
                  HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """A row's temperature and limits, and which filters it uses (top-k of V or more is no limit)."""
    t = tl.load(temps_ptr + row)
    k = tl.full([], 0, tl.int64)
    p = tl.full([], 1.0, tl.float32)
    min_p = tl.full([], 0.0, tl.float32)
    if HAS_K:
        k = tl.load(top_ks_ptr + row).to(tl.int64)
    if HAS_P:
        p = tl.load(top_ps_ptr + row)
    if HAS_MIN_P:
        min_p = tl.load(min_ps_ptr + row)
    sampled = t > 0
    use_k = sampled & (k > 0) & (k < n_cols)
    use_p = sampled & (p < 1.0)
    use_min_p = sampled & (min_p > 0.0)
    return t, k, p, min_p, use_k, use_p, use_min_p


@triton.jit
def _chunk_threshold(x, m, t, CHUNK: tl.constexpr, PER_CHUNK: tl.constexpr):
    """A threshold that at most PER_CHUNK of x pass (+inf when more than that tie at the max m).

    It aims at about PER_CHUNK / 2 on the maxima of groups of 16 (one per thread, so the search is
    cheap): the deepest point of a grid below m (0, 1, 2, 4, ..., 64 z units, then eighths of the
    chosen step) that at most PER_CHUNK / 2 group maxima pass. At least as many of x pass, usually
    about as many; one exact count checks it, and m alone is the fallback."""
    groups = tl.max(tl.reshape(x, [CHUNK // 16, 16], can_reorder=True), axis=1)
    level = tl.arange(0, 8).to(tl.float32)
    coarse = tl.where(level == 0, 0.0, tl.exp2(level - 1))
    passing = tl.sum((groups[:, None] >= (m - coarse * t)[None, :]).to(tl.int32), axis=0)
    i = tl.maximum(tl.sum((passing <= PER_CHUNK // 2).to(tl.int32)) - 1, 0)  # counts grow with depth
    shallow = tl.sum(tl.where(level == i, coarse, 0.0))
    deep = tl.sum(tl.where(level == tl.minimum(i + 1, 7), coarse, 0.0))
    thresholds = m - (shallow + (deep - shallow) * level * 0.125) * t
    passing = tl.sum((groups[:, None] >= thresholds[None, :]).to(tl.int32), axis=0)
    j = tl.maximum(tl.sum((passing <= PER_CHUNK // 2).to(tl.int32)) - 1, 0)
    tau = tl.max(tl.where(level == j, thresholds, float("-inf")))
    fits = tl.sum((x >= tau).to(tl.int32)) <= PER_CHUNK
    max_fits = tl.sum((x >= m).to(tl.int32)) <= PER_CHUNK
    return tl.where(fits, tau, tl.where(max_fits, m, float("inf")))


@triton.jit
def _chunk_kernel(logits_ptr, stride, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, part_ptr, cache_ptr,
                  n_rows, n_cols, n_chunks, HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                  CHUNK: tl.constexpr, PER_CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t, k, p, min_p, use_k, use_p, use_min_p = _row_settings(row, n_cols, temps_ptr, top_ks_ptr, top_ps_ptr,
                                                             min_ps_ptr, HAS_K, HAS_P, HAS_MIN_P)
    if use_k | use_p | use_min_p:
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row * stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m = tl.max(x)
        slot = row * n_chunks + chunk
        plane = n_rows * n_chunks  # part: [max, sum of exp, tau] planes of (rows, chunks)
        tl.store(part_ptr + slot, m)
        if use_k | use_p:
            finite = x > float("-inf")
            if use_p:
                e = tl.where(finite, tl.exp2((x - m) * (_LOG2E / t)), 0.0)
                tl.store(part_ptr + plane + slot, tl.sum(e))
            tau = _chunk_threshold(x, m, t, CHUNK, PER_CHUNK)
            tau = tl.where(m == float("-inf"), float("-inf"), tau)  # nothing finite: nothing to cache
            tl.store(part_ptr + 2 * plane + slot, tau)
            keep = finite & (x >= tau)
            at = tl.cumsum(keep.to(tl.int32), axis=0) - 1
            cached = cache_ptr + slot * PER_CHUNK
            tl.store(cached + at, x, mask=keep & (at < PER_CHUNK))
            free = tl.arange(0, PER_CHUNK)  # the slots after the last candidate: NaN is never data
            tl.store(cached + free, tl.full([PER_CHUNK], float("nan"), tl.float32), mask=free >= tl.sum(keep))


@triton.jit
def _weigh(src_ptr, n, floor, pivot, m, c, BLOCK: tl.constexpr):
    """Over the data {x in src[:n] : x >= floor}: (count and mass exp(z - z_max) of x >= pivot,
    smallest x >= pivot, largest x < pivot); +inf / -inf where there is none."""
    # elementwise accumulators, reduced once: no barrier inside a loop that streams a row
    count = tl.zeros([BLOCK], tl.float32)
    mass = tl.zeros([BLOCK], tl.float32)
    above_min = tl.full([BLOCK], float("inf"), tl.float32)
    below_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(src_ptr + offs, mask=offs < n, other=float("nan")).to(tl.float32)
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 are one value with two keys: keep one
        data = x >= floor  # false for NaN
        above = data & (x >= pivot)
        count += above.to(tl.float32)
        mass += tl.where(above, tl.exp2((x - m) * c), 0.0)
        above_min = tl.minimum(above_min, tl.where(above, x, float("inf")))
        below_max = tl.maximum(below_max, tl.where(data & (x < pivot), x, float("-inf")))
    # two reductions of pairs, not four: each one crosses the warps
    count, mass = tl.split(tl.sum(tl.join(count, mass), axis=0))
    neg_above_min, below_max = tl.split(tl.max(tl.join(-above_min, below_max), axis=0))
    return count, mass, -neg_above_min, below_max


@triton.jit
def _ordered(v):
    """float32 bits <-> int32 keys in the floats' order (an involution)."""
    bits = v.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _select(src_ptr, n, floor, lo, hi, target, m, c, BY_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest data value v with weight(x >= v) >= target, given that it is in [lo, hi]; lo when
    the data above lo weighs less. Bisects the ordered bits, snapping to data values: each probe at
    least halves the range of keys, so at most 32 probes, and far fewer on sparse data."""
    while lo < hi:
        mid = (_ordered(lo).to(tl.int64) + _ordered(hi).to(tl.int64) + 1) >> 1
        pivot = _ordered(mid.to(tl.int32)).to(tl.float32, bitcast=True)
        count, mass, above_min, below_max = _weigh(src_ptr, n, floor, pivot, m, c, BLOCK)
        enough = ((mass if BY_MASS else count) >= target) & (count > 0)
        lo = tl.where(enough, above_min, lo)
        hi = tl.where(enough, hi, below_max)
    return lo


@triton.jit
def _top_k_top_p(src_ptr, n, floor, hi, k, p, use_k, use_p, total, m, t, c, n_cols, BLOCK: tl.constexpr):
    """The logit cutoff of top-k then top-p over the data {x in src[:n] : x >= floor}, given that the
    first of them is at most hi (the second at most the max m)."""
    cut = floor
    if use_k:
        cut = _select(src_ptr, n, floor, floor, hi, k.to(tl.float32), m, c, False, BLOCK)
        hi = m
        if use_p:
            _, total, _, _ = _weigh(src_ptr, n, cut, cut, m, c, BLOCK)  # the mass that top-k keeps
    if use_p:
        # a lower bound: the n_cols tokens below it (each under it) weigh less than (1 - p) * total
        bound = m + (tl.log2((1.0 - p) * total / n_cols) - 0.01) / c
        cut = _select(src_ptr, n, cut, tl.maximum(cut, bound), hi, p * total, m, c, True, BLOCK)
    return cut


@triton.jit
def _cutoff_kernel(logits_ptr, stride, temps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, part_ptr, cache_ptr, out_ptr,
                   n_rows, n_cols, n_chunks, HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                   PER_CHUNK: tl.constexpr, CHUNKS: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                   ROW_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, k, p, min_p, use_k, use_p, use_min_p = _row_settings(row, n_cols, temps_ptr, top_ks_ptr, top_ps_ptr,
                                                             min_ps_ptr, HAS_K, HAS_P, HAS_MIN_P)
    cutoff = tl.full([], float("-inf"), tl.float32)
    whole_row = tl.full([], 0.0, tl.float32)  # 1: the cache did not hold the cutoff (a diagnostic)
    plane = n_rows * n_chunks
    if use_k | use_p | use_min_p:
        chunks = tl.arange(0, CHUNKS)
        in_row = chunks < n_chunks
        slots = row * n_chunks + chunks
        chunk_max = tl.load(part_ptr + slots, mask=in_row, other=float("-inf"))
        m = tl.max(chunk_max)
        if m > float("-inf"):
            if use_min_p:
                cutoff = tl.math.div_rn(m, t) + tl.log(min_p)
            if use_k | use_p:
                c = _LOG2E / t
                # the row's mass (written for top-p rows only, read for them only)
                chunk_sum = tl.load(part_ptr + plane + slots, mask=in_row, other=0.0)
                total = tl.sum(tl.where(in_row, chunk_sum * tl.exp2((chunk_max - m) * c), 0.0))
                tau = tl.max(tl.load(part_ptr + 2 * plane + slots, mask=in_row, other=float("-inf")))
                cached = cache_ptr + row * n_chunks * PER_CHUNK
                n_cached = n_chunks * PER_CHUNK
                count, mass, _, _ = _weigh(cached, n_cached, tau, tau, m, c, CACHE_BLOCK)
                # every token >= tau is cached: enough when the cutoff cannot be below tau
                if tl.where(use_k, count >= k.to(tl.float32), mass >= p * total):
                    cut = _top_k_top_p(cached, n_cached, tau, m, k, p, use_k, use_p, total, m, t, c, n_cols,
                                       CACHE_BLOCK)
                else:  # the first cutoff is below tau
                    whole_row = tl.full([], 1.0, tl.float32)
                    cut = _top_k_top_p(logits_ptr + row * stride, n_cols, tl.full([], float("-inf"), tl.float32),
                                       tl.minimum(tau, m), k, p, use_k, use_p, total, m, t, c, n_cols, ROW_BLOCK)
                cutoff = tl.maximum(cutoff, tl.math.div_rn(cut, t))
    tl.store(out_ptr + row, cutoff)
    tl.store(part_ptr + 3 * plane + row * n_chunks, whole_row)


def filter_workspace(num_rows: int, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The scratch filter_cutoffs needs (pass it in to keep one across steps, or CUDA-graph replays):
    per (row, chunk) planes of max, sum of exp, tau and (column 0) whether the row was searched whole;
    the cached candidates."""
    num_chunks = cdiv(vocab_size, CHUNK)
    return (torch.empty((4, num_rows, num_chunks), dtype=torch.float32, device=device),
            torch.empty((num_rows, num_chunks * PER_CHUNK), dtype=torch.float32, device=device))


def filter_cutoffs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor | None = None,
                   top_ps: torch.Tensor | None = None, min_ps: torch.Tensor | None = None, *,
                   out: torch.Tensor | None = None, workspace: tuple | None = None) -> torch.Tensor:
    """(B,) float32 cutoffs on the temperature-scaled logits (see the module's docstring).

    logits (B, V) float32 / bfloat16 / float16 with contiguous rows; temperatures (B,) float32 (rows
    with T <= 0 get -inf); top_ks (B,) integer (< 1 or >= V: no limit); top_ps (B,) float32 (1.0: no
    limit); min_ps (B,) float32 (0: none); None: no row uses that filter. Pass out and workspace
    (filter_workspace) to allocate nothing, e.g. under CUDA-graph capture."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits rows must be contiguous"
    num_rows, vocab_size = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    part, cache = workspace if workspace is not None else filter_workspace(num_rows, vocab_size, logits.device)
    num_chunks = cdiv(vocab_size, CHUNK)
    flags = dict(HAS_K=top_ks is not None, HAS_P=top_ps is not None, HAS_MIN_P=min_ps is not None,
                 PER_CHUNK=PER_CHUNK)
    limits = (temperatures, *(v if v is not None else temperatures for v in (top_ks, top_ps, min_ps)))
    _chunk_kernel[(num_rows, num_chunks)](logits, logits.stride(0), *limits, part, cache, num_rows, vocab_size,
                                          num_chunks, CHUNK=CHUNK, num_warps=8, **flags)
    _cutoff_kernel[(num_rows,)](logits, logits.stride(0), *limits, part, cache, out, num_rows, vocab_size,
                                num_chunks, CHUNKS=next_power_of_2(num_chunks),
                                CACHE_BLOCK=min(next_power_of_2(num_chunks * PER_CHUNK), _ROW_BLOCK),
                                ROW_BLOCK=_ROW_BLOCK, num_warps=16, **flags)
    return out


def searched_whole_rows(workspace: tuple) -> torch.Tensor:
    """(B,) bool: the rows of the last filter_cutoffs call on this workspace whose cutoff was not in
    the cached candidates (flat distributions, very large k), so their selections read the whole row."""
    return workspace[0][3, :, 0] == 1.0
