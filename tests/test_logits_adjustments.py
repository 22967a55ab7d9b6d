"""The sampler's logits adjustments and log-probabilities on random logits and token histories,
against plain-PyTorch loops written from the definitions (OpenAI's presence and frequency penalties,
Hugging Face's repetition penalty), including token counts kept on the device across steps."""
from __future__ import annotations

import random

import pytest
import torch

from asyncllm.engine.sequence import Sequence
from asyncllm.engine.step_planner import request_sampling
from asyncllm.layers.sampler import Sampler
from asyncllm.runner.sampling_inputs import SamplingInputs
from asyncllm.sampling_params import SamplingParams
from asyncllm.step_plan import StepPlan
from helpers import seed_every_test

V = 64
_seed = seed_every_test(0)



def adjust(adjustments, logits: torch.Tensor) -> torch.Tensor:
    """The adjusted logits (a new tensor), checking that the input is left as it was."""
    before = logits.clone()
    out = adjustments.adjusted(logits)
    assert torch.equal(logits, before) and out.dtype == torch.float32
    return out

def reference_adjust(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    out = logits.clone()
    for row, seq in enumerate(seqs):
        p = seq.params
        prompt, output = seq.token_ids[:seq.num_prompt_tokens], seq.completion_token_ids
        if p.allowed_token_ids is not None:
            keep = out[row, p.allowed_token_ids].clone()
            out[row] = float("-inf")
            out[row, p.allowed_token_ids] = keep
        for token, bias in (p.logit_bias or {}).items():
            out[row, token] += bias
        if len(output) < p.min_tokens:
            out[row, seq.early_stop_ids] = float("-inf")
        for token in set(prompt) | set(output):
            x = out[row, token]
            out[row, token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in output:
            out[row, token] -= p.frequency_penalty
        for token in set(output):
            out[row, token] -= p.presence_penalty
    return out


def sampling_plan(inputs: SamplingInputs, seqs: list[Sequence]) -> StepPlan:
    """A step whose sampling rows are seqs; the runner's table learns those it does not have yet
    (their settings and tokens so far), as ModelRunner.launch does with a plan's new requests."""
    plan = StepPlan([], [], [], [], [], [], [seq.uid for seq in seqs],
                    new_requests=[request_sampling(seq) for seq in seqs if seq.uid not in inputs.table])
    for request in plan.new_requests:
        inputs.table.add(request)
    return plan


def build(seqs: list[Sequence], prev_sampled=None, inputs: SamplingInputs | None = None):
    """SamplingInputs.build of a step whose sampling rows are seqs (a new SamplingInputs by default)."""
    inputs = inputs or SamplingInputs(V, torch.device("cpu"))
    return inputs.build(sampling_plan(inputs, seqs), prev_sampled)


def random_seq(i: int, rng: random.Random, **params) -> Sequence:
    prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
    seq = Sequence(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=100, **params), block_size=16)
    seq.token_ids += [rng.randrange(V) for _ in range(rng.randrange(0, 12))]  # a history already generated
    return seq


def test_penalties_match_the_reference_across_steps():
    rng = random.Random(0)
    seqs = [random_seq(i, rng, presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                       repetition_penalty=rng.uniform(0.5, 2.0)) for i in range(5)]
    seqs.insert(2, random_seq(9, rng))  # a row with no penalty between them: left alone
    inputs, sampler = SamplingInputs(V, torch.device("cpu")), Sampler()
    for step in range(6):
        logits = torch.randn(len(seqs), V) * 3
        plan = sampling_plan(inputs, seqs)
        arrays = inputs.plan(plan)
        tensors = inputs.tensors(arrays, [torch.from_numpy(a) for a in arrays.arrays.values()])
        adjusted = adjust(tensors.adjustments, logits)
        torch.testing.assert_close(adjusted, reference_adjust(logits, seqs))
        assert torch.equal(adjusted[2], logits[2])
        sampled = sampler(logits, tensors).token_ids  # counts the sampled tokens on the device
        assert torch.equal(sampled, adjusted.argmax(-1))
        for seq, token in zip(seqs, sampled.tolist()):
            seq.token_ids.append(token)
        inputs.table.recorded(inputs.table.launched(plan, arrays.rows, arrays.flags, arrays.any_flags), plan,
                              sampled.tolist(), None)  # the runner's tokens, as a step's result is read
    assert inputs.token_counts.capacity >= 5 and len(inputs.token_counts.free_slots) == inputs.token_counts.capacity - 5
    for seq in seqs:
        inputs.release(seq.uid)
    assert len(inputs.table) == 0
    assert len(inputs.token_counts.free_slots) == inputs.token_counts.capacity


def test_bias_bans_allowed_and_min_tokens_match_the_reference():
    rng = random.Random(1)
    seqs = [random_seq(0, rng, logit_bias={3: 5.0, 7: -100.0}),
            random_seq(1, rng, allowed_token_ids=[1, 2, 40]),
            random_seq(2, rng, min_tokens=50),
            random_seq(3, rng, min_tokens=1, logit_bias={5: 1.5}, repetition_penalty=1.3, allowed_token_ids=[5, 6])]
    for seq in seqs[2:]:
        seq.early_stop_ids = [0, 63]
    tensors, _ = build(seqs)
    logits = torch.randn(len(seqs), V)
    torch.testing.assert_close(adjust(tensors.adjustments, logits), reference_adjust(logits, seqs))


def test_penalties_on_every_row_come_first_and_commute_with_the_bans():
    """Without a logit bias the penalties' pass goes first (it makes the float32 copy): the same
    logits as the reference's order (bans and allowed tokens, then penalties), -inf where banned."""
    rng = random.Random(2)
    penalties = dict(presence_penalty=0.4, frequency_penalty=-0.3, repetition_penalty=1.2)
    seqs = [random_seq(0, rng, allowed_token_ids=[1, 2, 40], **penalties),
            random_seq(1, rng, min_tokens=50, **penalties),
            random_seq(2, rng, **penalties)]
    for seq in seqs:
        seq.early_stop_ids = [0, 63]
    tensors, _ = build(seqs)
    assert tensors.adjustments.bias_rows is None and len(tensors.adjustments.penalty_rows) == len(seqs)
    logits = torch.randn(len(seqs), V).to(torch.bfloat16)
    adjusted = adjust(tensors.adjustments, logits)
    expected = reference_adjust(logits.float(), seqs)
    torch.testing.assert_close(adjusted, expected)
    assert torch.equal(adjusted.isinf(), expected.isinf())


def test_logprobs_of_the_rows_that_asked():
    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(temperature=1.0, logprobs=k), block_size=16)
            for i, k in enumerate([3, None, 0, 5])]
    tensors, ks = build(seqs)
    assert ks == [3, -1, 0, 5] and tensors.logprob_rows.tolist() == [0, 2, 3] and tensors.num_top_logprobs == 5
    logits = torch.randn(4, V)
    out = Sampler()(logits, tensors)
    expected = logits[[0, 2, 3]].log_softmax(-1)
    chosen = out.token_ids[[0, 2, 3]]
    torch.testing.assert_close(out.logprobs.chosen, expected.gather(1, chosen[:, None]).squeeze(1))
    assert out.logprobs.ranks.tolist() == [int((row > row[t]).sum()) + 1 for row, t in zip(expected, chosen.tolist())]
    torch.testing.assert_close(out.logprobs.top_logprobs, expected.topk(5).values)


