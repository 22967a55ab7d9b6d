"""The Scheduler with a real BlockManager and fake model progress (no model).

A fake step is: schedule(), check invariants, commit(), append a fake sampled token to every item
that samples, and finish sequences that reached their length.
"""
from __future__ import annotations

import random

import pytest

from asyncllm.engine.block_manager import BlockManager
from asyncllm.engine.scheduler import Scheduler, SchedulerOutput
from asyncllm.engine.sequence import Sequence, SequenceStatus
from asyncllm.sampling_params import SamplingParams

BS = 16


class FakeEngine:
    def __init__(self, num_blocks: int, budget: int = 1024, max_num_seqs: int = 64, prefix_caching: bool = True):
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.sched = Scheduler(self.bm, budget, max_num_seqs)
        self.max_new: dict[str, int] = {}
        self.counter = 0
        self.steps = 0
        self.finished: list[Sequence] = []
        self.aborted: list[Sequence] = []
        # per request: list of (step, start, num_tokens, samples)
        self.history: dict[str, list[tuple[int, int, int, bool]]] = {}

    def add(self, prompt: list[int] | int, max_new: int, seed: int | None = None) -> Sequence:
        if isinstance(prompt, int):
            rng = random.Random(self.counter if seed is None else seed)
            prompt = [rng.randrange(100, 50_000) for _ in range(prompt)]
        assert len(prompt) + max_new - 1 <= self.bm.num_total_blocks * BS, "would never fit the cache"
        seq = Sequence(f"r{self.counter}", prompt, SamplingParams(max_tokens=max_new), BS)
        self.counter += 1
        self.max_new[seq.request_id] = max_new
        self.history[seq.request_id] = []
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        sched = self.sched
        decoding_before = {id(s) for s in sched.running if s.num_uncomputed_tokens == 1}
        oldest = sched.running[0] if sched.running else None
        out = sched.schedule()
        self.steps += 1
        self.check(out, decoding_before)
        if oldest is not None:
            # the oldest running sequence is never preempted nor starved, so the system always progresses
            assert any(item.seq is oldest for item in out.scheduled), "the oldest running sequence was starved"
        for item in out.scheduled:
            self.history[item.seq.request_id].append(
                (self.steps, item.seq.num_computed_tokens, item.num_tokens, item.samples))
        sched.commit(out)
        for item in out.scheduled:
            if item.samples:
                seq = item.seq
                seq.token_ids.append(1000 + (len(seq) * 7919) % 30_000)
                if seq.num_completion_tokens >= self.max_new[seq.request_id]:
                    sched.finish(seq, "length")
                    self.finished.append(seq)
        return out

    def check(self, out: SchedulerOutput, decoding_before: set[int]) -> None:
        sched, bm = self.sched, self.bm
        assert out.num_batched_tokens == sum(item.num_tokens for item in out.scheduled)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        assert len(sched.running) <= sched.max_num_seqs
        assert len({id(item.seq) for item in out.scheduled}) == len(out.scheduled)
        # decodes come before prefill chunks
        kinds = [id(item.seq) in decoding_before for item in out.scheduled]
        assert kinds == sorted(kinds, reverse=True), "a prefill chunk was scheduled before a decode"
        for item in out.scheduled:
            seq = item.seq
            assert seq.status == SequenceStatus.RUNNING and seq in sched.running
            assert item.num_tokens >= 1
            assert seq.num_computed_tokens + item.num_tokens <= len(seq)
            assert item.samples == (seq.num_computed_tokens + item.num_tokens == len(seq))
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + item.num_tokens
        for seq in sched.waiting:
            assert seq.status == SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
        # block accounting: ref counts == holders, free list == unreferenced blocks
        counts = [0] * bm.num_total_blocks
        for seq in sched.running:
            assert len(seq.block_table) == len(set(seq.block_table))
            assert len(seq.block_table) * BS >= seq.num_computed_tokens
            for block_id in seq.block_table:
                counts[block_id] += 1
        assert [b.ref_count for b in bm.blocks] == counts
        assert set(bm.free_block_ids) == {i for i, c in enumerate(counts) if c == 0}

    def run(self, max_steps: int = 10_000, arrivals: dict[int, list[tuple[int, int]]] | None = None,
            abort_rng: random.Random | None = None) -> int:
        arrivals = dict(arrivals or {})
        while self.sched.num_unfinished or arrivals:
            for prompt, max_new in arrivals.pop(self.steps, []):
                self.add(prompt, max_new)
            if abort_rng is not None and abort_rng.random() < 0.03 and self.sched.num_unfinished:
                # abort a random request, running or waiting, between steps
                victim = abort_rng.choice(list(self.sched.running) + list(self.sched.waiting))
                self.sched.finish(victim, "abort")
                assert victim.block_table == [] and victim.status == SequenceStatus.FINISHED
                self.aborted.append(victim)
            self.step()
            assert self.steps <= max_steps, "the scheduler did not finish its work"
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        for seq in self.finished:
            assert seq.num_completion_tokens == self.max_new[seq.request_id]
        assert not set(map(id, self.finished)) & set(map(id, self.aborted))
        return self.steps


