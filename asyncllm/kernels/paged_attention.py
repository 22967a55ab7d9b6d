"""Causal attention over a paged KV cache: one varlen kernel for prefill / mixed steps (split-KV for
short chunks over long contexts), and a split-KV (flash-decoding) kernel pair for decode-only steps.

Layout: k_cache / v_cache are (num_blocks, block_size, num_kv_heads, head_dim); sequence b's KV
position p lives in block block_tables[b, p // block_size] at offset p % block_size. KV is walked
in BLOCK_N-token tiles: when block_size >= BLOCK_N a tile sits inside one cache block (one table
lookup, contiguous rows); otherwise each row looks up its own block.

GQA: a program owns one KV head and all G = H // Hkv query heads that read it. Those heads are
folded into the M dimension of the tl.dot (row r = token r // G, head r % G), so every K/V tile is
loaded once for all G heads, and a single decode token still gives the MMA G rows (padded to 16).

Mixed steps: the sequences of one query row (decodes) go to the decode kernel, whose tile is G
rows padded to 16, and only the rest to the varlen kernel, whose tile for a long prompt is 128 rows
of which a decode would fill G, so a decode there pays for a tile it mostly leaves empty. Each
kernel skips the other's sequences by their query length, so a CUDA graph needs no count of decodes.

Prefill / mixed: programs tile each sequence's query rows into BLOCK_Q = BLOCK_M // G tokens. The
grid is an upper bound on the number of tiles computed from host ints (T // BLOCK_Q + num_seqs)
and each program finds its sequence by binary search over query_start_loc, so no host sync is
needed. KV tiles wholly below the tile's first query position skip the causal mask; tiles past
its last query position are never visited. A short chunk over a long context (a chat turn of 64
tokens over 32k cached ones) is a few tiles, each a program streaming the whole context; such a
step splits each tile's KV over a third grid axis (choose_prefill_splits), each split a
BLOCK_N-aligned share of the tile's KV sized in-kernel from its runtime length (at least
split_tokens, so a tile over a short context is not split and writes its output directly), and
_merge_splits_kernel, the decode merge with per-token rows, combines the partials.

Decode: one query token per sequence gives only num_seqs * Hkv programs, far too few to fill an
H200's 132 SMs at small batch, and each would stream the whole context serially. Split-KV cuts
each sequence's KV into num_splits chunks processed by separate programs, which write a partial
output and log-sum-exp; a small second kernel merges them. The chunk length is derived in-kernel
from the runtime seq_len, so a fixed num_splits (a fixed grid, as CUDA graphs need) works for any
lengths: splits past the end of a short sequence write an empty partial (lse = -inf). Its metadata,
and on small grids its split's first KV tile, it reads before waiting for the kernel before
(kernels/pdl.py); the current position's K/V row, which that kernel stores, after. Given the fused
projection and a DecodeRope on a small grid, the kernel is that kernel too: it reads the rotary's
cos / sin, norm weights and slot before the wait, then normalises and rotates its q heads and its
KV head's k (fused_ops.head_norm_rope), attends the cache below the current position and the new
K/V row from registers, and the split holding that position stores the row (one kernel fewer a
layer in a batch-1 step).

Softmax runs online in fp32 with exp2 (log2(e) folded into the scale). Rows that see no KV at
all (seq_len == 0 padding rows) produce zeros rather than NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels.fused_ops import _dot, _dot_config, head_norm_rope, qk_norm_rope_
from asyncllm.kernels.host import cdiv, next_power_of_2
from asyncllm.kernels.kv_store import is_fp8_cache, quantize_for_cache
from asyncllm.kernels.pdl import launch_dependents, launch_options, wait_for_previous

LOG2E = 1.4426950408889634
DEFAULT_NUM_SMS = 132  # H200 / H100 SXM
MAX_SPLITS = 64
# below this a split's fixed cost (loading q, writing a partial) dominates; bench_kernels.py
# --splits-sweep finds batch 1's best count at about context / 32 up to 2k tokens
MIN_SPLIT_TOKENS = 32
PROGRAMS_PER_SM = 4  # decode programs are small and memory-bound: several resident per SM hide latency
# The decode kernel loads its first K/V tile before the PDL wait only where its grid has at most this
# many programs per SM: holding the tile across the wait takes ~160 registers a thread for 96 (sm_90,
# ptxas), three resident programs per SM for five, which a grid this small never needs. Batch 1 over
# short contexts, where the load chain is the kernel's time, is such a grid.
FIRST_TILE_EARLY_PROGRAMS_PER_SM = 2
# Prefill split-KV (choose_prefill_splits): the least KV one split of a prefill tile takes (its fixed cost
# is a q tile's load and a partial's write and merge), the most splits, the working programs per SM aimed
# at (a prefill program is 4-8 warps with ~100 KB of shared memory: one or two fit an SM), and the most
# programs per SM the whole grid may have, counting those that find no tile and return
PREFILL_SPLIT_TOKENS = 1024
MAX_PREFILL_SPLITS = 32
PREFILL_PROGRAMS_PER_SM = 2
PREFILL_MAX_GRID_PER_SM = 32


# ----------------------------------------------------------------------------- device helpers

@triton.jit
def _kv_tile_offsets(bt_row_ptr, start, offs_n, max_blocks, stride_kb, stride_ks,
                     BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets of KV positions start + offs_n within one KV head's cache. Table columns
    are clamped to the table's width: positions past a sequence's end (masked by the caller) and
    metadata whose seq_len outruns its block table must not read outside the table."""
    if BLOCK_SIZE >= BLOCK_N:
        # start is a multiple of BLOCK_N, so the whole tile lies in one cache block
        block = tl.load(bt_row_ptr + tl.minimum(start // BLOCK_SIZE, max_blocks - 1)).to(tl.int64)
        return block * stride_kb + (start % BLOCK_SIZE + offs_n) * stride_ks
    else:
        pos = start + offs_n
        block = tl.load(bt_row_ptr + tl.minimum(pos // BLOCK_SIZE, max_blocks - 1)).to(tl.int64)
        return block * stride_kb + (pos % BLOCK_SIZE) * stride_ks


@triton.jit
def _attend(acc, l_i, m_i, q, q_pos, k_base, v_base, bt_row_ptr, max_blocks, lo, hi, kv_limit,
            qk_scale, stride_kb, stride_ks,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
            UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Online-softmax accumulation over KV tiles [lo, hi) (lo a multiple of BLOCK_N).

    Unmasked tiles must lie entirely below kv_limit and, if CAUSAL, at or below every query
    row's position q_pos. Masked tiles drop positions >= kv_limit (and > q_pos if CAUSAL); their
    loads are masked too, since cache slots past a sequence's end may hold garbage (even NaN).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        kv_off = _kv_tile_offsets(bt_row_ptr, start, offs_n, max_blocks, stride_kb, stride_ks,
                                  BLOCK_SIZE, BLOCK_N)
        k_ptrs = k_base + kv_off[:, None] + offs_d[None, :]
        v_ptrs = v_base + kv_off[:, None] + offs_d[None, :]
        pos = start + offs_n
        if MASKED:
            kv_mask = pos < kv_limit
            ld_mask = kv_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptrs, mask=ld_mask, other=0.0)
            v = tl.load(v_ptrs, mask=ld_mask, other=0.0)
        elif HEAD_DIM == BLOCK_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)

        keep = None
        if MASKED:
            if CAUSAL:
                keep = kv_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            else:
                keep = kv_mask[None, :]
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, keep, qk_scale, MASKED, UPCAST_DOT, PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k, v, keep, qk_scale,
                 MASKED: tl.constexpr, UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """The online-softmax update for one loaded K/V tile; where MASKED, positions outside keep
    (broadcast against (M, BLOCK_N)) count for nothing. An FP8 tile is widened to q's dtype here
    (exact: e4m3 fits bf16 / fp16); its scales are the caller's (k_scale in qk_scale, v_scale on
    the output)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = _dot(q, tl.trans(k), UPCAST_DOT, PRECISION) * qk_scale  # (M, BLOCK_N), log2 domain
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = m_new
    if MASKED:
        # a row that has seen only masked positions keeps m = -inf; subtract 0 instead so
        # exp2 yields 0 rather than NaN (-inf - -inf)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST_DOT, PRECISION)
    return acc, l_i, m_new


@triton.jit
def _find_seq(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query tile tile_idx. Sequence b's tiles start at
    query_start_loc[b] // BLOCK_Q + b, which is strictly increasing in b and leaves each sequence
    at least cdiv(q_len, BLOCK_Q) tiles; binary search for the last start <= tile_idx."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# ----------------------------------------------------------------------------- prefill / mixed

# Triton specializes integer arguments on "== 1" and "divisible by 16", compiling a variant for
# each combination it meets. The batch size and block-table width change from step to step, so
# left specialized they would make eager steps compile new variants (about a second each) in the
# middle of serving; they gain nothing from it, being only loop bounds and
# row offsets.
@triton.jit
def _prefill_split_count(kv_hi, num_splits, split_tokens):
    """KV splits a prefill tile attending [0, kv_hi) takes: num_splits, fewer where its KV would give
    a split less than split_tokens, one (no partial, direct write) where the KV is short. The prefill
    kernel and the merge both ask it, so they agree on which tiles were split and into how many."""
    return tl.maximum(1, tl.minimum(num_splits, kv_hi // split_tokens))


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "max_blocks", "num_splits", "split_tokens"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, v_scale, num_seqs, num_splits, split_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt, max_blocks,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SKIP_SINGLE: tl.constexpr, UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)  # kernels/pdl.py: before any read of an earlier kernel's output
    # reversed so the last (typically longest, causally heaviest) tiles are scheduled first
    tile_idx = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile = tile_idx - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= q_len:
        return
    if SKIP_SINGLE and q_len == 1:
        return  # the decode kernel's, launched beside this one
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # KV this tile needs: [0, kv_hi). Below full_hi every row sees every position.
    first_pos = context_len + tile * BLOCK_Q
    kv_hi = context_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q)
    full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N
    split = 0
    splits_here = 1
    if SPLIT:
        split = tl.program_id(2)
        splits_here = _prefill_split_count(kv_hi, num_splits, split_tokens)
    if split >= splits_here:
        return  # neither written nor merged: _merge_splits_kernel asks the same count
    lo = 0
    hi = kv_hi
    if SPLIT:
        # split-KV (short queries over long contexts): this program attends [lo, hi), a BLOCK_N-aligned
        # share of [0, kv_hi) sized from the runtime lengths, so a fixed num_splits (a CUDA graph's)
        # suits any context; the causal diagonal falls in the last splits, a split past kv_hi is empty
        split_len = tl.cdiv(tl.cdiv(kv_hi, splits_here), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.maximum(tl.minimum(lo + split_len, kv_hi), lo)
        full_hi = tl.maximum(lo, tl.minimum(full_hi, hi))

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_tok = offs_m // G  # rows are (token, head) pairs: G heads of one token are adjacent
    q_idx = tile * BLOCK_Q + row_tok
    head = kv_head * G + offs_m % G
    row_mask = (row_tok < BLOCK_Q) & (q_idx < q_len)
    io_mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    q_pos = context_len + q_idx

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_kh
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, k_base, v_base, bt_row, max_blocks,
                            lo, full_hi, hi, qk_scale, stride_kb, stride_ks,
                            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, True, UPCAST_DOT, PRECISION)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, k_base, v_base, bt_row, max_blocks,
                            full_hi, hi, hi, qk_scale, stride_kb, stride_ks,
                            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, True, UPCAST_DOT, PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
    if splits_here == 1:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # a row that saw nothing here (every position of the split past it, or an empty split) gets
        # lse = -inf, which the merge weighs at zero
        part = part_out_ptr + token[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
        tl.store(part + offs_d[None, :], out, mask=io_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_mask)


# ----------------------------------------------------------------------------- decode (split-KV)

@triton.jit
def _rope_inputs(positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, token, stride_cs,
                 HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """What the q/k norm + rotary of one token reads besides its row, as (1, HALF) halves: cos, sin
    of its position and the q and k norm weights (cos in their place where not HAS_NORM)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF)[None, :]
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs)
    if HAS_NORM:
        qw1 = tl.load(q_norm_ptr + offs)
        qw2 = tl.load(q_norm_ptr + HALF + offs)
        kw1 = tl.load(k_norm_ptr + offs)
        kw2 = tl.load(k_norm_ptr + HALF + offs)
    else:
        qw1 = cos
        qw2 = cos
        kw1 = cos
        kw2 = cos
    return cos, sin, qw1, qw2, kw1, kw2


