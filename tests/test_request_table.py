"""The runner's request table (runner/request_table.py): a step's sampling arrays gathered from it
equal the per-request construction they replace (SamplingTensors.host_arrays over the requests'
SamplingParams, seed keys from noise_key), rows are reused without leaking a request's settings or
tokens into another's, and tokens in flight are tracked across overlapped steps."""
from __future__ import annotations

import random

import numpy as np
import torch

from asyncllm.engine.sequence import Sequence
from asyncllm.engine.step_planner import request_sampling
from asyncllm.layers.sampler import SamplingTensors, noise_key
from asyncllm.runner.request_table import HISTORY, banned_token_ids
from asyncllm.runner.sampling_inputs import SamplingInputs
from asyncllm.sampling_params import SamplingParams
from asyncllm.step_plan import StepPlan

V = 64


def random_params(rng: random.Random) -> SamplingParams:
    sampled = rng.random() < 0.7
    return SamplingParams(temperature=rng.choice([0.5, 1.0, 1.7]) if sampled else 0.0, max_tokens=100,
                          top_k=rng.choice([-1, -1, 5, 80]), top_p=rng.choice([1.0, 1.0, 0.9]),
                          min_p=rng.choice([0.0, 0.0, 0.1]), seed=rng.choice([None, None, rng.randrange(1 << 40)]),
                          logprobs=rng.choice([None, None, 0, 3]), presence_penalty=rng.choice([0.0, 0.0, 0.5]))


def plan_of(inputs: SamplingInputs, seqs: list[Sequence]) -> StepPlan:
    plan = StepPlan([], [], [], [], [], [], [seq.uid for seq in seqs],
                    new_requests=[request_sampling(seq) for seq in seqs if seq.uid not in inputs.table])
    for request in plan.new_requests:
        inputs.table.add(request)
    return plan


def test_gathered_arrays_equal_the_per_request_construction():
    """Over random mixes of settings, with requests leaving and others taking their rows: every
    array equals host_arrays' over the rows' SamplingParams (the keys: consecutive from one base,
    a seeded row's noise_key of its completion index), and the flags' groups are built exactly
    when some row needs them."""
    rng = random.Random(0)
    inputs = SamplingInputs(V, torch.device("cpu"))
    live: list[Sequence] = []
    for step in range(40):
        for seq in rng.sample(live, k=min(len(live), rng.randrange(3))):  # some end: their rows free
            live.remove(seq)
            inputs.release(seq.uid)
        for i in range(rng.randrange(4)):
            seq = Sequence(f"r{step}.{i}", [1, 2, 3], random_params(rng), block_size=16)
            seq.token_ids += [5] * rng.randrange(4)  # a history already generated
            live.append(seq)
        seqs = rng.sample(live, k=len(live))  # any order of rows
        plan = plan_of(inputs, seqs)
        out = inputs.plan(plan)
        params = [seq.params for seq in seqs]
        seeded = [row for row, p in enumerate(params) if p.seed is not None and p.temperature > 0]
        keys = out.arrays.get("keys")
        expected = SamplingTensors.host_arrays(params, V, keys)
        assert {name for name in out.arrays if name in SamplingTensors.HOST_ARRAYS} == expected.keys()
        for name, array in expected.items():
            np.testing.assert_array_equal(out.arrays[name], array, err_msg=name)
            assert out.arrays[name].dtype == array.dtype, name
        if keys is not None:  # a seeded row's key is its completion index's; the others consecutive
            assert [int(keys[row]) for row in seeded] == [
                noise_key(seqs[row].params.seed, seqs[row].num_completion_tokens) for row in seeded]
            assert len({int(keys[row]) - row for row in range(len(seqs)) if row not in seeded}) <= 1
        assert out.seeded_rows == [(row, int(keys[row])) for row in seeded]
        asked = [-1 if p.logprobs is None else p.logprobs for p in params]
        assert out.logprob_ks == (asked if any(k >= 0 for k in asked) else None)
        assert out.adjusts == any(p.adjusts_logits for p in params)
        inputs.table.recorded(inputs.table.launched(plan, out.rows, out.flags, out.any_flags), plan,
                              [7] * len(seqs), None)
        for seq in seqs:
            seq.token_ids.append(7)
    for seq in live:
        inputs.release(seq.uid)
    assert len(inputs.table) == 0 and not inputs.table.flags.any() and (inputs.table.pending_row == -1).all()
    assert len(inputs.token_counts.free_slots) == inputs.token_counts.capacity