def test_budget_and_max_num_seqs_respected():
    eng = FakeEngine(num_blocks=64, budget=20, max_num_seqs=3)
    for i in range(8):
        eng.add(5 + 9 * i, max_new=6)
    max_running = 0
    while eng.sched.num_unfinished:
        out = eng.step()
        max_running = max(max_running, len(eng.sched.running))
        assert out.num_batched_tokens <= 20 and len(out.scheduled) <= 3
        assert eng.steps < 500
    assert max_running == 3
    assert len(eng.finished) == 8
    assert eng.bm.num_free_blocks == eng.bm.num_total_blocks


def test_queueing_with_max_num_seqs():
    eng = FakeEngine(num_blocks=64, max_num_seqs=2)
    seqs = [eng.add(10, max_new=3) for _ in range(5)]
    out = eng.step()
    assert [item.seq for item in out.scheduled] == seqs[:2]
    assert list(eng.sched.waiting) == seqs[2:]
    eng.run()
    # first come first served: requests finish in arrival order
    assert eng.finished == seqs


def test_decode_first_then_a_chunk_of_the_new_prompt():
    eng = FakeEngine(num_blocks=64, budget=8)
    decoders = [eng.add(2, max_new=30) for _ in range(3)]
    out = eng.step()  # 3 prompts of 2 tokens prefilled, each samples
    assert [i.num_tokens for i in out.scheduled] == [2, 2, 2] and all(i.samples for i in out.scheduled)
    new = eng.add(50, max_new=2)
    out = eng.step()
    assert [(i.seq, i.num_tokens, i.samples) for i in out.scheduled] == \
        [(d, 1, True) for d in decoders] + [(new, 5, False)]
    # the long prompt goes on in chunks of what the decodes leave, decodes first every step
    chunks = [5]
    while new.num_computed_tokens < 50:
        out = eng.step()
        assert [i.seq for i in out.scheduled[:3]] == decoders
        assert out.num_batched_tokens == 8
        chunks.append(out.scheduled[3].num_tokens)
    assert sum(chunks) == 50 and chunks[-1] <= 5 and len(chunks) == 10
    assert out.scheduled[3].samples


def test_long_prompt_is_chunked_by_the_budget():
    eng = FakeEngine(num_blocks=64, budget=32)
    seq = eng.add(100, max_new=3)
    eng.run()
    prefill = [h for h in eng.history[seq.request_id] if h[1] < 100]
    assert [(start, n, samples) for _, start, n, samples in prefill] == \
        [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]


def test_new_request_joins_the_very_next_step():
    eng = FakeEngine(num_blocks=64, budget=64)
    decoders = [eng.add(n, max_new=20) for n in (3, 7, 12)]
    eng.step()
    eng.step()
    assert all(s.num_uncomputed_tokens == 1 for s in decoders)
    late = eng.add(20, max_new=5)
    out = eng.step()
    assert [(i.seq, i.num_tokens) for i in out.scheduled] == [(d, 1) for d in decoders] + [(late, 20)]
    assert out.num_batched_tokens != len(out.scheduled) and out.scheduled[-1].samples  # not decode-only
    eng.run()


def test_preemption_picks_the_newest_and_recomputes_from_zero():
    # 5 blocks: a (47 tokens, 3 blocks) and b (20 tokens, 2 blocks) fill the cache
    eng = FakeEngine(num_blocks=5, prefix_caching=False)
    a = eng.add(47, max_new=10)
    b = eng.add(20, max_new=10)
    eng.step()  # both prefilled
    assert eng.bm.num_free_blocks == 0
    eng.step()  # a decodes position 47, still in its 3rd block
    assert eng.sched.num_preemptions == 0
    b_len = len(b)
    out = eng.step()  # a needs a 4th block: b, the newest, is preempted
    assert eng.sched.num_preemptions >= 1 and b.num_preemptions >= 1
    assert a.num_preemptions == 0
    assert out.scheduled[0].seq is a and out.scheduled[0].num_tokens == 1
    assert len(a.block_table) == 4
    # b lost its KV and starts over from token 0 (possibly already re-admitted with a first chunk)
    b_items = [h for h in eng.history[b.request_id] if h[0] == eng.steps]
    if b.status == SequenceStatus.WAITING:
        assert b.block_table == [] and b.num_computed_tokens == 0 and eng.sched.waiting[0] is b
        assert not b_items
    else:
        assert [(start, samples) for _, start, _, samples in b_items] == [(0, False)]
    assert len(b) == b_len  # no token was lost
    eng.run()
    # every time b came back it recomputed from 0: each run of b's schedule starts at 0
    starts = [start for _, start, _, _ in eng.history[b.request_id]]
    assert starts.count(0) == b.num_preemptions + 1
    assert a.num_completion_tokens == 10 and b.num_completion_tokens == 10