@triton.jit
def _join_halves(x1, x2, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(ROWS, HALF) halves side by side: (ROWS, HEAD_DIM) rows [x1 | x2]."""
    return tl.reshape(tl.permute(tl.join(x1, x2), (0, 2, 1)), (ROWS, HEAD_DIM))


@triton.jit
def _norm_rope_row(row, cos, sin, qw1, qw2, kw1, kw2, kv_head, num_kv_heads, eps, G: tl.constexpr,
                   BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """A decode token's G query heads of KV head kv_head and that head's k and v, from the fused
    projection's row [q heads | k heads | v heads]: q and k normalised and rotated as the q/k norm +
    rotary kernel does (fused_ops.head_norm_rope). Returns q (BLOCK_G, HEAD_DIM), k and v (HEAD_DIM,)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_g = tl.arange(0, BLOCK_G)
    offs = tl.arange(0, HALF)[None, :]
    q_first = row + (kv_head * G + offs_g)[:, None] * HEAD_DIM + offs
    q_mask = (offs_g < G)[:, None]
    k_first = row + (num_kv_heads * G + kv_head) * HEAD_DIM + offs
    q1, q2 = head_norm_rope(tl.load(q_first, mask=q_mask, other=0.0), tl.load(q_first + HALF, mask=q_mask, other=0.0),
                            qw1, qw2, cos, sin, eps, HEAD_DIM, HAS_NORM)
    k1, k2 = head_norm_rope(tl.load(k_first), tl.load(k_first + HALF), kw1, kw2, cos, sin, eps, HEAD_DIM, HAS_NORM)
    v = tl.load(row + (num_kv_heads * (G + 1) + kv_head) * HEAD_DIM + tl.arange(0, HEAD_DIM))
    return _join_halves(q1, q2, BLOCK_G, HEAD_DIM), tl.reshape(_join_halves(k1, k2, 1, HEAD_DIM), (HEAD_DIM,)), v


@triton.jit
def _attend_row(acc, l_i, m_i, q, k, v, qk_scale):
    """The online-softmax update for one K/V row (HEAD_DIM,), which every query row sees; rounded
    as _attend_tile rounds (p to v's dtype before it weights v)."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * qk_scale
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]
    return acc, l_i, m_new


@triton.jit
def _decode_row(query_start_loc_ptr, seq):
    """Sequence seq's query token, and whether it is the sequence's only one (a decode; else padding
    or, in a mixed step, a prefill chunk, the prefill kernel's)."""
    token = tl.load(query_start_loc_ptr + seq)
    return token, tl.load(query_start_loc_ptr + seq + 1) - token == 1


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "max_blocks"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, slot_mapping_ptr, stride_cs, eps,
    qk_scale, v_scale, k_inv_scale, v_inv_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt, max_blocks,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    G: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, FIRST_TILE_EARLY: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
    FP8_KV: tl.constexpr, UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    launch_dependents(USE_PDL)  # first thing: kernels/pdl.py
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # before the wait, what no kernel of this step writes (kernels/pdl.py): the step's metadata and,
    # where FIRST_TILE_EARLY, the split's first tile of the sequence's earlier positions' KV; a
    # decode's attention is a chain of dependent loads (query_start_loc, seq_len, block table, K/V)
    # that this way overlaps the kernels before
    token, is_decode = _decode_row(query_start_loc_ptr, seq)
    seq_len = tl.where(is_decode, tl.load(seq_lens_ptr + seq), 0)

    # split length from the runtime seq_len, rounded to whole tiles so every split starts on a
    # tile boundary; trailing splits of a short sequence get an empty range
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.maximum(tl.minimum(lo + split_len, seq_len), lo)
    # where ROPE, this kernel makes the current position's K/V itself: the cache is read below it
    kv_hi = hi
    if ROPE:
        kv_hi = tl.maximum(tl.minimum(hi, seq_len - 1), lo)
    full_hi = lo + (kv_hi - lo) // BLOCK_N * BLOCK_N

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = (offs_d < HEAD_DIM)[None, :]
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_kh
    if FIRST_TILE_EARLY:
        offs_n = tl.arange(0, BLOCK_N)
        pos = lo + offs_n
        kv_off = _kv_tile_offsets(bt_row, lo, offs_n, max_blocks, stride_kb, stride_ks, BLOCK_SIZE, BLOCK_N)
        k_ptrs = k_base + kv_off[:, None] + offs_d[None, :]
        v_ptrs = v_base + kv_off[:, None] + offs_d[None, :]
        earlier = (pos < tl.minimum(hi, seq_len - 1))[:, None] & d_mask
        k = tl.load(k_ptrs, mask=earlier, other=0.0)
        v = tl.load(v_ptrs, mask=earlier, other=0.0)
    if ROPE:
        cos, sin, qw1, qw2, kw1, kw2 = _rope_inputs(positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, token,
                                                    stride_cs, HEAD_DIM, HAS_NORM)
        slot = tl.load(slot_mapping_ptr + token)
    wait_for_previous(USE_PDL)
    if not is_decode:
        return  # the prefill kernel's row, or padding
    head = kv_head * G + offs_g
    io_mask = (offs_g[:, None] < G) & d_mask
    row = q_ptr + token.to(tl.int64) * stride_qt
    if ROPE:
        # q_ptr is the fused projection's row [q heads | k heads | v heads], stride_qh HEAD_DIM
        q, k_new, v_new = _norm_rope_row(row, cos, sin, qw1, qw2, kw1, kw2, kv_head, tl.num_programs(1), eps,
                                         G, BLOCK_G, HEAD_DIM, HAS_NORM)
    else:
        q = tl.load(row + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    rest = lo
    if FIRST_TILE_EARLY:
        if not ROPE:
            # the last position's K/V: this step's, stored by the kernel before (the q/k norm + rotary)
            last = (pos == seq_len - 1)[:, None] & d_mask
            k = tl.load(k_ptrs, mask=last, other=k)
            v = tl.load(v_ptrs, mask=last, other=v)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, (pos < kv_hi)[None, :], qk_scale, True, UPCAST_DOT,
                                     PRECISION)
        rest = lo + BLOCK_N
    # the query is the sequence's last position, so causality is just pos < seq_len
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, None, k_base, v_base, bt_row, max_blocks,
                            rest, full_hi, kv_hi, qk_scale, stride_kb, stride_ks,
                            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, False, UPCAST_DOT, PRECISION)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, None, k_base, v_base, bt_row, max_blocks,
                            tl.maximum(full_hi, rest), kv_hi, kv_hi, qk_scale, stride_kb, stride_ks,
                            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, False, UPCAST_DOT, PRECISION)
    if ROPE:
        if (lo <= seq_len - 1) & (seq_len - 1 < hi):  # this split holds the current position
            # the row as the cache keeps it (an FP8 cache's quantized), attended as later steps will read it
            k_row = quantize_for_cache(k_new, k_inv_scale, FP8_KV).to(k_cache_ptr.dtype.element_ty)
            v_row = quantize_for_cache(v_new, v_inv_scale, FP8_KV).to(v_cache_ptr.dtype.element_ty)
            acc, l_i, m_i = _attend_row(acc, l_i, m_i, q, k_row.to(q.dtype), v_row.to(q.dtype), qk_scale)
            if slot >= 0:
                cache_row = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + offs_d
                tl.store(k_base + cache_row, k_row)
                tl.store(v_base + cache_row, v_row)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
    if DIRECT:
        out_ptrs = out_ptr + token.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = part_out_ptr + seq * stride_pb + head[:, None] * stride_ph + split * stride_ps
        tl.store(part + offs_d[None, :], out, mask=io_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + seq * stride_lb + head * stride_lh + split, lse, mask=offs_g < G)


