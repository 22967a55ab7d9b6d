"""The Sampler on hand-made logits, and SamplingParams validation."""
from __future__ import annotations

import math

import pytest
import torch

from asyncllm.layers.sampler import Sampler, SamplingTensors, gather_logprobs, noise_key
from asyncllm.layers.sampling_filters import apply_cutoffs, filter_cutoffs_reference
from asyncllm.sampling_params import SamplingParams
from helpers import seed_every_test

sampler = Sampler()


def tensors(params: list[SamplingParams], vocab: int, seeded_keys: dict[int, int] | None = None):
    """What ModelRunner.prepare_sampling builds, for a list of per-row params; seeded_keys: row -> the
    noise key of a row with a seed (other rows get random keys)."""
    keys = torch.randint(-2**63, 2**63 - 1, (len(params),)).tolist()
    for row, key in (seeded_keys or {}).items():
        keys[row] = key
    return SamplingTensors.build(params, vocab, torch.device("cpu"), keys, sorted((seeded_keys or {}).items()))


def sample(logits: torch.Tensor, params: list[SamplingParams], seeded_keys=None) -> torch.Tensor:
    return sampler(logits, tensors(params, logits.shape[-1], seeded_keys)).token_ids


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(expected_probs)).double()
    expected = expected_probs.double() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token of zero probability"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


# probabilities 0.5, 0.3, 0.15, 0.05 (and a vanishing 5th) at temperature 1
BASE_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
BASE_LOGITS = BASE_PROBS.log()
N = 20000


_seed = seed_every_test(0)


def test_greedy_is_argmax():
    logits = torch.randn(16, 1000)
    out = sample(logits, [SamplingParams(temperature=0)] * 16)
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_rows_in_a_sampling_batch_are_argmax():
    logits = torch.randn(8, 1000)
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.5) for i in range(8)]
    out = sample(logits, params)
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))


@pytest.mark.parametrize("params, plain", [
    ([SamplingParams(temperature=0)] * 2, True), ([SamplingParams(temperature=0), SamplingParams()], True),
    ([SamplingParams(temperature=0.6)], True), ([SamplingParams(), SamplingParams(top_p=0.9)], False),
    ([SamplingParams(top_k=5)], False), ([SamplingParams(temperature=0), SamplingParams(min_p=0.1)], False)])
def test_plain_sampling_is_temperatures_alone(params, plain):
    """SamplingTensors.is_plain (a sampler graph's race can take the step, runner/sampler_graphs.py):
    greedy steps too; any filter makes it eager."""
    assert tensors(params, 100).is_plain is plain


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1),
                                    SamplingParams(temperature=5.0, top_p=1e-6),
                                    SamplingParams(temperature=5.0, min_p=1.0)],
                         ids=["top_k=1", "top_p_tiny", "min_p=1"])
def test_filters_that_keep_only_the_max_equal_greedy(params):
    logits = torch.randn(2000, 64)
    out = sample(logits, [params] * 2000)
    assert torch.equal(out, logits.argmax(-1))


def test_temperature_frequencies_match_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    temperature = 0.7
    out = sample(logits.expand(N, -1).contiguous(), [SamplingParams(temperature=temperature)] * N)
    expected = (logits / temperature).softmax(-1)
    # 4 degrees of freedom: P(chi2 > 30) ~ 5e-6
    assert chi_square(out, expected) < 30
    # and temperature matters: this is far from the temperature-1 distribution
    assert chi_square(out, logits.softmax(-1)) > 100


def test_top_k_frequencies():
    logits = BASE_LOGITS.expand(N, -1).contiguous()
    out = sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * N)
    expected = torch.tensor([0.5, 0.3, 0, 0]) / 0.8
    assert chi_square(out, expected) < 25


def test_top_p_frequencies():
    logits = BASE_LOGITS.expand(N, -1).contiguous()
    # mass above each token: 0, 0.5, 0.8, 0.95 -> top_p=0.7 keeps the first two
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * N)
    assert chi_square(out, torch.tensor([0.5, 0.3, 0, 0]) / 0.8) < 25
    # top_p=0.85 keeps three
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.85)] * N)
    assert chi_square(out, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95) < 25