def test_tokens_in_flight_across_overlapped_steps():
    """Step S+1 is launched before S is read (overlap): S's result appends S's token and leaves
    S+1's in flight; a request that ended while S ran is skipped, and its row, reused by a new
    request, keeps the new request's state."""
    inputs = SamplingInputs(V, torch.device("cpu"))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=100)
    a, b = (Sequence(name, [1, 2], params, block_size=16) for name in "ab")
    first = plan_of(inputs, [a, b])
    out = inputs.plan(first)
    assert (out.flags & HISTORY).all()  # seeded: the key reads the completion index
    step_s = inputs.table.launched(first, out.rows, out.flags, out.any_flags)
    second = plan_of(inputs, [b, a])  # the next step, b at row 0 now
    out2 = inputs.plan(second)
    # each seed key counts the token in flight: completion index 1
    assert sorted(out2.seeded_rows) == sorted([(0, noise_key(3, 1)), (1, noise_key(3, 1))])
    step_s1 = inputs.table.launched(second, out2.rows, out2.flags, out2.any_flags)
    inputs.release(b.uid)  # b ends while step S runs
    c = Sequence("c", [9, 9, 9], SamplingParams(temperature=0.0, bad_words=["x"], max_tokens=9), block_size=16)
    c.bad_word_ids = [[4, 5]]
    plan_of(inputs, [c])
    assert inputs.table.entries[c.uid].row == out.rows[1]  # b's row, reused
    inputs.table.recorded(step_s, first, [11, 12], None)
    table = inputs.table
    assert table.entries[a.uid].token_ids == [1, 2, 11] and table.entries[c.uid].token_ids == [9, 9, 9]
    assert table.pending_row[table.entries[a.uid].row] == 1  # S+1's token for a, at its row there
    assert table.pending_row[table.entries[c.uid].row] == -1
    inputs.table.recorded(step_s1, second, [21, 22], None)
    assert table.entries[a.uid].token_ids == [1, 2, 11, 22] and table.pending_row[table.entries[a.uid].row] == -1


def test_bans_with_drafts_and_the_token_in_flight_match_the_reference():
    """banned_token_ids over random histories: min_tokens' stop ids below min_tokens, a bad word's
    last token when the tokens before it end the generated history (drafts taken as generated), and
    with a token in flight each word whose prefix hangs on it, as (value it must be, token banned)."""
    rng = random.Random(3)
    inputs = SamplingInputs(V, torch.device("cpu"))
    for trial in range(200):
        words = [[rng.randrange(6) for _ in range(rng.randrange(1, 4))] for _ in range(3)]
        seq = Sequence(f"r{trial}", [1, 2], SamplingParams(temperature=0, max_tokens=50, min_tokens=rng.randrange(6),
                                                          bad_words=["x"]), block_size=16)
        seq.token_ids += [rng.randrange(6) for _ in range(rng.randrange(5))]
        seq.early_stop_ids, seq.bad_word_ids = [60, 61], words
        plan_of(inputs, [seq])
        entry, row = inputs.table.entries[seq.uid], inputs.table.entries[seq.uid].row
        pending = rng.random() < 0.5
        drafts = [] if pending else [rng.randrange(6) for _ in range(rng.randrange(3))]
        inputs.table.pending_row[row] = 0 if pending else -1
        banned, if_pending = banned_token_ids(inputs.table, row, entry, drafts)
        generated = seq.completion_token_ids + drafts
        num_generated = len(generated) + pending
        expected = [60, 61] if num_generated < seq.params.min_tokens else []
        expected_if = []
        for word in words:
            if len(word) == 1:
                expected.append(word[0])
            elif len(word) - 1 <= num_generated:
                if not pending and generated[len(generated) - len(word) + 1:] == word[:-1]:
                    expected.append(word[-1])
                elif pending and (len(word) == 2 or generated[len(generated) - len(word) + 2:] == word[:-2]):
                    expected_if.append((word[-2], word[-1]))
        assert (banned, if_pending) == (expected, expected_if), (generated, pending, words)
        inputs.release(seq.uid)


def test_only_requests_whose_sampling_reads_their_tokens_send_them():
    # a plain request's prompt is neither copied nor sent; a seeded one's tokens so far are, as a
    # copy: the engine's later tokens do not reach the runner's list but through recorded()
    plain = Sequence("plain", [1, 2, 3], SamplingParams(temperature=0.7, max_tokens=5), block_size=16)
    seeded = Sequence("seeded", [1, 2, 3], SamplingParams(temperature=0.7, seed=1, max_tokens=5), block_size=16)
    penalized = Sequence("pen", [1, 2, 3], SamplingParams(presence_penalty=0.5, max_tokens=5), block_size=16)
    assert request_sampling(plain).token_ids == []
    for seq in (seeded, penalized):
        settings = request_sampling(seq)
        assert settings.token_ids == [1, 2, 3] and settings.token_ids is not seq.token_ids
        seq.token_ids.append(9)
        assert settings.token_ids == [1, 2, 3]
