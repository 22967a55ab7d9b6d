"""Paged KV-cache bookkeeping: reference-counted blocks and a prefix cache of full blocks.

A block's hash chains its token ids with the hash of the block before it (xxh3 seeded with it), so
equal hashes mean equal prefixes. The prefix map is keyed by that hash; a block found by it is
taken only if its ids' bytes and the hash of the block before it are the ones looked for, so a
match is exact, and a hash collision is a miss, never another prefix's KV. A prefix match walks
the map block by block from the root, each block's hash one C call over its ids' int64 bytes.
A prompt's ids come as int64 once, from the intake's check (Sequence.prompt_int64). A block
enters the map only when its KV is computed, so a prefix hit never reads KV that a still-running
prefill has yet to write. Freed blocks keep their entry and stay reusable until the allocator
hands them out again (oldest-freed first).
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator

import xxhash

from asyncllm.engine.sequence import Sequence

# blocks whose ids block_id_bytes converts to int64 in one C pass where the sequence has no int64
# form of them (generated tokens, a prompt given as a plain list): a 32k-token prompt's 128 blocks
# cost 8 passes, not 128 list-to-array conversions, and a prompt that misses early converts little
# past what it looked at
HASH_CHUNK_BLOCKS = 16
INT64_BYTES = array("q").itemsize


def _hash_bytes(data, prefix_hash: int) -> int:
    """xxh3 seeded with the hash of the block before (0 for none: -1 is no 64-bit seed): one C
    call, where a prefix map keyed by the ids' bytes paid Python's hash of them (SipHash, ~3x as long)."""
    return xxhash.xxh3_64_intdigest(data, 0 if prefix_hash == -1 else prefix_hash)


def id_bytes(token_ids: list[int]) -> bytes:
    """Token ids as the int64 bytes that blocks are keyed and hashed by."""
    return array("q", token_ids).tobytes()


def hash_block(token_ids: list[int], prefix_hash: int) -> int:
    """A block's hash: its ids as int64 chained with the hash of the block before it (-1: none)."""
    return _hash_bytes(id_bytes(token_ids), prefix_hash)


def block_id_bytes(seq: Sequence, first: int, stop: int) -> Iterator[memoryview]:
    """The int64 bytes of seq's blocks first .. stop-1, in turn: slices of its prompt's int64 ids
    where they cover them, else converted a chunk of blocks at a time as consumed."""
    size = seq.block_size
    block_bytes = size * INT64_BYTES
    prompt = seq.prompt_int64
    for chunk in range(first, stop, HASH_CHUNK_BLOCKS):
        end = min(stop, chunk + HASH_CHUNK_BLOCKS)
        if prompt is not None and end * size <= len(prompt):
            data = memoryview(prompt).cast("B")[chunk * block_bytes:end * block_bytes]
        else:
            data = memoryview(array("q", seq.token_ids[chunk * size:end * size])).cast("B")
        for offset in range(0, len(data), block_bytes):
            yield data[offset:offset + block_bytes]


def chained_hashes(seq: Sequence, first: int, stop: int, prefix_hash: int) -> Iterator[tuple[memoryview, int]]:
    """(int64 bytes, hash_block) of seq's blocks first .. stop-1 in turn, each hash chained to the
    one before (prefix_hash: block first-1's, -1 none)."""
    for data in block_id_bytes(seq, first, stop):
        prefix_hash = _hash_bytes(data, prefix_hash)
        yield data, prefix_hash


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "id_bytes")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # chained (hash_block), -1 until the block's KV is computed and full
        self.parent_hash = -1  # the block before it's hash (-1: none), with id_bytes what a match checks
        self.id_bytes = b""  # its token ids as int64 bytes (id_bytes()), once hashed


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # insertion order = order freed; allocation takes the oldest, so recently freed prefixes live longest
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # a computed block's hash -> the block (its ids and the hash before it checked on a match)
        self.cached_block_ids: dict[int, int] = {}
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1 and self.cached_block_ids.get(block.hash) == block_id:
            del self.cached_block_ids[block.hash]
        block.hash = block.parent_hash = -1
        block.id_bytes = b""
        block.ref_count = 1
        return block_id

    def _share_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that seq can hold num_new_tokens more KV entries."""
        return max(0, seq.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix.

        The last token is always left to compute, since its logits are needed to sample.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        cached, blocks = self.cached_block_ids, self.blocks
        prefix_hash = -1
        for data in block_id_bytes(seq, 0, (len(seq) - 1) // self.block_size):
            block_hash = _hash_bytes(data, prefix_hash)
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            block = blocks[block_id]
            if block.parent_hash != prefix_hash or block.id_bytes != data.tobytes():  # a collision
                break
            self._share_block(block_id)
            prefix_hash = block_hash
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.num_blocks_needed(seq, num_new_tokens)
        assert needed <= self.num_free_blocks, "caller must check num_free_blocks first"
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def fork(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Give child (a sequence with no blocks) parent's first num_blocks blocks, computed and
        shared: one more reference each, no copy."""
        assert not child.block_table and child.num_computed_tokens == 0
        assert parent.num_computed_tokens >= num_blocks * self.block_size
        for block_id in parent.block_table[:num_blocks]:
            self._share_block(block_id)
        child.block_table = parent.block_table[:num_blocks]
        child.block_hashes = parent.block_hashes[:num_blocks]
        child.num_computed_tokens = num_blocks * self.block_size

    def free(self, seq: Sequence) -> None:
        # reversed: a sequence's tail blocks are freed first, so they are also reused first,
        # and its shared prefix blocks survive longest
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's blocks past those that num_tokens tokens need (speculative decoding's rejected
        draft positions). Those blocks hold no hashed KV: a block is hashed only once full of accepted
        tokens."""
        keep = seq.num_blocks_for(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        del seq.block_table[keep:]

    def commit_computed(self, seq: Sequence) -> None:
        """Hash the blocks that became full of computed KV, making them prefix-cache hits."""
        # runs for every scheduled sequence every step: most steps fill no block
        if not self.enable_prefix_caching or seq.num_computed_tokens // self.block_size <= len(seq.block_hashes):
            return
        # a block holding a token still being sampled is hashed once its value is known
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        first = len(seq.block_hashes)
        prefix_hash = seq.block_hashes[-1] if seq.block_hashes else -1
        for block_index, (data, block_hash) in enumerate(chained_hashes(seq, first, num_full, prefix_hash), first):
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[block_index]]
            if block.hash == -1:
                block.hash, block.parent_hash = block_hash, prefix_hash
                block.id_bytes = data.tobytes()
                # a live block wins the entry over a freed duplicate, which may soon be handed out
                holder = self.cached_block_ids.get(block_hash)
                if holder is None or self.blocks[holder].ref_count == 0:
                    self.cached_block_ids[block_hash] = block.block_id
            prefix_hash = block_hash

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the KV it points at is gone (a sleeping engine) or was computed
        by other weights (a reload). Only while no block is in use."""
        assert self.num_free_blocks == self.num_total_blocks, "a block is still in use"
        self.cached_block_ids.clear()
        for block in self.blocks:
            block.hash = block.parent_hash = -1
            block.id_bytes = b""
