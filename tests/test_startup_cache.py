"""The start-up cache (asyncllm/startup_cache.py): what start-up measures, kept on disk by fingerprint.

The measurements themselves need a GPU (tests/test_gpu.py); here the store runs on CPU with the
measuring functions replaced by fakes: the fingerprint and the file it names, a miss measured and
stored, a hit read without measuring, a corrupt or foreign file ignored, the atomic write, the
switch that turns it off, and the three wiring points (skinny GEMM, decode tuning, calibration)."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from asyncllm import startup_cache
from asyncllm.engine.options import make_config
from asyncllm.engine.step_budget import StepTimeModel, calibration_fits, calibration_shapes
from asyncllm.kernels.skinny_gemm import SkinnyConfig
from asyncllm.layers import skinny_linear
from asyncllm.runner import decode_tuning
from asyncllm.startup_cache import StartupDecisions

FAKE_GPU = {"type": "cuda", "name": "NVIDIA H200", "capability": [9, 0], "sms": 132, "driver": 12080}
CUDA = torch.device("cuda")  # never used as a device here: device_description is faked


@pytest.fixture
def config(tiny_qwen3):
    return make_config(tiny_qwen3, {"device": "cpu", "num_kvcache_blocks": 8})


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A fresh ASYNCLLM_CACHE, Triton's variable unset, the start-up cache on, and a fake GPU."""
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # so that the undo removes what the engine's code sets
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.delenv("ASYNCLLM_STARTUP_CACHE", raising=False)
    monkeypatch.setattr(startup_cache, "device_description", lambda device: dict(FAKE_GPU))
    return tmp_path / "cache"


class Measure:
    """A stand-in measurement: returns answer, counts its calls."""

    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.answer


# ---- the fingerprint and the file it names ----------------------------------------------------------
def test_the_fingerprint_names_the_gpu_versions_code_model_shapes_and_settings(config, cache):
    prints = startup_cache.fingerprint(config, CUDA)
    hf = config.hf_config
    assert prints["device"] == FAKE_GPU
    assert prints["model"] == {"type": "qwen3", "hidden": hf.hidden_size, "intermediate": hf.intermediate_size,
                               "heads": hf.num_attention_heads, "kv_heads": hf.num_key_value_heads,
                               "head_dim": hf.head_dim, "vocab": hf.vocab_size, "layers": hf.num_hidden_layers}
    assert prints["versions"]["torch"] == torch.__version__ and len(prints["versions"]["code"]) == 64
    assert prints["dtype"] == "torch.float32" and prints["tensor_parallel_size"] == 1
    assert prints["config"]["max_num_seqs"] == config.max_num_seqs
    assert prints["settings"] == {"ASYNCLLM_PDL": True, "ASYNCLLM_SKINNY_GEMM": True, "ASYNCLLM_DECODE_TUNING": True}
    json.dumps(prints)  # stored as JSON


def test_each_fingerprint_has_its_own_file_under_the_cache(config, cache, monkeypatch, tiny_qwen3):
    first = StartupDecisions.opened_for(config, CUDA)
    assert os.path.dirname(first.path) == str(cache / "startup")
    assert StartupDecisions.opened_for(config, CUDA).path == first.path  # the same engine again: the same file
    other_settings = make_config(tiny_qwen3, {"device": "cpu", "num_kvcache_blocks": 8, "max_num_seqs": 7})
    assert StartupDecisions.opened_for(other_settings, CUDA).path != first.path
    monkeypatch.setenv("ASYNCLLM_PDL", "0")
    assert StartupDecisions.opened_for(config, CUDA).path != first.path
    monkeypatch.delenv("ASYNCLLM_PDL")
    monkeypatch.setattr(startup_cache, "device_description", lambda device: dict(FAKE_GPU, driver=12090))
    assert StartupDecisions.opened_for(config, CUDA).path != first.path


