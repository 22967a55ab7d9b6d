"""The batch-1 decode graph's tiling tuner (runner/decode_tuning.py): what it tries and what it keeps.

The timing itself needs CUDA graphs (tests/test_gpu.py runs engines with it on); here the choice
logic runs against a stand-in step time."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from asyncllm.kernels.skinny_gemm import SkinnyConfig, candidate_configs
from asyncllm.layers import skinny_linear
from asyncllm.runner import decode_tuning

CPU = torch.device("cpu")


def key(rows: int, n: int, k: int) -> tuple:
    return (CPU, torch.bfloat16, rows, n, k, False)


def test_batch1_alternatives_try_the_grouped_loop_and_the_other_candidates(monkeypatch):
    lm_head, down, qkv, cublas = key(1, 151936, 1024), key(1, 1024, 3072), key(1, 6144, 4096), key(1, 1024, 2048)
    fma, gated = SkinnyConfig(False, 16, 512, 1, 4), SkinnyConfig(False, 4, 1024, 1, 4)
    monkeypatch.setattr(skinny_linear, "_choices", {
        qkv: fma, down: fma, lm_head: SkinnyConfig(True, 64, 128, 1, 4), cublas: None,
        key(2, 6144, 4096): fma})  # two rows: not the batch-1 graph's
    monkeypatch.setattr(skinny_linear, "_gated_choices", {down: gated})
    monkeypatch.setattr(skinny_linear, "_settled", set())
    alternatives = skinny_linear.batch1_alternatives()
    # largest weight first; the plain down projection is not what the step runs (its gated form is)
    assert [(g, k) for g, k, _ in alternatives] == [(False, lm_head), (False, qkv), (True, down)]
    for gated_form, decided_key, tilings in alternatives:
        decision = (skinny_linear._gated_choices if gated_form else skinny_linear._choices)[decided_key]
        assert tilings[0] == decision and len(set(tilings)) == len(tilings)
        assert not any(t.dot and t.grouped for t in tilings)
        candidates = candidate_configs(1, decided_key[3], decided_key[4], 132)[:skinny_linear.MAX_CANDIDATES]
        assert set(candidates) <= set(tilings)
        assert replace(candidates[0], grouped=True) in tilings
        if not decision.dot:
            assert tilings[1] == replace(decision, grouped=True)
        deeper = [t for t in tilings if t.grouped and not decision.dot
                  and (t.block_n, t.block_k) == (decision.block_n // 4, decision.block_k * 4)]
        # a 4x deeper tile for the FMA decisions with room in N and K: qkv (n16 k512 of K 4096), not the gated down (n4)
        assert len(deeper) == (decided_key == qkv)
    skinny_linear.settle(False, qkv)  # tuned once per process: a later engine keeps it
    assert [k for _, k, _ in skinny_linear.batch1_alternatives()] == [lm_head, down]


def test_choose_by_step_time_keeps_a_tiling_only_for_a_clear_gain():
    first, close, faster, fastest = (SkinnyConfig(False, n, 256, 1, 4) for n in (2, 4, 8, 16))
    a, b = key(1, 4096, 1024), key(1, 1024, 3072)
    step = {first: 1.0, close: 1.0 - decode_tuning.MIN_GAIN / 2, faster: 0.99, fastest: 0.95}
    assert decode_tuning.MIN_GAIN_MS < 0.01
    current = {}
    calls = []

    def set_choice(gated, decided_key, tiling):
        calls.append((gated, decided_key, tiling))
        current[decided_key] = tiling

    def step_ms():  # the step's time: the sum of the two keys' (only the changed one differs)
        if current.get(b) is broken:
            raise RuntimeError("out of resources: shared memory")
        return sum(step[t] for t in current.values())

    broken = SkinnyConfig(False, 32, 256, 1, 4)

    kept = decode_tuning.choose_by_step_time(
        [(False, a, [first, close, faster, fastest]), (True, b, [first, broken, close])], set_choice, step_ms)
    assert current == {a: fastest, b: first}, "b's gain is within noise (and a tiling that fails drops out)"
    assert [(k, t) for k, t, _, _ in kept] == [(a, fastest), (b, first)]
    assert kept[0][2] > kept[0][3]
    assert calls[-1] == (True, b, first) and {g for g, k, _ in calls if k == b} == {True}


def test_tuning_is_idle_when_turned_off_or_with_nothing_to_tune(monkeypatch):
    class Graphs:  # any use of the graphs fails the test
        def __getattr__(self, name):
            raise AssertionError(f"graphs.{name} used")

    def no_batch(context):
        raise AssertionError("no batch needed")

    monkeypatch.setenv("ASYNCLLM_DECODE_TUNING", "0")
    monkeypatch.setattr(skinny_linear, "batch1_alternatives", lambda: [(False, key(1, 8, 8), [object(), object()])])
    decode_tuning.tune_batch1_projections(Graphs(), no_batch)
    monkeypatch.setenv("ASYNCLLM_DECODE_TUNING", "1")
    monkeypatch.setattr(skinny_linear, "batch1_alternatives", lambda: [(False, key(1, 8, 8), [object()])])
    decode_tuning.tune_batch1_projections(Graphs(), no_batch)  # one tiling: nothing to try


def test_pinned_choices_are_describe_choices_read_back_and_settled(monkeypatch):
    """bench_latency --skinny-choices: another run's described decisions (its JSON) taken as they were, and
    settled, so the batch-1 tuner leaves them; every label form round-trips; a bad label names itself."""
    for name in ("_choices", "_gated_choices"):
        monkeypatch.setattr(skinny_linear, name, {})
    monkeypatch.setattr(skinny_linear, "_settled", set())
    fma, dot = SkinnyConfig(False, 16, 512, 1, 4, grouped=True), SkinnyConfig(True, 64, 128, 2, 8, num_stages=4)
    decided = {(False, key(1, 151936, 1024)): fma, (False, key(1, 1024, 3072)): dot, (True, key(1, 1024, 3072)): None,
               (False, (CPU, torch.bfloat16, 8, 40, 48, True)): None}
    for (gated, decided_key), config in decided.items():
        skinny_linear.set_choice(gated, decided_key, config)
    described = skinny_linear.describe_choices()
    assert described == {"1 rows x (1024, 3072)": dot.label(), "1 rows x (151936, 1024)": fma.label(),
                         "8 rows x (40, 48) + bias": "cuBLAS", "1 rows x (1024, 3072) gated": "unfused"}
    for name in ("_choices", "_gated_choices"):
        monkeypatch.setattr(skinny_linear, name, {})
    assert skinny_linear.pin_choices(described, CPU, torch.bfloat16) == 4
    assert {**{(False, k): c for k, c in skinny_linear.choices().items()},
            **{(True, k): c for k, c in skinny_linear.gated_choices().items()}} == decided
    assert skinny_linear.batch1_alternatives() == []  # settled: nothing left to tune
    for config in candidate_configs(1, 151936, 1024, 132) + candidate_configs(16, 6144, 1024, 132):
        assert SkinnyConfig.from_label(config.label()) == config
    with pytest.raises(ValueError, match=r"skinny GEMM choice '1 rows x \(8, 8\)': 'fma n16'"):
        skinny_linear.pin_choices({"1 rows x (8, 8)": "fma n16"}, CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="skinny GEMM choice '1 rows x 8'"):
        skinny_linear.pin_choices({"1 rows x 8": "cuBLAS"}, CPU, torch.bfloat16)