def test_plain_requests_build_nothing_extra():
    seqs = [Sequence("r", [1, 2], SamplingParams(temperature=0.7, top_k=5), block_size=16)]
    tensors, ks = build(seqs)
    assert tensors.adjustments is None and tensors.logprob_rows is None and ks is None


@pytest.mark.parametrize("bad", [dict(n=0), dict(logprobs=21), dict(prompt_logprobs=-1), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=float("nan")), dict(repetition_penalty=0),
                                 dict(repetition_penalty=1e-50), dict(repetition_penalty=1e39),
                                 dict(min_tokens=-1), dict(min_tokens=65), dict(logit_bias={"1": 1.0}),
                                 dict(logit_bias={1: 101}), dict(logit_bias=[1]), dict(allowed_token_ids=[]),
                                 dict(allowed_token_ids=[-1]), dict(bad_words=[" "]), dict(skip_special_tokens="no"),
                                 dict(spaces_between_special_tokens=None)])
def test_bad_values_name_the_field(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"SamplingParams.{name}:"):
        SamplingParams(**bad)


def test_snapshot_owns_its_containers():
    params = SamplingParams(logit_bias={1: 1.0}, allowed_token_ids=[1, 2], bad_words=["x"])
    snap = params.snapshot()
    params.logit_bias[2] = 5.0
    params.allowed_token_ids.append(3)
    params.bad_words.append("y")
    assert snap.logit_bias == {1: 1.0} and snap.allowed_token_ids == [1, 2] and snap.bad_words == ["x"]


