"""Property-based tests (hypothesis) of the BlockManager and the Scheduler, with no model.

Two state machines drive random interleavings of operations over small caches and budgets and check
the bookkeeping invariants after every single operation:

- BlockManagerMachine: match_prefix / allocate+compute / free on a BlockManager alone.
- SchedulerMachine: add / add an embedding / abort / step / finish-early on a Scheduler with a real
  BlockManager. A step fakes the model: schedule(), commit(), then append one token to every item
  with samples=True and end sequences the way EngineCore.step does (max_tokens, the cache's length
  limit, stop tokens; an embedding once its prompt is computed, never sampled).

Invariants (all checked after every rule):
- each block's ref_count == the number of live block tables holding it; free list == the blocks at
  ref 0; free + used == total;
- the prefix map points only at full blocks whose hash is the key, and whose tokens, chained with
  the tokens of every block before them, hash (hash_block along the chain) to exactly that key;
- a live sequence's computed full blocks hold its own tokens and carry its chained hashes;
- every step stays within max_num_batched_tokens and max_num_seqs;
- when the operations end, running steps empties the scheduler within a bound (no deadlock, no
  starvation), every request has finished or was aborted, and every block is free.
"""
from __future__ import annotations

from array import array

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncllm.engine.block_manager import BlockManager, hash_block, id_bytes
from asyncllm.engine.pooling import embedding_sequence
from asyncllm.engine.scheduler import Scheduler
from asyncllm.engine.sequence import PromptIds, Sequence, SequenceStatus
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import SamplingParams