def test_a_cuda_engine_places_tritons_cache_under_the_projects_unless_told_otherwise(config, cache, monkeypatch,
                                                                                       tmp_path):
    StartupDecisions.opened_for(config, CUDA)
    assert os.environ["TRITON_CACHE_DIR"] == str(cache / "triton") and os.path.isdir(cache / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # the user's own: kept
    StartupDecisions.opened_for(config, CUDA)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_off_with_the_setting_and_on_cpu(config, cache, monkeypatch):
    monkeypatch.setenv("ASYNCLLM_STARTUP_CACHE", "0")
    off = StartupDecisions.opened_for(config, CUDA)
    assert off.path is None and "TRITON_CACHE_DIR" not in os.environ
    measure = Measure(3)
    assert off.remembered("kind", [1], measure) == 3 and off.remembered("kind", [1], measure) == 3
    assert measure.calls == 2 and not os.path.exists(cache)
    monkeypatch.setenv("ASYNCLLM_STARTUP_CACHE", "1")
    on_cpu = StartupDecisions.opened_for(config, torch.device("cpu"))  # CPU measures nothing
    assert on_cpu.path is None and "TRITON_CACHE_DIR" not in os.environ


# ---- hits, misses, bad files, the write -------------------------------------------------------------
def store(cache, fingerprint=None) -> StartupDecisions:
    return StartupDecisions(str(cache / "startup" / "decisions.json"), fingerprint or {"gpu": "H200"})


def test_a_miss_is_measured_and_stored_and_a_later_start_up_reads_it(cache):
    first = store(cache)
    measure = Measure([[256, 0, 1.5], [256, 16, 1.75]])
    assert first.remembered("calibration", [[256, 0], [256, 16]], measure) == measure.answer
    assert (measure.calls, first.num_measured, first.num_read) == (1, 1, 0)
    again = store(cache)  # the next process
    assert again.remembered("calibration", [[256, 0], [256, 16]], measure) == measure.answer
    assert (measure.calls, again.num_measured, again.num_read) == (1, 0, 1)
    # another question, or the same one of another kind: measured
    assert again.remembered("calibration", [[256, 0]], Measure(7)) == 7
    assert again.remembered("skinny GEMM", [[256, 0], [256, 16]], Measure(None)) is None
    assert store(cache).remembered("skinny GEMM", [[256, 0], [256, 16]], Measure(1)) is None  # None is an answer
    # a question's key is its JSON: tuples ask what lists ask
    assert store(cache).remembered("calibration", ((256, 0),), Measure(8)) == 7


def test_an_answer_that_is_not_valid_here_is_measured_again_and_replaced(cache, caplog):
    store(cache).remembered("skinny GEMM", ["shape"], Measure(5))
    measure = Measure(1)
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        assert store(cache).remembered("skinny GEMM", ["shape"], measure, valid=lambda i: i < 3) == 1
    assert measure.calls == 1
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "does not fit" in caplog.records[0].getMessage()
    assert store(cache).remembered("skinny GEMM", ["shape"], measure, valid=lambda i: i < 3) == 1
    assert measure.calls == 1


@pytest.mark.parametrize("content", [b"\x00\xff not json", b'{"format": 1, "fingerprint"', b"[1, 2]",
                                     b'{"format": 0, "fingerprint": {"gpu": "H200"}, "decisions": {"k": {"[1]": 2}}}',
                                     b'{"format": 1, "fingerprint": {"gpu": "A100"}, "decisions": {"k": {"[1]": 2}}}',
                                     b'{"format": 1, "fingerprint": {"gpu": "H200"}, "decisions": {"k": 5}}',
                                     b"[" * 100_000 + b"]" * 100_000],
                         ids=["bytes", "cut short", "not an object", "old format", "other fingerprint", "bad decisions",
                              "nested past the parser"])
def test_a_corrupt_old_or_foreign_file_is_ignored_and_replaced(cache, content, caplog):
    path = cache / "startup" / "decisions.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    caplog.set_level(logging.DEBUG, logger="asyncllm")
    measure = Measure(3)
    assert store(cache).remembered("k", [1], measure) == 3 and measure.calls == 1
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "ignored" in warnings[0], warnings  # once, not per write
    assert json.loads(path.read_text())["decisions"] == {"k": {"[1]": 3}}  # a valid file again
    assert store(cache).remembered("k", [1], measure) == 3 and measure.calls == 1


def test_writes_are_atomic_and_merge_what_another_process_stored(cache, monkeypatch):
    ours, theirs = store(cache), store(cache)
    ours.remembered("a", [1], Measure(1))
    theirs.remembered("b", [2], Measure(2))  # read before ours was written: merged on writing, not lost
    ours.remembered("c", [3], Measure(3))
    path = cache / "startup" / "decisions.json"
    assert json.loads(path.read_text())["decisions"] == {"a": {"[1]": 1}, "b": {"[2]": 2}, "c": {"[3]": 3}}
    before = path.read_bytes()

    def dump_half(content, f, **kwargs):  # a write that fails halfway (a full disk, a kill)
        f.write(json.dumps(content)[:20])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(startup_cache.json, "dump", dump_half)
    failing = store(cache)
    assert failing.remembered("d", [4], Measure(4)) == 4  # the answer stands, in memory
    assert failing.remembered("d", [4], Measure(5)) == 4
    assert path.read_bytes() == before  # the file as it was, never half of one
    assert sorted(os.listdir(path.parent)) == ["decisions.json", "decisions.json.lock"]  # no temporary left


def test_an_unwritable_cache_only_costs_the_store(cache, tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    unwritable = StartupDecisions(str(blocker / "startup" / "decisions.json"), {"gpu": "H200"})
    assert unwritable.remembered("k", [1], Measure(1)) == 1
    assert unwritable.remembered("k", [1], Measure(2)) == 1  # kept in memory
    answer = object()  # not JSON: kept in memory, not written
    assert store(cache).remembered("k", [2], Measure(answer)) is answer


# ---- the wiring ----------------------------------------------------------------------------------------
def test_skinny_gemm_timings_are_looked_up_by_shape_and_candidates(cache, monkeypatch):
    monkeypatch.setattr(skinny_linear, "_decisions", store(cache))
    key = (CUDA, torch.bfloat16, 1, 4096, 1024, False)
    candidates = [SkinnyConfig(False, 16, 512, 1, 4), SkinnyConfig(True, 64, 128, 1, 4)]
    timing = Measure(candidates[1])
    assert skinny_linear._remembered(key, False, candidates, timing) == candidates[1]
    skinny_linear.use_decisions(store(cache))  # the next start-up's
    assert skinny_linear._remembered(key, False, candidates, timing) == candidates[1]
    assert timing.calls == 1
    # cuBLAS (None) is an answer too; the gated form, another row count, other candidates: other questions
    assert skinny_linear._remembered(key, True, candidates, Measure(None)) is None
    assert skinny_linear._remembered(key, True, candidates, Measure(candidates[0])) is None
    assert skinny_linear._remembered(key[:2] + (2,) + key[3:], False, candidates, Measure(None)) is None
    assert skinny_linear._remembered(key, False, candidates[::-1], Measure(candidates[0])) == candidates[0]


def test_a_stored_skinny_gemm_index_past_its_candidates_is_measured_again(cache, monkeypatch, caplog):
    key = (CUDA, torch.bfloat16, 1, 4096, 1024, False)
    candidates = [SkinnyConfig(False, 16, 512, 1, 4), SkinnyConfig(True, 64, 128, 1, 4)]
    monkeypatch.setattr(skinny_linear, "_decisions", store(cache))
    skinny_linear._remembered(key, False, candidates, Measure(candidates[1]))
    path = cache / "startup" / "decisions.json"
    content = json.loads(path.read_text())
    (question,) = content["decisions"]["skinny GEMM"]
    for damaged in (5, -1, True, "1", 1.0):  # the file edited, or written by code that counted otherwise
        content["decisions"]["skinny GEMM"][question] = damaged
        path.write_text(json.dumps(content))
        monkeypatch.setattr(skinny_linear, "_decisions", store(cache))
        timing = Measure(candidates[0])
        assert skinny_linear._remembered(key, False, candidates, timing) == candidates[0] and timing.calls == 1
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 5


class FakeGraphs:
    """CudaGraphRunner's part decode tuning uses; a step's time from the current 1-row decisions."""

    def __init__(self, step_ms: dict):
        self.step_ms = step_ms
        self.context_bounds = {1: [256, 1024]}
        self.graphs = {("decode", 1, 256): None, ("decode", 1, 1024): None, ("decode", 2, 256): None}
        self.recaptured: list[list] = []
        self.replays = 0

    def recapture(self, keys):
        self.recaptured.append(list(keys))

    def run(self, batch):
        pass

    def replay_ms(self, key, iters):
        self.replays += 1
        return sum(self.step_ms.get(tiling, 1.0) for tiling in skinny_linear._choices.values())


def test_decode_tuning_is_stored_and_a_later_start_up_sets_it_without_timing(cache, monkeypatch):
    first, grouped, other = SkinnyConfig(False, 16, 512, 1, 4), SkinnyConfig(False, 16, 512, 1, 4, grouped=True), \
        SkinnyConfig(False, 8, 512, 1, 4)
    qkv, down = (CUDA, torch.bfloat16, 1, 6144, 4096, False), (CUDA, torch.bfloat16, 1, 4096, 12288, False)
    monkeypatch.setenv("ASYNCLLM_DECODE_TUNING", "1")
    monkeypatch.setattr(skinny_linear, "batch1_alternatives", lambda: [
        (False, qkv, [first, grouped, other]), (False, down, [first, other])])

    def start_up(decisions) -> FakeGraphs:  # a process's state before tuning: the decisions timed alone
        monkeypatch.setattr(skinny_linear, "_choices", {qkv: first, down: first})
        monkeypatch.setattr(skinny_linear, "_settled", set())
        graphs = FakeGraphs({grouped: 0.5})
        decode_tuning.tune_batch1_projections(graphs, lambda context: "batch", decisions)
        return graphs

    measured = start_up(store(cache))
    assert measured.replays > 0 and skinny_linear._choices == {qkv: grouped, down: first}
    assert skinny_linear._settled == {(False, qkv), (False, down)}
    stored = start_up(store(cache))
    assert stored.replays == 0, "the stored answer is used without timing"
    assert skinny_linear._choices == {qkv: grouped, down: first}
    assert skinny_linear._settled == {(False, qkv), (False, down)}
    assert stored.recaptured == [[("decode", 1, 256), ("decode", 1, 1024)]]  # once, the batch-1 graphs
    # other alternatives (new candidates): another question, timed again
    monkeypatch.setattr(skinny_linear, "batch1_alternatives", lambda: [(False, qkv, [first, other])])
    assert start_up(store(cache)).replays > 0


def test_decode_tuning_that_keeps_every_decision_captures_nothing_again_from_the_cache(cache, monkeypatch):
    first, other = SkinnyConfig(False, 16, 512, 1, 4), SkinnyConfig(False, 8, 512, 1, 4)
    qkv = (CUDA, torch.bfloat16, 1, 6144, 4096, False)
    monkeypatch.setenv("ASYNCLLM_DECODE_TUNING", "1")
    monkeypatch.setattr(skinny_linear, "batch1_alternatives", lambda: [(False, qkv, [first, other])])
    for measures in (True, False):
        monkeypatch.setattr(skinny_linear, "_choices", {qkv: first})
        monkeypatch.setattr(skinny_linear, "_settled", set())
        graphs = FakeGraphs({})  # every tiling the same: the first stays
        decode_tuning.tune_batch1_projections(graphs, lambda context: "batch", store(cache))
        assert (graphs.replays > 0) is measures and skinny_linear._choices == {qkv: first}
        assert bool(graphs.recaptured) is measures


def test_a_stored_calibration_fits_the_step_model_as_the_measured_one(cache):
    shapes = calibration_shapes(16384, 512)
    steps = [(p, d, 1.5 + 0.004 * p + 0.03 * d) for p, d in shapes]  # what time_steps returns: tuples
    time_steps = Measure(steps)
    measured, stored = StepTimeModel(), StepTimeModel()
    measured.calibrate(store(cache).remembered("step-model calibration", shapes, time_steps,
                                               valid=lambda s: calibration_fits(s, shapes)))
    stored.calibrate(store(cache).remembered("step-model calibration", shapes, time_steps,
                                             valid=lambda s: calibration_fits(s, shapes)))
    assert time_steps.calls == 1
    assert (stored.a, stored.b, stored.c) == pytest.approx((measured.a, measured.b, measured.c))
    assert stored.ready and stored.b == pytest.approx(0.004, rel=1e-3)  # the ridge: not exact
    assert calibration_fits([list(step) for step in steps], shapes)
    assert not calibration_fits([[256, 0, 1.0]], shapes)  # another count of shapes
    swapped = [list(step) for step in steps]
    swapped[0], swapped[-1] = swapped[-1], swapped[0]
    assert not calibration_fits(swapped, shapes)  # other steps' shapes: never fitted to these
    assert not calibration_fits([[p + 1, d, 1.0] for p, d in shapes], shapes)  # more prefill than asked
    assert not calibration_fits([[p, d, float("nan")] for p, d in shapes], shapes)
    assert not calibration_fits([[p, d, True] for p, d in shapes], shapes)
    assert not calibration_fits([[256, 0, "1"]] * len(shapes), shapes)
    assert not calibration_fits([[256, 0, 0.0]] * len(shapes), shapes)