def bad_word_bans(history: list[int], words: list[list[int]]) -> set[int]:
    """Reference: the last tokens of the words whose other tokens end the generated history (as vLLM,
    a bad word's other tokens are looked for among the generated tokens only)."""
    return {w[-1] for w in words
            if len(w) == 1 or (len(w) - 1 <= len(history) and history[len(history) - len(w) + 1:] == w[:-1])}


@pytest.mark.parametrize("pending_value", [7, 8, 9])
def test_bad_word_hanging_on_the_token_in_flight_is_banned_on_the_device(pending_value):
    words = [[5], [7, 11], [3, 7, 12], [4, 7, 13], [8, 14], [3, 8, 9, 15], [2, 3, 8, 16]]
    seqs = []
    for i in range(3):  # its pending token is row 2 - i of the previous step's ids
        seq = Sequence(f"r{i}", [1, 2], SamplingParams(temperature=0, max_tokens=100, bad_words=["x"]), block_size=16)
        seq.token_ids += [3]
        seq.num_in_flight = 1  # the engine's count; its value is the runner's (prev_sampled)
        seq.bad_word_ids = words
        seqs.append(seq)
    values = [pending_value, 7 + (pending_value - 6) % 3, 7 + (pending_value - 5) % 3]  # each of 7, 8, 9 once
    prev_sampled = torch.tensor(values[::-1], dtype=torch.int64)  # seq i's pending token is values[i]
    inputs = SamplingInputs(V, torch.device("cpu"))
    previous = sampling_plan(inputs, seqs[::-1])  # the step in flight samples seq i at row 2 - i
    arrays = inputs.plan(previous)
    inputs.table.launched(previous, arrays.rows, arrays.flags, arrays.any_flags)
    assert [inputs.table.entries[seq.uid].token_ids for seq in seqs] == [[1, 2, 3]] * 3  # known values only
    tensors, _ = build(seqs, prev_sampled, inputs)
    adjusted = adjust(tensors.adjustments, torch.zeros(3, V))
    for row in range(3):
        # what the host would ban once it knew the pending token ([2, 3, 8, 16] starts in the prompt)
        expected = bad_word_bans([3, values[row]], words)
        assert {t for t in range(V) if adjusted[row, t] == float("-inf")} == expected
        assert not adjusted[row].isnan().any()
    expected = bad_word_bans([3, pending_value], words)
    # the host bans alone (the last token known) still apply, without a previous step
    seqs[0].token_ids.append(pending_value)
    seqs[0].num_in_flight = 0
    tensors, _ = build(seqs[:1])
    adjusted = adjust(tensors.adjustments, torch.zeros(1, V))
    assert {t for t in range(V) if adjusted[0, t] == float("-inf")} == expected