def test_min_p_frequencies():
    logits = BASE_LOGITS.expand(N, -1).contiguous()
    # threshold 0.4 * 0.5 = 0.2: tokens 0 and 1 stay
    out = sample(logits, [SamplingParams(temperature=1.0, min_p=0.4)] * N)
    assert chi_square(out, torch.tensor([0.5, 0.3, 0, 0]) / 0.8) < 25
    # threshold 0.2 * 0.5 = 0.1: three stay
    out = sample(logits, [SamplingParams(temperature=1.0, min_p=0.2)] * N)
    assert chi_square(out, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95) < 25


def test_rows_with_different_params_in_one_batch():
    n = 4000
    groups = [
        (SamplingParams(temperature=0), None),
        (SamplingParams(temperature=1.0), BASE_PROBS),
        (SamplingParams(temperature=1.0, top_k=2), torch.tensor([0.5, 0.3, 0, 0]) / 0.8),
        (SamplingParams(temperature=1.0, top_p=0.85), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95),
        (SamplingParams(temperature=1.0, min_p=0.4), torch.tensor([0.5, 0.3, 0, 0]) / 0.8),
        (SamplingParams(temperature=1.0, top_k=3, min_p=0.4), torch.tensor([0.5, 0.3, 0, 0]) / 0.8),
    ]
    # interleave the groups' rows so a row's filter must come from its own params
    params = [groups[i % len(groups)][0] for i in range(n * len(groups))]
    logits = BASE_LOGITS.expand(len(params), -1).contiguous()
    out = sample(logits, params)
    for g, (_, expected) in enumerate(groups):
        rows = out[g::len(groups)]
        if expected is None:
            assert torch.all(rows == 0)
        else:
            assert chi_square(rows, expected) < 25, groups[g][0]


def test_top_p_disabled_row_is_untouched_by_other_rows_top_p():
    # a large vocabulary whose float32 cumsum reaches 1.0 before its tail
    logits = torch.randn(2, 151936) * 3
    out = apply_cutoffs(logits, filter_cutoffs_reference(logits, torch.ones(2), top_ps=torch.tensor([1.0, 0.5])))
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1]).any()


def test_seeded_rows_reproducible_and_batch_independent():
    """A seeded row's noise key depends on its seed and token index alone (noise_key): the same
    draws alone or in any row of a batch of differently sampled rows."""
    vocab = 1000
    logits = torch.randn(1, vocab)
    params = SamplingParams(temperature=1.0, seed=123)

    def draw_alone(seed, steps=20):
        return [int(sample(logits, [params], {0: noise_key(seed, step)})) for step in range(steps)]

    def draw_in_batch(seed, row, batch, steps=20):
        out = []
        for step in range(steps):
            batch_logits = torch.randn(batch, vocab)
            batch_logits[row] = logits[0]
            others = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01)] * batch
            others[row] = params
            out.append(int(sample(batch_logits, others, {row: noise_key(seed, step)})[row]))
        return out

    alone = draw_alone(123)
    assert alone == draw_alone(123)
    assert alone == draw_in_batch(123, row=3, batch=5)
    assert alone == draw_in_batch(123, row=0, batch=2)
    assert alone != draw_alone(124)
    assert len(set(alone)) > 5  # it is really sampling


def test_noise_keys_are_int64_and_spread():
    keys = [noise_key(seed, index) for seed in (0, 1, -(2**63), 2**64 - 1) for index in range(50)]
    assert all(-(2**63) <= key < 2**63 for key in keys)
    assert len(set(keys)) == len(keys)
    assert noise_key(5, 3) == noise_key(5, 3) and noise_key(5, 3) != noise_key(6, 3)


# ---- SamplingParams validation ----------------------------------------------------------------
BAD_PARAMS = [
    ("temperature", -1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "x"),
    ("top_p", 0), ("top_p", 1.5),
    ("top_k", 0), ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 2),
    ("max_tokens", 0), ("max_tokens", True),
    ("stop_token_ids", ["a"]), ("stop", [""]), ("seed", "x"),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_sampling_params_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_sampling_params_accepts_and_normalizes_good_values():
    p = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.1, max_tokens=3, seed=7,
                       stop_token_ids=(1, 2), stop="x")
    assert p.greedy and p.stop_token_ids == [1, 2] and p.stop == ["x"]
    assert SamplingParams(stop_token_ids=5).stop_token_ids == [5]
    assert not SamplingParams().greedy


