"""BlockManager on its own: reference counts, chained block hashes and the prefix cache."""
from __future__ import annotations

import random
from array import array

import numpy as np
import pytest
import xxhash

from asyncllm.engine.block_manager import HASH_CHUNK_BLOCKS, BlockManager, chained_hashes, hash_block, id_bytes
from asyncllm.engine.sequence import PromptIds, Sequence
from asyncllm.sampling_params import SamplingParams

BS = 16


def make_seq(tokens, request_id="r", int64: bool = False) -> Sequence:
    """int64: its prompt as the intake gives it (PromptIds, with its ids as int64), else a plain list."""
    return Sequence(request_id, prompt_ids(tokens) if int64 else list(tokens), SamplingParams(), BS)


def prompt_ids(tokens) -> PromptIds:
    ids = PromptIds(tokens)
    ids.int64 = array("q", ids)
    return ids


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 100_000) for _ in range(n)]


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """What the scheduler and runner do for one chunk: find blocks, compute the KV, commit it."""
    if num_tokens is None:
        num_tokens = seq.num_uncomputed_tokens
    assert bm.num_blocks_needed(seq, num_tokens) <= bm.num_free_blocks
    bm.allocate(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.commit_computed(seq)


def check_accounting(bm: BlockManager, live: list[Sequence]) -> None:
    """ref_count of every block == number of live block tables holding it; free list == ref 0."""
    counts = [0] * bm.num_total_blocks
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for block_id in seq.block_table:
            counts[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == counts
    assert set(bm.free_block_ids) == {i for i, c in enumerate(counts) if c == 0}


def test_hash_block_chains():
    block = tokens(BS, 0)
    h_root = hash_block(block, -1)
    assert h_root == hash_block(list(block), -1)  # deterministic
    assert hash_block(tokens(BS, 1), -1) != h_root
    # the same block tokens after different prefixes hash differently
    h_a = hash_block(block, hash_block(tokens(BS, 2), -1))
    h_b = hash_block(block, hash_block(tokens(BS, 3), -1))
    assert len({h_root, h_a, h_b}) == 3


@pytest.mark.parametrize("int64", [False, True], ids=["list", "prompt-int64"])
def test_chained_hashes_equal_each_blocks_hash_across_chunks(int64):
    # the ids as little-endian int64 bytes, as numpy lays them out, chained by xxh3 seeded with the
    # hash before (0: none); blocks across
    # several conversion chunks, a pending token (-1) and ids past 2**31 included; with the
    # prompt's int64 form, blocks past the prompt (generated tokens) come from the list
    rng = random.Random(0)
    ids = [rng.randrange(-1, 2**40) for _ in range((2 * HASH_CHUNK_BLOCKS + 3) * BS)]
    seq = make_seq(ids[:(HASH_CHUNK_BLOCKS + 2) * BS + 5], int64=int64)
    seq.token_ids.extend(ids[len(seq.token_ids):])

    def reference(block, prefix):
        return xxhash.xxh3_64(np.asarray(block, dtype="<i8").tobytes(), seed=0 if prefix == -1 else prefix).intdigest()
    expected, prefix = [], -1
    for i in range(len(ids) // BS):
        prefix = reference(ids[i * BS:(i + 1) * BS], prefix)
        expected.append(prefix)
        assert hash_block(ids[i * BS:(i + 1) * BS], -1 if i == 0 else expected[i - 1]) == prefix
    num_blocks = len(expected)

    def hashes(first, prefix_hash):
        out = []
        for j, (data, h) in enumerate(chained_hashes(seq, first, num_blocks, prefix_hash), first):
            assert data.tobytes() == id_bytes(ids[j * BS:(j + 1) * BS])
            out.append(h)
        return out
    assert hashes(0, -1) == expected
    # from a block in the middle of a chunk, chained to the one before it
    first = HASH_CHUNK_BLOCKS - 2
    assert hashes(first, expected[first - 1]) == expected[first:]
    assert list(chained_hashes(seq, 5, 5, expected[4])) == []


@pytest.mark.parametrize("int64", [False, True], ids=["list", "prompt-int64"])
def test_match_prefix_from_the_prompts_int64_ids_equals_the_lists(int64):
    # a prompt with its int64 form matches, and is matched by, prompts given as plain lists
    bm = BlockManager(16, BS)
    t = tokens(3 * BS + 4, 0)
    a = make_seq(t, "a", int64=not int64)
    compute(bm, a)
    b = make_seq(t[:2 * BS] + tokens(BS + 1, 7), "b", int64=int64)
    bm.match_prefix(b)
    assert b.block_table == a.block_table[:2] and b.num_computed_tokens == 2 * BS
    compute(bm, b)
    assert b.block_hashes[:2] == a.block_hashes[:2] and b.block_hashes[2] != a.block_hashes[2]


def test_sequence_block_hashes_are_chained():
    bm = BlockManager(8, BS)
    t = tokens(3 * BS, 0)
    seq = make_seq(t)
    compute(bm, seq)
    expected, prev = [], -1
    for i in range(3):
        prev = hash_block(t[i * BS:(i + 1) * BS], prev)
        expected.append(prev)
    assert seq.block_hashes == expected
    assert [bm.blocks[b].hash for b in seq.block_table] == expected
    assert [bm.cached_block_ids[h] for h in expected] == seq.block_table
    assert [(bm.blocks[b].parent_hash, bm.blocks[b].id_bytes) for b in seq.block_table] == \
        [(([-1] + expected)[i], id_bytes(t[i * BS:(i + 1) * BS])) for i in range(3)]


def test_a_hash_collision_is_a_miss():
    # the map is keyed by the chained hash alone: a block it gives whose ids or prefix hash are not
    # the ones looked for (two prefixes of equal hash) is not taken
    bm = BlockManager(8, BS)
    a = make_seq(tokens(2 * BS, 0), "a")
    compute(bm, a)
    b_ids = a.token_ids[:BS] + tokens(BS, 5)
    b_first, b_second = hash_block(b_ids[:BS], -1), hash_block(b_ids[BS:], hash_block(b_ids[:BS], -1))
    bm.cached_block_ids[b_second] = a.block_table[1]  # b's second block "collides" with a's
    b = make_seq(b_ids + [1], "b")
    bm.match_prefix(b)
    assert b.block_table == a.block_table[:1] and b.block_hashes == [b_first] and b.num_computed_tokens == BS
    # a's second block's ids as a first block: its ids equal, the hash before it (none) not
    c_first = hash_block(a.token_ids[BS:], -1)
    bm.cached_block_ids[c_first] = a.block_table[1]
    c = make_seq(a.token_ids[BS:] + [1], "c")
    bm.match_prefix(c)
    assert c.block_table == [] and c.num_computed_tokens == 0
    del bm.cached_block_ids[b_second], bm.cached_block_ids[c_first]
    check_accounting(bm, [a, b, c])


def test_same_block_after_different_prefix_is_not_a_hit():
    bm = BlockManager(8, BS)
    shared_second = tokens(BS, 9)
    a = make_seq(tokens(BS, 1) + shared_second + [5], "a")
    compute(bm, a)
    b = make_seq(tokens(BS, 2) + shared_second + [5], "b")
    bm.match_prefix(b)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert a.block_hashes[1] != hash_block(shared_second, hash_block(tokens(BS, 2), -1))


def test_prefix_hit_only_after_commit():
    bm = BlockManager(8, BS)
    t = tokens(3 * BS, 0)
    a = make_seq(t, "a")
    bm.allocate(a, len(t))  # blocks reserved, KV not yet computed
    b = make_seq(t, "b")
    bm.match_prefix(b)
    assert b.block_table == [] and b.num_computed_tokens == 0, "hit on KV that is not computed yet"
    # the first chunk is computed: only its full block becomes a hit
    a.num_computed_tokens = BS + 5
    bm.commit_computed(a)
    bm.match_prefix(b)
    assert b.block_table == a.block_table[:1] and b.num_computed_tokens == BS
    bm.free(b)
    a.num_computed_tokens = len(t)
    bm.commit_computed(a)
    bm.match_prefix(b)
    # 48 tokens: the last token is never served, so 2 of the 3 blocks match
    assert b.block_table == a.block_table[:2] and b.num_computed_tokens == 2 * BS
    check_accounting(bm, [a, b])


def test_a_match_takes_only_blocks_whose_ids_and_prefix_hash_are_equal():
    bm = BlockManager(8, BS)
    a = make_seq(tokens(2 * BS, 0), "a")
    compute(bm, a)
    # a's second block's ids after another first block: its key's prefix hash differs
    other = tokens(BS, 1) + a.token_ids[BS:]
    c = make_seq(other + [1], "c")
    bm.match_prefix(c)
    assert c.block_table == [] and c.num_computed_tokens == 0
    # one id changed in a's second block: the first block matches, the second does not
    d = make_seq(a.token_ids[:2 * BS - 1] + [a.token_ids[-1] + 1, 1], "d")
    bm.match_prefix(d)
    assert d.block_table == a.block_table[:1] and d.num_computed_tokens == BS
    assert [bm.blocks[b].ref_count for b in a.block_table] == [2, 1]
    check_accounting(bm, [a, c, d])


def test_reuse_after_free():
    bm = BlockManager(8, BS)
    t = tokens(40, 0)
    a = make_seq(t, "a")
    compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    b = make_seq(t[:2 * BS] + tokens(10, 5), "b")
    bm.match_prefix(b)
    assert b.block_table == a_blocks[:2] and b.num_computed_tokens == 2 * BS
    assert [bm.blocks[i].ref_count for i in a_blocks[:2]] == [1, 1]
    assert bm.num_free_blocks == bm.num_total_blocks - 2
    compute(bm, b)
    check_accounting(bm, [b])
    bm.free(b)
    check_accounting(bm, [])


def test_freed_block_hash_dropped_when_handed_out_again():
    bm = BlockManager(4, BS)
    t = tokens(3 * BS, 0)
    a = make_seq(t, "a")
    compute(bm, a)
    a0, a1, a2 = a.block_table
    h0, h1, h2 = a.block_hashes
    bm.free(a)  # free list now: the never-used block, then a2, a1, a0 (tail first)
    x = make_seq(tokens(3 * BS, 7), "x")
    bm.allocate(x, 3 * BS)  # takes the never-used block, a2 and a1
    assert (a0, a1, a2) == (0, 1, 2) and x.block_table == [3, a2, a1]
    assert sorted(bm.cached_block_ids.values()) == [a0]
    assert bm.blocks[a1].hash == -1 and bm.blocks[a1].id_bytes == b""
    assert bm.cached_block_ids[h0] == a0
    b = make_seq(t, "b")
    bm.match_prefix(b)
    assert b.block_table == [a0] and b.num_computed_tokens == BS
    check_accounting(bm, [x, b])


def test_live_duplicate_keeps_its_entry_when_freed_twin_is_reallocated():
    bm = BlockManager(4, BS)
    t = tokens(BS + 1, 0)
    c = make_seq(t, "c")
    compute(bm, c)
    c0 = c.block_table[0]
    bm.free(c)
    # d computes the same block itself (as if scheduled in the same step, without a prefix match)
    d = make_seq(t, "d")
    compute(bm, d)
    d0 = d.block_table[0]
    assert d0 != c0
    assert bm.cached_block_ids[hash_block(t[:BS], -1)] == d0  # the live block wins the entry
    x = make_seq(tokens(2 * BS, 3), "x")
    bm.allocate(x, 2 * BS)  # hands out the freed twin c0 again
    assert c0 in x.block_table
    assert bm.cached_block_ids[hash_block(t[:BS], -1)] == d0
    e = make_seq(t, "e")
    bm.match_prefix(e)
    assert e.block_table == [d0]
    check_accounting(bm, [d, x, e])


@pytest.mark.parametrize("extra", [0, 1])
def test_last_token_never_served_from_cache(extra):
    bm = BlockManager(8, BS)
    t = tokens(2 * BS + extra, 0)
    a = make_seq(t, "a")
    compute(bm, a)
    b = make_seq(t, "b")
    bm.match_prefix(b)
    # exactly 2 blocks: 1 matched (the last token must be computed); 2 blocks + 1 token: 2 matched
    assert len(b.block_table) == 1 + extra
    assert b.num_uncomputed_tokens >= 1
    assert b.num_computed_tokens == len(b.block_table) * BS


def test_ref_counts_with_two_sharing_sequences():
    bm = BlockManager(10, BS)
    prefix = tokens(2 * BS, 0)
    a = make_seq(prefix + tokens(20, 1), "a")
    compute(bm, a)
    b = make_seq(prefix + tokens(20, 2), "b")
    bm.match_prefix(b)
    compute(bm, b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert not set(a.block_table[2:]) & set(b.block_table[2:])
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    check_accounting(bm, [a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert not set(shared) & set(bm.free_block_ids)
    check_accounting(bm, [b])
    bm.free(b)
    check_accounting(bm, [])
    assert bm.num_free_blocks == bm.num_total_blocks


def test_free_order_exact():
    bm = BlockManager(6, BS)
    a = make_seq(tokens(3 * BS, 0), "a")
    b = make_seq(tokens(3 * BS, 1), "b")
    compute(bm, a)
    compute(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    assert list(bm.free_block_ids) == a_blocks[::-1] + b_blocks[::-1]
    # so a re-sent prompt of b still finds its prefix after a's blocks were reused
    y = make_seq(tokens(3 * BS, 3), "y")
    bm.allocate(y, 3 * BS)
    assert y.block_table == a_blocks[::-1]
    b2 = make_seq(tokens(3 * BS, 1), "b2")
    bm.match_prefix(b2)
    assert b2.block_table == b_blocks[:2]


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    t = tokens(3 * BS, 0)
    a = make_seq(t, "a")
    compute(bm, a)
    assert a.block_hashes == [] and bm.cached_block_ids == {}
    b = make_seq(t, "b")
    bm.match_prefix(b)
    assert b.block_table == []


def test_num_blocks_needed_and_allocate():
    bm = BlockManager(8, BS)
    seq = make_seq(tokens(20, 0))
    assert bm.num_blocks_needed(seq, 20) == 2
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 10
    assert bm.num_blocks_needed(seq, 6) == 0
    assert bm.num_blocks_needed(seq, 7) == 1
    assert bm.num_blocks_needed(seq, 6 + 2 * BS) == 2
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    with pytest.raises(AssertionError):
        bm.allocate(seq, 8 * BS)


@pytest.mark.parametrize("int64", [False, True], ids=["list", "prompt-int64"])
def test_random_share_and_free_keeps_accounting(int64):
    rng = random.Random(0)
    bm = BlockManager(32, BS)
    prefixes = [tokens(2 * BS, s) for s in range(3)]
    live: list[Sequence] = []
    for i in range(300):
        if live and (rng.random() < 0.45 or bm.num_free_blocks < 6):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            seq = make_seq(rng.choice(prefixes)[:rng.randrange(1, 2 * BS + 1)] + tokens(rng.randrange(1, 40), i),
                           f"s{i}", int64)
            bm.match_prefix(seq)
            assert seq.num_computed_tokens < len(seq)
            if bm.num_blocks_needed(seq, seq.num_uncomputed_tokens) > bm.num_free_blocks:
                bm.free(seq)
                continue
            compute(bm, seq)
            live.append(seq)
        check_accounting(bm, live)
        # every hashed live block holds the tokens its sequences have there
        for seq in live:
            for j, block_id in enumerate(seq.block_table[:len(seq.block_hashes)]):
                assert bm.blocks[block_id].id_bytes == id_bytes(seq.block_tokens(j))
    for seq in live:
        bm.free(seq)
    check_accounting(bm, [])
