"""helpers.py's comparison of two greedy runs (used by the GPU and tensor-parallel tests, where
bf16 rounding may flip a near-tie): it must pass equal runs and catch runs that really differ."""
from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from helpers import assert_greedy_runs_match, generate_with_logits

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 190)), [7] * 40]


def fake_run(tokens: list[list[int]], vocab: int = 50, seed: int = 0):
    """Logits whose argmax at each step is the given token, clear of the runner-up by 1."""
    g = torch.Generator().manual_seed(seed)
    logits = []
    for seq in tokens:
        steps = []
        for token in seq:
            row = torch.randn(vocab, generator=g)
            row[token] = row.max() + 1.0
            steps.append(row)
        logits.append(steps)
    return tokens, logits


def test_engine_runs_with_different_batching_match(tiny_qwen3):
    with LLM(tiny_qwen3, max_num_batched_tokens=4096) as llm:
        reference = generate_with_logits(llm, PROMPTS, GREEDY)
    # 32-token steps: the 90-token prompt is prefilled in chunks over three steps
    with LLM(tiny_qwen3, max_num_batched_tokens=32, kvcache_block_size=16) as llm:
        chunked = generate_with_logits(llm, PROMPTS, GREEDY)
    assert [len(steps) for steps in reference[1]] == [8, 8, 8]
    stats = assert_greedy_runs_match(reference, chunked, logits_rtol=1e-4)
    assert stats["num_identical"] == 3 and stats["worst_logits_rtol"] < 1e-4
    # the same tokens from logits that are off: caught
    wrong = (chunked[0], [[step * 1.1 for step in seq] for seq in chunked[1]])
    with pytest.raises(AssertionError, match="sequence 0 step 0: logits differ"):
        assert_greedy_runs_match(reference, wrong, logits_rtol=1e-2)


def test_a_flip_is_allowed_only_on_a_near_tie():
    reference = fake_run([[3, 4, 5, 6]])
    tokens, logits = [[3, 4, 9, 9]], [[t.clone() for t in reference[1][0]]]
    # the reference's step 2: token 9 close behind token 5, so rounding may pick either
    logits[0][2][9] = reference[1][0][2][5] - 1e-3
    reference[1][0][2][9] = reference[1][0][2][5] - 1e-3
    logits[0][2][5] -= 2e-3
    stats = assert_greedy_runs_match(reference, (tokens, logits), logits_rtol=1e-2)
    assert stats["first_divergences"] == [2]
    # a clear winner replaced, by a change the logits tolerance alone lets through: not a near-tie
    reference = fake_run([[3, 4, 5, 6]])
    reference[1][0][2][9] = reference[1][0][2][5] - 1.0
    logits = [[t.clone() for t in reference[1][0]]]
    logits[0][2][9] = reference[1][0][2][5] + 0.01
    rtol = 0.15
    assert (logits[0][2] - reference[1][0][2]).norm() / reference[1][0][2].norm() < rtol
    assert 1.0 > 5 * rtol * reference[1][0][2].std()
    with pytest.raises(AssertionError, match="sequence 0 step 2: token 9 instead of 5.*not a near-tie"):
        assert_greedy_runs_match(reference, ([[3, 4, 9, 9]], logits), logits_rtol=rtol)


def test_different_lengths_and_counts_are_reported():
    with pytest.raises(AssertionError, match="1 reference sequences, 2 compared"):
        assert_greedy_runs_match(fake_run([[1, 2]]), fake_run([[1, 2], [3]]), logits_rtol=1e-2)
    with pytest.raises(AssertionError, match="sequence 0: 2 tokens vs 1"):
        assert_greedy_runs_match(fake_run([[1, 2]]), fake_run([[1]]), logits_rtol=1e-2)


def test_prompts_must_differ(tiny_qwen3):
    with LLM(tiny_qwen3) as llm:
        with pytest.raises(ValueError, match="every prompt must differ"):
            generate_with_logits(llm, [[1, 2], [1, 2]], GREEDY)