@triton.jit
def _token_seq(query_start_loc_ptr, token, num_seqs):
    """The sequence whose query rows hold token: the last one starting at or before it (sequences
    with no rows start where the next one does, so the last of equal starts is the one with rows)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return tl.maximum(lo - 1, 0)


@triton.jit(do_not_specialize=["num_splits", "num_seqs", "split_tokens"])
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, num_splits, split_tokens,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PER_TOKEN: tl.constexpr,
    BLOCK_Q: tl.constexpr, SKIP_SINGLE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One output row (one head of one query row) from its splits' partial outputs and log-sum-exps.
    Rows are decodes (PER_TOKEN false: row = sequence, as the decode kernel writes them) or query
    tokens (PER_TOKEN: the prefill kernel's; row = token, merged only where its tile was split)."""
    launch_dependents(USE_PDL)  # first thing: kernels/pdl.py
    row = tl.program_id(0)
    head = tl.program_id(1)
    # the step's metadata: before the wait
    if PER_TOKEN:
        token = row
        seq = _token_seq(query_start_loc_ptr, token, num_seqs)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        live = token < tl.load(query_start_loc_ptr + num_seqs)  # rows past the step's tokens: no one's
        if SKIP_SINGLE:
            live = live & (q_len != 1)  # the decode kernel's
        tile = (token - q_start) // BLOCK_Q
        kv_hi = tl.load(seq_lens_ptr + seq) - q_len + tl.minimum(q_len, (tile + 1) * BLOCK_Q)
        splits = _prefill_split_count(kv_hi, num_splits, split_tokens)
        live = live & (splits > 1)  # an unsplit tile wrote its output directly
    else:
        token, live = _decode_row(query_start_loc_ptr, row)  # not a decode: the decode kernel skipped it
        splits = num_splits
    wait_for_previous(USE_PDL)
    if not live:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row = row.to(tl.int64)
    lse = tl.load(part_lse_ptr + row * stride_lb + head * stride_lh + offs_s,
                  mask=offs_s < splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len == 0): output zeros
    w = tl.exp2(lse - m)
    live_split = lse > float("-inf")
    d_mask = offs_d < HEAD_DIM
    part = tl.load(part_out_ptr + row * stride_pb + head * stride_ph
                   + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=live_split[:, None] & d_mask[None, :], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------- host side

def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int = DEFAULT_NUM_SMS) -> int:
    """KV splits per sequence for a decode step: as many as keep the grid within PROGRAMS_PER_SM
    programs per SM, no split shorter than MIN_SPLIT_TOKENS of the longest sequence, at most
    MAX_SPLITS. Large batches already fill the GPU and get 1 (no reduction kernel, output written
    directly). Rounded down, not up: in bench_kernels.py --tile-sweep a grid just short of the
    target ran faster as it was than with the extra split that rounding up gives it."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = num_sms * PROGRAMS_PER_SM // programs
    by_length = cdiv(max(max_seq_len, 1), MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def choose_decode_tile(num_programs: int, num_sms: int, small_elems: bool) -> tuple[int, int, int]:
    """The decode kernel's (BLOCK_N, num_stages, num_warps): 2-byte K/V in 64-position tiles, three
    in flight, or two where the grid holds more than PROGRAMS_PER_SM programs per SM (there two
    timed faster in bench_kernels.py --tile-sweep; on smaller grids the two tie); fp32 in
    32-position tiles, two."""
    if not small_elems:
        return 32, 2, 4
    return 64, (2 if num_programs > PROGRAMS_PER_SM * num_sms else 3), 4


def _first_tile_early(num_seqs: int, num_kv_heads: int, num_splits: int, num_sms: int) -> bool:
    """Whether the decode kernel's grid is small enough to load its first KV tile before the PDL
    wait (FIRST_TILE_EARLY_PROGRAMS_PER_SM), and to do a step's q/k norm + rotary itself."""
    return num_seqs * num_kv_heads * num_splits <= FIRST_TILE_EARLY_PROGRAMS_PER_SM * num_sms