def test_logprobs_from_logits_equal_log_softmax():
    """Chosen log-probabilities, ranks and top alternatives read off the logits equal those of log_softmax."""
    logits = 4 * torch.randn(5, 3000)
    chosen = torch.tensor([0, 17, 2999, 1500, 3])
    reference = logits.log_softmax(dim=-1)
    got = gather_logprobs(logits, chosen, 4)
    torch.testing.assert_close(got.chosen, reference.gather(1, chosen[:, None]).squeeze(1))
    assert torch.equal(got.ranks, (reference > reference.gather(1, chosen[:, None])).sum(-1) + 1)
    top = reference.topk(4, dim=-1)
    assert torch.equal(got.top_ids, top.indices)
    torch.testing.assert_close(got.top_logprobs, top.values)


def test_adjustments_and_masks_leave_the_models_float32_logits_alone():
    """The sampler adjusts its own copy in place: float32 logits (a CUDA graph's output buffer, or
    a float32 model's) come out unchanged, and logprobs stay the raw distribution's."""
    from asyncllm.layers.logits_adjustments import LogitsAdjustments

    logits = torch.randn(3, 64)
    before = logits.clone()
    rows = torch.arange(3)
    adjustments = LogitsAdjustments(ban_rows=torch.tensor([0, 1, 2]), ban_tokens=torch.tensor([5, 6, 7]),
                                    bias_rows=torch.tensor([1]), bias_tokens=torch.tensor([9]),
                                    bias_values=torch.tensor([50.0]))
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[2, 0] = 0  # row 2 may not take tokens 0..31
    params = SamplingTensors(None, None, None, None, [], True, adjustments=adjustments, logprob_rows=rows,
                             num_top_logprobs=2, mask_rows=rows, token_bitmask=bitmask)
    out = Sampler()(logits, params)
    assert torch.equal(logits, before)
    assert out.token_ids[1].item() == 9  # the bias applied to the sampler's copy
    assert out.token_ids[2].item() >= 32
    torch.testing.assert_close(out.logprobs.chosen, before.log_softmax(-1).gather(1, out.token_ids[:, None])[:, 0])


@pytest.mark.parametrize("with_bias", [False, True])
def test_penalties_and_logprobs_on_bf16_logits_equal_their_float32_copy(with_bias):
    """The sampler reads bf16 model logits as their float32 copy: with penalties on every row (the
    penalties' pass makes the float32 copy; after a bias when there is one) and log-probabilities
    from the bf16 logits themselves, the tokens, counts and log-probabilities equal those of the
    float32 copy, bit for bit; the bf16 logits are left alone. Greedy and seeded rows."""
    from asyncllm.layers.logits_adjustments import LogitsAdjustments, TokenCounts

    rows, vocab = 6, 500
    logits = (3 * torch.randn(rows, vocab)).to(torch.bfloat16)
    before = logits.clone()
    temperatures = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.5])
    keys = torch.randint(-2**63, 2**63 - 1, (rows,))
    outputs = []
    for model_logits in (logits, logits.float()):
        counts = TokenCounts(vocab, torch.device("cpu"))
        slots = torch.tensor([counts.acquire(torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(r))
                                             .tolist(), [r, r, 3]) for r in range(rows)])
        adjustments = LogitsAdjustments(
            penalty_rows=torch.arange(rows).flip(0), penalty_slots=slots.flip(0), presence=torch.full((rows,), 0.5),
            frequency=torch.full((rows,), 0.3), repetition=torch.linspace(0.8, 1.5, rows), token_counts=counts,
            ban_rows=torch.tensor([1, 4]), ban_tokens=torch.tensor([7, 9]))
        if with_bias:
            adjustments.bias_rows, adjustments.bias_tokens = torch.tensor([0, 2]), torch.tensor([11, 12])
            adjustments.bias_values = torch.tensor([4.0, -2.5])
        params = SamplingTensors(temperatures, None, None, None, [(r, keys[r].item()) for r in range(rows)],
                                 False, keys=keys, adjustments=adjustments, logprob_rows=torch.tensor([0, 2, 3, 5]),
                                 num_top_logprobs=3)
        out = sampler(model_logits, params)
        outputs.append((out, counts.output_counts))
    (got, got_counts), (expected, expected_counts) = outputs
    assert torch.equal(logits, before)
    assert torch.equal(got.token_ids, expected.token_ids) and torch.equal(got_counts, expected_counts)
    for field in ("chosen", "ranks", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(got.logprobs, field), getattr(expected.logprobs, field)), field