BS = 16
# a few token "alphabets": prompts are drawn from shared prefixes so the prefix cache really hits
SHARED = [[100 + (7 * i + k) % 13 for i in range(4 * BS)] for k in range(3)]
# database=None: no .hypothesis/ directory in the checkout; a failure prints its steps to replay
SETTINGS = settings(max_examples=150, deadline=None, stateful_step_count=40, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def prompt_strategy(max_len: int):
    """A prompt: a slice of one of the shared prefixes, then random tokens from a tiny alphabet."""
    return st.builds(
        lambda base, cut, tail: SHARED[base][:cut] + tail,
        st.integers(0, len(SHARED) - 1),
        st.integers(0, min(3 * BS, max_len)),
        st.lists(st.integers(100, 104), min_size=0, max_size=max_len),
    ).map(lambda p: p[:max_len] or [100])


def chain_hashes(token_ids: list[int], num_blocks: int) -> list[int]:
    hashes, prefix_hash = [], -1
    for j in range(num_blocks):
        prefix_hash = hash_block(token_ids[j * BS:(j + 1) * BS], prefix_hash)
        hashes.append(prefix_hash)
    return hashes


class Accounting:
    """Shared invariant checks; subclasses provide bm, live_seqs() and known_prefixes."""

    bm: BlockManager
    # chained hash -> the full token prefix it was computed from (recorded while sequences were live)
    known_prefixes: dict[int, tuple[int, ...]]

    def live_seqs(self) -> list[Sequence]:
        raise NotImplementedError

    def record_prefixes(self) -> None:
        for seq in self.live_seqs():
            for j, h in enumerate(seq.block_hashes):
                prefix = tuple(seq.token_ids[:(j + 1) * BS])
                assert self.known_prefixes.setdefault(h, prefix) == prefix, "hash collision between prefixes"

    def check_accounting(self) -> None:
        bm = self.bm
        counts = [0] * bm.num_total_blocks
        for seq in self.live_seqs():
            assert len(set(seq.block_table)) == len(seq.block_table), f"a block twice in one table: {seq}"
            for block_id in seq.block_table:
                counts[block_id] += 1
        assert [b.ref_count for b in bm.blocks] == counts, "ref counts differ from the block-table references"
        free = set(bm.free_block_ids)
        assert len(free) == len(bm.free_block_ids)
        assert free == {i for i, c in enumerate(counts) if c == 0}
        used = sum(1 for c in counts if c > 0)
        assert bm.num_free_blocks + used == bm.num_total_blocks

    def check_prefix_map(self) -> None:
        bm = self.bm
        if not bm.enable_prefix_caching:
            assert bm.cached_block_ids == {}
            assert all(b.hash == -1 for b in bm.blocks)
            return
        for key, block_id in bm.cached_block_ids.items():
            block = bm.blocks[block_id]
            assert block.hash == key, f"map entry {key} points at block {block_id} with hash {block.hash}"
            assert len(block.id_bytes) == 8 * BS, "a hashed block is not full"
            prefix = self.known_prefixes.get(block.hash)
            assert prefix is not None, "a map entry no live sequence ever computed"
            assert id_bytes(list(prefix[-BS:])) == block.id_bytes
            hashes = chain_hashes(list(prefix), len(prefix) // BS)
            assert hashes[-1] == block.hash and ([-1] + hashes)[-2] == block.parent_hash
        # every block is in the map at most once, and unhashed blocks hold no tokens
        assert len(set(bm.cached_block_ids.values())) == len(bm.cached_block_ids)
        for block in bm.blocks:
            if block.hash == -1:
                assert block.id_bytes == b"" and block.parent_hash == -1
        # live sequences' computed full blocks hold their own tokens, with the right chained hash
        for seq in self.live_seqs():
            assert len(seq.block_hashes) <= seq.num_computed_tokens // BS
            assert seq.block_hashes == chain_hashes(seq.token_ids, len(seq.block_hashes))
            for j, h in enumerate(seq.block_hashes):
                block = bm.blocks[seq.block_table[j]]
                assert block.hash == h and block.id_bytes == id_bytes(seq.block_tokens(j))


# ---- the block manager alone --------------------------------------------------------------------
class BlockManagerMachine(RuleBasedStateMachine, Accounting):
    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.live: list[Sequence] = []
        self.known_prefixes = {}
        self.counter = 0

    def live_seqs(self) -> list[Sequence]:
        return self.live

    @precondition(lambda self: self.bm is None)
    @rule(num_blocks=st.integers(1, 10), prefix_caching=st.booleans())
    def init(self, num_blocks, prefix_caching):
        self.bm = BlockManager(num_blocks, BS, prefix_caching)

    @precondition(lambda self: self.bm is not None)
    @rule(prompt=prompt_strategy(5 * BS), chunks=st.lists(st.integers(1, 3 * BS), min_size=1, max_size=4),
          int64=st.booleans())
    def add_and_compute(self, prompt, chunks, int64):
        """A new sequence: match its cached prefix, then compute chunks while blocks last. int64: its
        prompt as the intake gives it (with its ids as int64), else a plain list."""
        bm = self.bm
        if int64:
            prompt = PromptIds(prompt)
            prompt.int64 = array("q", prompt)
        seq = Sequence(f"s{self.counter}", prompt, SamplingParams(), BS)
        self.counter += 1
        bm.match_prefix(seq)
        assert seq.num_computed_tokens == len(seq.block_table) * BS < len(seq)
        if bm.enable_prefix_caching:
            # the longest cached prefix: the next block is not in the cache (or is the last token's)
            assert seq.block_hashes == chain_hashes(prompt, len(seq.block_table))
        self.live.append(seq)
        for chunk in chunks:
            n = min(chunk, seq.num_uncomputed_tokens)
            if n == 0 or bm.num_blocks_needed(seq, n) > bm.num_free_blocks:
                break
            free_before = bm.num_free_blocks
            needed = bm.num_blocks_needed(seq, n)
            bm.allocate(seq, n)
            assert bm.num_free_blocks == free_before - needed
            seq.num_computed_tokens += n
            bm.commit_computed(seq)
            self.record_prefixes()
            self.check_accounting()

    @precondition(lambda self: self.bm is not None)
    @rule(data=st.data())
    def free(self, data):
        if not self.live:
            return
        seq = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.bm.free(seq)
        assert seq.block_table == [] and seq.block_hashes == [] and seq.num_computed_tokens == 0

    @precondition(lambda self: self.bm is not None)
    @rule(token=st.integers(100, 104), data=st.data())
    def decode(self, token, data):
        """A live, fully computed sequence gets one more token and computes it, if a block is there."""
        ready = [s for s in self.live if s.num_uncomputed_tokens == 0]
        if not ready:
            return
        seq = ready[data.draw(st.integers(0, len(ready) - 1))]
        seq.token_ids.append(token)
        if self.bm.num_blocks_needed(seq, 1) <= self.bm.num_free_blocks:
            self.bm.allocate(seq, 1)
            seq.num_computed_tokens += 1
            self.bm.commit_computed(seq)
            self.record_prefixes()

    @invariant()
    def invariants(self):
        if self.bm is None:
            return
        self.record_prefixes()
        self.check_accounting()
        self.check_prefix_map()

    def teardown(self):
        if self.bm is None:
            return
        for seq in self.live:
            self.bm.free(seq)
        self.live = []
        self.check_accounting()
        assert self.bm.num_free_blocks == self.bm.num_total_blocks


BlockManagerMachine.TestCase.settings = SETTINGS
TestBlockManagerProperties = BlockManagerMachine.TestCase


# ---- the scheduler with its block manager ----------------------------------------------------------
STOP_TOKEN = 104  # some requests stop on it, as EngineCore does with stop_token_ids


class SchedulerMachine(RuleBasedStateMachine, Accounting):
    def __init__(self):
        super().__init__()
        self.sched: Scheduler | None = None
        self.bm: BlockManager | None = None
        self.known_prefixes = {}
        self.all_seqs: list[Sequence] = []
        self.counter = 0
        self.steps = 0
        self.tokens_requested = 0

    def live_seqs(self) -> list[Sequence]:
        return list(self.sched.running) + list(self.sched.waiting)

    @property
    def max_seq_len(self) -> int:
        # EngineCore.max_seq_len: a sequence can never outgrow the whole cache
        return self.bm.num_total_blocks * BS

    @precondition(lambda self: self.sched is None)
    @rule(num_blocks=st.integers(1, 12), budget=st.sampled_from([1, 2, 7, 16, 33, 64, 512]),
          max_num_seqs=st.integers(1, 6), prefix_caching=st.booleans())
    def init(self, num_blocks, budget, max_num_seqs, prefix_caching):
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.sched = Scheduler(self.bm, budget, max_num_seqs)

    @precondition(lambda self: self.sched is not None)
    @rule(prompt=prompt_strategy(6 * BS), max_tokens=st.integers(1, 40), stop_on_token=st.booleans())
    def add(self, prompt, max_tokens, stop_on_token):
        # EngineCore.check_request refuses prompts that leave no room to generate
        prompt = prompt[:self.max_seq_len - 1] or [100]
        if len(prompt) >= self.max_seq_len:
            return
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP_TOKEN] if stop_on_token else [])
        seq = Sequence(f"r{self.counter}", prompt, params, BS)
        self.counter += 1
        self.all_seqs.append(seq)
        self.tokens_requested += len(prompt) + max_tokens
        self.sched.add(seq)
        assert seq.status == SequenceStatus.WAITING

    @precondition(lambda self: self.sched is not None)
    @rule(prompt=prompt_strategy(6 * BS), pooling=st.sampled_from(["last", "mean"]))
    def add_embedding(self, prompt, pooling):
        # nothing is generated: a prompt may fill the whole cache (check_embedding_request)
        seq = embedding_sequence(f"e{self.counter}", prompt[:self.max_seq_len] or [100], PoolingParams(pooling), BS)
        self.counter += 1
        self.all_seqs.append(seq)
        self.tokens_requested += len(seq)
        self.sched.add(seq)

    @precondition(lambda self: self.sched is not None)
    @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
    def finish_one(self, data, reason):
        """An abort (or a stop string found by the consumer) of a waiting or running request."""
        live = self.live_seqs()
        if not live:
            return
        seq = live[data.draw(st.integers(0, len(live) - 1))]
        free_before = self.bm.num_free_blocks
        exclusive = sum(1 for b in seq.block_table if self.bm.blocks[b].ref_count == 1)
        self.sched.finish(seq, reason)
        assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == reason
        assert seq.block_table == [] and seq not in self.live_seqs()
        assert self.bm.num_free_blocks == free_before + exclusive, "finish did not free the blocks at once"
        self.sched.finish(seq, "again")  # finishing twice is a no-op
        assert seq.finish_reason == reason

    @precondition(lambda self: self.sched is not None)
    @rule(token=st.integers(100, 104))
    def step(self, token):
        self.fake_step(token)

    def fake_step(self, token: int) -> None:
        sched, bm = self.sched, self.bm
        oldest = sched.running[0] if sched.running else None
        out = sched.schedule()
        self.steps += 1
        assert out.num_batched_tokens == sum(item.num_tokens for item in out.scheduled)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
        assert len({id(item.seq) for item in out.scheduled}) == len(out.scheduled)
        if sched.num_unfinished:
            assert not out.is_empty, f"work left but nothing scheduled: {sched.running} {list(sched.waiting)}"
        if oldest is not None:
            assert any(item.seq is oldest for item in out.scheduled), "the oldest running sequence starved"
        for item in out.scheduled:
            seq = item.seq
            assert seq.status == SequenceStatus.RUNNING and seq in sched.running
            assert 1 <= item.num_tokens and seq.num_computed_tokens + item.num_tokens <= len(seq)
            # an embedding never samples; mean pooling computes every position (no prefix-cache hits)
            assert item.samples == (seq.num_computed_tokens + item.num_tokens == len(seq) and seq.pooling is None)
            assert not seq.pools_every_token or seq.num_cached_prompt_tokens == 0
            assert out.has_pooling or seq.pooling is None
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + item.num_tokens
        for seq in sched.waiting:
            assert seq.status == SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
        self.check_accounting()
        sched.commit(out)
        self.record_prefixes()
        for item in out.scheduled:
            seq = item.seq
            if seq.pooling is not None and seq.num_computed_tokens == len(seq):
                sched.finish(seq, "stop")  # EngineCore, once the step that computed its last token resolves
            if not item.samples:
                continue
            seq.token_ids.append(token)
            # engine/step_resolution.finish_reason
            if token in seq.params.stop_token_ids:
                sched.finish(seq, "stop")
            elif seq.num_completion_tokens >= seq.params.max_tokens or len(seq) >= self.max_seq_len:
                sched.finish(seq, "length")

    @invariant()
    def invariants(self):
        if self.sched is None:
            return
        self.record_prefixes()
        self.check_accounting()
        self.check_prefix_map()

    def teardown(self):
        if self.sched is None:
            return
        # no deadlock, no starvation: with no new arrivals, everything ends within a generous bound
        bound = 50 * self.tokens_requested + 100
        steps = 0
        while self.sched.num_unfinished:
            self.fake_step(100)
            self.record_prefixes()
            self.check_accounting()
            self.check_prefix_map()
            steps += 1
            assert steps <= bound, f"not done after {bound} steps: {self.sched.running} {list(self.sched.waiting)}"
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        for seq in self.all_seqs:
            assert seq.status == SequenceStatus.FINISHED and seq.block_table == []
            assert seq.finish_reason in ("length", "stop", "abort")
            if seq.finish_reason == "length":
                assert seq.num_completion_tokens == seq.params.max_tokens or len(seq) == self.max_seq_len
            assert seq.num_completion_tokens <= seq.params.max_tokens


SchedulerMachine.TestCase.settings = SETTINGS
TestSchedulerProperties = SchedulerMachine.TestCase