def split_workspace_numel(num_rows: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of split-KV scratch for num_rows rows (a decode step's sequences, a prefill's
    query tokens) of num_heads heads: partial outputs then partial log-sum-exps."""
    if num_splits <= 1:
        return 0
    return num_rows * num_heads * num_splits * (head_dim + 1)


def _prefill_tile(max_query_len: int, group: int, head_dim: int, small_elems: bool) -> tuple[int, int, int, int]:
    """The varlen kernel's (BLOCK_M, BLOCK_Q, BLOCK_N, num_stages): rows of a tile are (token, head)
    pairs, BLOCK_M = BLOCK_Q * G rounded up to a power of two."""
    block_n, stages = (64, 3) if small_elems else (32, 2)
    max_m = 128 if small_elems and next_power_of_2(head_dim) <= 128 else 64
    block_m = max(16, min(max_m, next_power_of_2(max_query_len * group)), next_power_of_2(group))
    return block_m, block_m // group, block_n, stages


def choose_prefill_splits(num_tokens: int, num_seqs: int, max_query_len: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, small_elems: bool, max_seq_len: int, num_sms: int = DEFAULT_NUM_SMS,
                          split_tokens: int = PREFILL_SPLIT_TOKENS) -> int:
    """KV splits per query tile of a prefill / mixed step's varlen kernel (1: none, no workspace).

    A tile's program streams all of the KV below its rows, so a chunk of a few hundred rows over a
    long context is a handful of programs each reading the whole context: a 64-token turn over 32k
    cached tokens is 8 programs on 132 SMs. Split only where that holds: the tiles' programs
    (cdiv(num_tokens, BLOCK_Q) per KV head) are fewer than the SMs and the context gives at least
    two splits of split_tokens (shorter, a split's fixed cost, its q load and its partial's write
    and merge, outweighs its KV). Then as many splits as give about PREFILL_PROGRAMS_PER_SM working
    programs per SM, at most MAX_PREFILL_SPLITS, and no more than keep the whole grid, whose tile axis
    is an upper bound (num_tokens // BLOCK_Q + num_seqs: in a CUDA graph num_seqs is the bucket's
    capacity) and whose surplus programs each return after a search, within PREFILL_MAX_GRID_PER_SM
    programs per SM. The kernel sizes each tile's splits from its own KV length (at least
    split_tokens each), so the count is a bound that short tiles in the same step do not pay for."""
    block_q = _prefill_tile(max_query_len, num_heads // num_kv_heads, head_dim, small_elems)[1]
    working = cdiv(max(num_tokens, 1), block_q) * num_kv_heads
    grid = (num_tokens // block_q + num_seqs) * num_kv_heads
    by_length = max_seq_len // split_tokens
    if working >= num_sms or by_length < 2:
        return 1
    return max(1, min(PREFILL_PROGRAMS_PER_SM * num_sms // working, by_length,
                      PREFILL_MAX_GRID_PER_SM * num_sms // grid, MAX_PREFILL_SPLITS))


def longest_unsplit_context(split_tokens: int = PREFILL_SPLIT_TOKENS) -> int:
    """The longest KV (a step's max_seq_len) over which no prefill tile splits, whatever the split
    count: _prefill_split_count gives one split below two of split_tokens, as choose_prefill_splits
    returns 1 there. A mixed CUDA graph for contexts up to it runs the varlen kernel unsplit."""
    return 2 * split_tokens - 1


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    max_query_len: int, max_seq_len: int, scale: float, out: torch.Tensor | None = None,
                    num_splits: int | None = None, workspace: torch.Tensor | None = None,
                    num_sms: int = DEFAULT_NUM_SMS, single_rows: bool = True,
                    rope=None, decode_tile: tuple[int, int, int] | None = None,
                    prefill_splits: int | None = None, split_tokens: int = PREFILL_SPLIT_TOKENS,
                    kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged KV; see the module docstring.

    q: (T, H, D); k_cache, v_cache: (num_blocks, block_size, Hkv, D); query_start_loc: (B+1,) int32;
    seq_lens: (B,) int32, KV length including this step's tokens; block_tables: (B, max_blocks) int32.
    max_query_len selects the decode path when 1. In a mixed step (max_query_len > 1) the sequences
    of one query row (decodes) still go to the decode kernel where single_rows (its GQA tile is 16
    rows, the varlen kernel's up to 128, of which such a row fills G), the rest to the varlen
    kernel; single_rows=False sends every row to the varlen kernel. num_splits (default: from
    choose_num_splits) and decode_tile (its (BLOCK_N, num_stages, num_warps), default: from
    choose_decode_tile; bench_kernels.py --tile-sweep sets it) are the decode kernel's;
    prefill_splits (default: from choose_prefill_splits) the varlen kernel's KV splits per tile, each
    of at least split_tokens of the tile's KV (tests pass a small one to split short contexts).
    workspace: a flat fp32 tensor of at least split_workspace_numel(B, H, D, num_splits) +
    split_workspace_numel(T, H, D, prefill_splits) elements, the decode kernel's partials first
    (default: allocated here). Rows of out beyond query_start_loc[-1] are not written.

    With rope (an attention.base.DecodeRope: what the q/k norm + rotary reads besides the row), q is
    the fused projection (T, (H + 2 * Hkv) * D), rows [q | k | v], before that norm + rotary, and
    this step's K/V is not in the cache yet: a decode step on a small grid (the early tile's) does
    that work in its decode kernel, which also stores the K/V row; any other step runs
    kernels.fused_ops.qk_norm_rope_ (in place on q, storing K/V) first.

    An FP8 cache (float8_e4m3fn) holds K / k_scale and V / v_scale, kv_scales = (k_scale, v_scale):
    its tiles are widened to q's dtype as they load, k_scale folds into the softmax scale and v_scale
    into the output (per tensor, so one multiply each instead of one per element); K/V this call
    stores are quantized as kernels.store_kvcache quantizes them.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    decode_kernel = max_query_len == 1 or single_rows
    if num_splits is None and decode_kernel:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms)
    if rope is not None:
        qkv, num_tokens = q, q.shape[0]
        assert qkv.dim() == 2 and qkv.shape[1] == (rope.num_heads + 2 * num_kv_heads) * head_dim
        q = qkv[:, :rope.num_heads * head_dim].view(num_tokens, rope.num_heads, head_dim)
        # a rotated q/k (rope.rotate) takes the rotary kernel's dots: the decode kernel's rows are too few
        rope_in_decode = (max_query_len == 1 and head_dim == next_power_of_2(head_dim) and not rope.rotate
                          and _first_tile_early(num_seqs, num_kv_heads, num_splits, num_sms))
        if not rope_in_decode:
            qk_norm_rope_(qkv, rope.positions, rope.cos_sin_cache, rope.num_heads, num_kv_heads, head_dim,
                          rope.q_weight, rope.k_weight, rope.eps, kv_cache=(k_cache, v_cache),
                          slot_mapping=rope.slot_mapping, kv_scales=kv_scales, rotate=rope.rotate)
            rope = None
    num_tokens, num_heads, head_dim = q.shape
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert block_tables.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    upcast, precision = _dot_config(q.dtype)
    block_d = next_power_of_2(head_dim)
    small_elems = q.element_size() <= 2
    fp8_kv = is_fp8_cache(k_cache)
    k_scale, v_scale = kv_scales if fp8_kv else (1.0, 1.0)
    qk_scale = scale * LOG2E * k_scale
    pdl = launch_options(q)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
                  UPCAST_DOT=upcast, PRECISION=precision, **pdl)
    if max_query_len > 1 and prefill_splits is None:
        prefill_splits = choose_prefill_splits(num_tokens, num_seqs, max_query_len, num_heads, num_kv_heads, head_dim,
                                               small_elems, max_seq_len, num_sms, split_tokens)
    decode_numel = split_workspace_numel(num_seqs, num_heads, head_dim, num_splits or 1)
    prefill_numel = split_workspace_numel(num_tokens, num_heads, head_dim, prefill_splits or 1)
    if decode_numel + prefill_numel:
        if workspace is None:
            workspace = torch.empty(decode_numel + prefill_numel, dtype=torch.float32, device=q.device)
        assert workspace.dtype == torch.float32 and workspace.numel() >= decode_numel + prefill_numel

    if decode_kernel:
        direct = num_splits == 1
        if direct:
            part_out = part_lse = out  # unused
            part_strides = (0, 0, 0, 0, 0)
        else:
            part_out, part_lse, part_strides = _partials(workspace, 0, num_seqs, num_heads, num_splits, head_dim)
        if rope is None:
            rope_args = (q, q, q, q, q, 0, 0.0)  # unused
        else:
            has_norm = rope.q_weight is not None
            rope_args = (rope.positions, rope.cos_sin_cache, rope.q_weight if has_norm else q,
                         rope.k_weight if has_norm else q, rope.slot_mapping, rope.cos_sin_cache.stride(0), rope.eps)
        tile_n, tile_stages, tile_warps = decode_tile or choose_decode_tile(num_seqs * num_kv_heads * num_splits,
                                                                            num_sms, small_elems)
        _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, k_cache, v_cache, out, part_out, part_lse,
            query_start_loc, seq_lens, block_tables, *rope_args,
            qk_scale, v_scale, 1.0 / k_scale, 1.0 / v_scale, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            block_tables.shape[1],
            *part_strides,
            G=group, BLOCK_G=max(16, next_power_of_2(group)), BLOCK_N=tile_n, DIRECT=direct,
            FIRST_TILE_EARLY=_first_tile_early(num_seqs, num_kv_heads, num_splits, num_sms),
            ROPE=rope is not None, HAS_NORM=rope is not None and rope.q_weight is not None, FP8_KV=fp8_kv,
            num_warps=tile_warps, num_stages=tile_stages, **common,
        )
        if not direct:
            _merge(out, part_out, part_lse, part_strides, query_start_loc, seq_lens, num_seqs, num_splits,
                   split_tokens, head_dim, block_d, pdl, per_token=False)
        if max_query_len == 1:
            return out

    block_m, block_q, block_n, stages = _prefill_tile(max_query_len, group, head_dim, small_elems)
    split = prefill_splits > 1
    if split:
        part_out, part_lse, part_strides = _partials(workspace, decode_numel, num_tokens, num_heads, prefill_splits,
                                                     head_dim)
    else:
        part_out = part_lse = out  # unused
        part_strides = (0, 0, 0, 0, 0)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads) + ((prefill_splits,) if split else ())
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse,
        query_start_loc, seq_lens, block_tables,
        qk_scale, v_scale, num_seqs, prefill_splits, split_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        block_tables.shape[1],
        *part_strides,
        G=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, SPLIT=split, SKIP_SINGLE=single_rows,
        num_warps=8 if block_m >= 128 else 4, num_stages=stages,
        **common,
    )
    if split:
        _merge(out, part_out, part_lse, part_strides, query_start_loc, seq_lens, num_seqs, prefill_splits,
               split_tokens, head_dim, block_d, pdl, per_token=True, block_q=block_q, skip_single=single_rows)
    return out


def _partials(workspace: torch.Tensor, offset: int, num_rows: int, num_heads: int, num_splits: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Views of workspace from offset: partial outputs (rows, heads, splits, D), then log-sum-exps
    (rows, heads, splits), and their strides as the kernels take them."""
    n_out = num_rows * num_heads * num_splits * head_dim
    n_lse = num_rows * num_heads * num_splits
    part_out = workspace[offset:offset + n_out].view(num_rows, num_heads, num_splits, head_dim)
    part_lse = workspace[offset + n_out:offset + n_out + n_lse].view(num_rows, num_heads, num_splits)
    return part_out, part_lse, (*part_out.stride()[:3], *part_lse.stride()[:2])


def _merge(out, part_out, part_lse, part_strides, query_start_loc, seq_lens, num_seqs: int, num_splits: int,
           split_tokens: int, head_dim: int, block_d: int, pdl: dict, per_token: bool, block_q: int = 1,
           skip_single: bool = False) -> None:
    rows = part_out.shape[0]
    _merge_splits_kernel[(rows, part_out.shape[1])](
        out, part_out, part_lse, query_start_loc, seq_lens, num_seqs, num_splits, split_tokens,
        out.stride(0), out.stride(1), *part_strides,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_power_of_2(num_splits), PER_TOKEN=per_token,
        BLOCK_Q=block_q, SKIP_SINGLE=skip_single,
        num_warps=4 if num_splits * block_d >= 2048 else 2, **pdl,
    )