def test_preempted_seq_readmitted_with_prefix_cache_hits_its_own_blocks():
    eng = FakeEngine(num_blocks=5, prefix_caching=True)
    a = eng.add(47, max_new=10)
    b = eng.add(40, max_new=3)  # 3 blocks: only 2 are left after a, so b gets a 32-token chunk
    eng.step()
    assert [h[1:] for h in eng.history[b.request_id]] == [(0, 32, False)]
    assert len(b.block_hashes) == 2
    eng.run()
    assert b.num_preemptions >= 1
    # b's first full block survived in the prefix cache, so b came back at token 16, not 0
    assert [h[1] for h in eng.history[b.request_id]][:2] == [0, BS]
    assert a.num_completion_tokens == 10 and b.num_completion_tokens == 3


def test_oldest_progresses_when_newer_decodes_compete():
    # a long prompt being prefilled in chunks, then short requests arrive; a tiny cache
    eng = FakeEngine(num_blocks=8, budget=16)
    eng.add(100, max_new=20)
    eng.run(arrivals={1: [(5, 20), (5, 20)], 3: [(30, 10)]})
    assert eng.sched.num_preemptions > 0


def random_workload(seed: int) -> FakeEngine:
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 6, 8, 12])
    capacity = num_blocks * BS
    eng = FakeEngine(num_blocks=num_blocks, budget=rng.choice([1, 8, 16, 33, 100, 512]),
                     max_num_seqs=rng.choice([1, 2, 3, 8, 64]), prefix_caching=rng.random() < 0.7)
    shared = [rng.randrange(100, 50_000) for _ in range(3 * BS)]
    arrivals: dict[int, list] = {}
    total_tokens = num_requests = 0
    for _ in range(rng.randrange(3, 14)):
        prompt_len = rng.randrange(1, min(80, capacity - 1))
        max_new = rng.randrange(1, min(60, capacity - prompt_len + 1) + 1)
        prompt = [rng.randrange(100, 50_000) for _ in range(prompt_len)]
        if rng.random() < 0.4:  # a shared prefix, for prefix-cache hits
            prompt[:len(shared)] = shared[:prompt_len]
        arrivals.setdefault(rng.randrange(0, 40), []).append((prompt, max_new))
        total_tokens += prompt_len + max_new
        num_requests += 1
    # a generous bound: no livelock means every request's tokens get through
    eng.run(max_steps=50 * total_tokens + 100, arrivals=arrivals,
            abort_rng=random.Random(seed) if seed % 3 == 0 else None)
    assert len(eng.finished) + len(eng.aborted) == num_requests
    return eng


@pytest.mark.parametrize("shard", range(3))
def test_random_workloads_on_a_tiny_cache_terminate(shard):
    engines = [random_workload(seed) for seed in range(shard * 60, (shard + 1) * 60)]
    # the workloads really exercise preemption and prefix hits
    assert sum(e.sched.num_preemptions for e in engines) > 0
    assert sum(e.bm.num_prefix_hit_tokens for e in engines) > 0


def test_finish_frees_blocks_wherever_the_sequence_is():
    eng = FakeEngine(num_blocks=8, budget=16)
    a = eng.add(40, max_new=5)
    b = eng.add(10, max_new=5)
    eng.step()  # a: first chunk of 16; b waits for the budget
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    eng.sched.finish(b, "abort")
    assert b.status == SequenceStatus.FINISHED and b.finish_reason == "abort" and b not in eng.sched.waiting
    eng.sched.finish(a, "abort")
    assert a.block_table == [] and eng.bm.num_free_blocks == 8
    eng.sched.finish(a, "again")  # already finished: ignored
    assert a.finish_reason == "abort"
    assert eng.sched.num_unfinished == 0
