"""The memory probe's figures in the start-up cache (runner/memory.py, startup_cache.py).

The probe needs a GPU (tests/test_gpu.py runs it); here a runner of RunnerMemory's real
_blocks_from_gpu_memory runs on CPU over a fake device memory (torch.cuda's counters replaced) and a
fake worst-case step that raises the peak and leaves some memory allocated, as the cuBLAS workspace
and loaded kernels do: the first start-up measures and stores, a later one of the same question
reads the figures and runs no step, and reaches the same number of KV blocks; a stored answer that
is not one, or another question, is measured again."""
from __future__ import annotations

import types

import pytest
import torch

from asyncllm import startup_cache
from asyncllm.engine.options import make_config
from asyncllm.layers import device_wide
from asyncllm.runner.memory import MEMORY_PROBE_KIND, RunnerMemory, probe_answer_fits
from asyncllm.startup_cache import DECISION_FIELDS, StartupDecisions

GIB = 2**30
TOTAL = 80 * GIB
IN_USE = 3 * GIB  # weights and the CUDA context before the probe
STEP_PEAK = 5 * GIB  # the worst-case step's activations, freed after it
LEFT_BY_STEP = 300 * 2**20  # what the step leaves allocated (a workspace)


class FakeDeviceMemory:
    """torch.cuda's memory counters over a pretend device: `allocated` by torch, `outside` it."""

    def __init__(self):
        self.allocated, self.peak, self.outside = 0, 0, IN_USE

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (TOTAL - self.outside - self.allocated, TOTAL))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(device_wide, "synchronize", lambda *a: None)
        monkeypatch.setattr(device_wide, "empty_cache", lambda *a: None)


class FakeRunner(RunnerMemory):
    """The attributes and steps RunnerMemory's probe uses; _probe_steps allocates as a step would."""

    def __init__(self, config, decisions: StartupDecisions, device_memory: FakeDeviceMemory):
        self.config, self.decisions, self.device_memory = config, decisions, device_memory
        self.device, self.rank, self.dtype = torch.device("cpu"), 0, config.torch_dtype
        self.kv_dtype, self.block_size = config.kv_cache_torch_dtype, config.kvcache_block_size
        hf = config.hf_config
        self.num_layers, self.num_kv_heads, self.head_dim = hf.num_hidden_layers, hf.num_key_value_heads, 8
        self.vocab_size = hf.vocab_size
        self.bitmasks = types.SimpleNamespace(words=(self.vocab_size + 31) // 32)
        self.steps_run = 0

    def _create_backend(self, kv_cache):
        return object()

    def _synthetic_step(self, num_prompts, prompt_len, num_decodes=0, context=0):
        return (num_prompts, prompt_len)

    def _probe_steps(self, batch) -> None:
        self.steps_run += 1
        self.device_memory.allocate(STEP_PEAK + LEFT_BY_STEP)
        self.device_memory.allocate(-STEP_PEAK)


@pytest.fixture
def config(tiny_qwen3):
    return make_config(tiny_qwen3, {"device": "cpu", "gpu_memory_utilization": 0.9})


def start_up(config, decisions, monkeypatch) -> tuple[FakeRunner, int]:
    """A fresh process's probe: the device as a start-up leaves it before the probe."""
    device_memory = FakeDeviceMemory()
    device_memory.install(monkeypatch)
    runner = FakeRunner(config, decisions, device_memory)
    blocks, _ = runner._blocks_from_gpu_memory()
    return runner, blocks


def expected_blocks(runner) -> int:
    """Today's budget arithmetic, on the fake device's figures after a measured probe."""
    budget = TOTAL * runner.config.gpu_memory_utilization - (IN_USE + LEFT_BY_STEP) - STEP_PEAK
    return int(budget // runner.kv_bytes_per_block)


def test_a_warm_start_up_reads_the_probes_figures_runs_no_step_and_sizes_the_same_cache(config, tmp_path,
                                                                                         monkeypatch):
    path = str(tmp_path / "decisions.json")
    cold, cold_blocks = start_up(config, StartupDecisions(path, {"gpu": "fake"}), monkeypatch)
    assert cold.steps_run == 1 and cold.decisions.num_measured == 1
    assert cold_blocks == expected_blocks(cold)
    warm, warm_blocks = start_up(config, StartupDecisions(path, {"gpu": "fake"}), monkeypatch)
    assert warm.steps_run == 0 and warm.decisions.num_read == 1
    # what the step would have left allocated is counted as used, though nothing allocated it yet
    assert warm.device_memory.allocated == 0 and warm_blocks == cold_blocks


def test_the_cache_off_measures_every_start_up(config, monkeypatch):
    for _ in range(2):
        runner, blocks = start_up(config, StartupDecisions(None), monkeypatch)
        assert runner.steps_run == 1 and blocks == expected_blocks(runner)


@pytest.mark.parametrize("stored", [[-1, 0], [1.5, 0], [True, 0], [0], "5 GiB", None, [TOTAL + 1, 0]])
def test_a_stored_answer_that_is_not_one_is_measured_again(config, tmp_path, monkeypatch, caplog, stored):
    path = str(tmp_path / "decisions.json")
    cold, _ = start_up(config, StartupDecisions(path, {"gpu": "fake"}), monkeypatch)
    damaged = StartupDecisions(path, {"gpu": "fake"})
    damaged._write(MEMORY_PROBE_KIND, startup_cache._canonical(cold._probe_question()), stored)
    again, blocks = start_up(config, StartupDecisions(path, {"gpu": "fake"}), monkeypatch)
    assert again.steps_run == 1 and blocks == expected_blocks(again)
    assert "does not fit its question" in caplog.text
    assert not probe_answer_fits(stored, TOTAL) and probe_answer_fits([STEP_PEAK, LEFT_BY_STEP], TOTAL)


@pytest.mark.parametrize("change", [{"quantization": "fp8_weight_only"}, {"max_num_seqs": 64},
                                    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                            "prompt_lookup_max": 3}}])
def test_another_question_is_measured_again(config, tiny_qwen3, tmp_path, monkeypatch, change):
    """A setting the step depends on, in the question or (the Config's step fields) in the fingerprint."""
    path = str(tmp_path / "decisions.json")
    start_up(config, StartupDecisions(path, {"gpu": "fake"}), monkeypatch)
    other = make_config(tiny_qwen3, {"device": "cpu", "gpu_memory_utilization": 0.9, **change})
    runner, _ = start_up(other, StartupDecisions(path, {"gpu": "fake"}), monkeypatch)
    assert runner.steps_run == 1


def test_the_probes_step_fields_are_in_the_fingerprint_or_the_question(config, monkeypatch):
    question = FakeRunner(config, StartupDecisions(None), FakeDeviceMemory())._probe_question()
    assert {"max_num_batched_tokens", "max_num_seqs", "max_model_len", "kvcache_block_size", "kv_cache_dtype",
            "attention_backend"} <= set(DECISION_FIELDS)
    assert {"step", "quantization", "speculative", "model_config", "rank"} <= set(question)
    # config.json's every field (experts, quantization_config): another value, another question
    monkeypatch.setattr(config.hf_config, "num_experts", 8, raising=False)
    assert FakeRunner(config, StartupDecisions(None), FakeDeviceMemory())._probe_question() != question
