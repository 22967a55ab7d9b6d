"""Tensor parallelism on two GPUs (NCCL, CUDA graphs): tensor_parallel_size=2 against 1 on the
Qwen3-8B shape with random bf16 weights, and on a tiny Qwen3-MoE checkpoint (each expert's
intermediate slice per rank). Skipped without two CUDA GPUs.

Run on the two-GPU machine through `bash scripts/gpu_suite.sh tp`, which builds the checkpoint
once and passes it in ASYNCLLM_TP_MODEL_DIR (else this module builds its own, ~45 s on an H200).
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.testing import QWEN3_8B, build_tiny_checkpoint
from helpers import assert_greedy_runs_match, generate_with_logits, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
OPTIONS = dict(gpu_memory_utilization=0.5, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    given = os.environ.get("ASYNCLLM_TP_MODEL_DIR")
    if given:
        return given
    with torch.device("cuda"):
        path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3-8b")), "qwen3", dtype=torch.bfloat16,
                                     **QWEN3_8B)
    gc.collect()
    torch.cuda.empty_cache()
    return path


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> str:
    # 8 experts, top-2, in layer 0; a dense MLP in layer 1: both split over the ranks
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3-moe")), "qwen3_moe", mlp_only_layers=[1])


def run_engine(model_dir: str, tp: int, ps, dtype: str, params: SamplingParams = GREEDY, **options) -> tuple:
    with LLM(model_dir, tensor_parallel_size=tp, dtype=dtype, **{**OPTIONS, **options}) as llm:
        assert llm.core.overlap == options.get("overlap_scheduling", True)  # on by default with CUDA
        runner = llm.core.runner
        assert runner.graph_runner is not None, "CUDA graphs are off"
        graphs = runner.graph_runner
        if tp > 1:
            assert [p.name for p in runner.workers.processes] == ["asyncllm-tp1"]
        result = generate_with_logits(llm, ps, params)
        assert graphs.num_replays["decode"] > 0  # decode steps ran through graphs
        bm = llm.core.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks
        stats = llm.core.stats()
        workers = runner.workers
    # close() ended the worker and tore the NCCL group down (graphs first: they hold its communicator)
    if workers is not None:
        assert not any(p.is_alive() for p in workers.processes)
    assert not torch.distributed.is_initialized()
    del llm, runner, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return result, stats


def tp2_against_tp1_in_float32(model_dir: str, seed: int) -> tuple[dict, list, list]:
    """Long prompts over a 2048-token budget (prefill chunks beside decodes, as in serving) in float32
    (bf16 weights upcast): one GPU's matmul and two ranks' partial sums plus an all-reduce then agree
    to ~1e-6, so the comparison is tight."""
    ps = random_prompts(12, seed=seed, hi=1500)
    tp1, _ = run_engine(model_dir, 1, ps, "float32")
    tp2, stats = run_engine(model_dir, 2, ps, "float32")
    assert stats["num_steps"] > GREEDY.max_tokens
    return assert_greedy_runs_match(tp1, tp2, logits_rtol=1e-3), tp1, tp2


def test_tp2_matches_tp1_on_qwen3_8b_shape(model_dir):
    result, _, _ = tp2_against_tp1_in_float32(model_dir, seed=0)
    print(f"float32, TP=2 vs TP=1: {result['summary']}")


def test_tp2_matches_tp1_on_tiny_qwen3_moe(moe_model_dir):
    """The MoE layer under tensor parallelism: each rank holds every expert's slice of the
    intermediate size and the router whole, and the all-reduce adds the experts' partial outputs.
    In float32 the two agree to rounding, so the greedy tokens are equal."""
    result, tp1, tp2 = tp2_against_tp1_in_float32(moe_model_dir, seed=3)
    print(f"tiny Qwen3-MoE, float32, TP=2 vs TP=1: {result['summary']}")
    assert tp2[0] == tp1[0]


def test_tp2_bf16_prompt_logits_near_tp1(model_dir):
    """In bf16 each rank rounds its partial sums before the all-reduce adds them: 72 extra roundings
    over the 8B's 36 layers put TP=2's logits 4-5 % from TP=1's (measured on the H200 pair). A
    wrong shard or a missing all-reduce moves them by ~100 %; 10 % separates the two."""
    ps = random_prompts(6, seed=1, hi=1500)
    (tp1_tokens, tp1_logits), _ = run_engine(model_dir, 1, ps, "bfloat16")
    (tp2_tokens, tp2_logits), _ = run_engine(model_dir, 2, ps, "bfloat16")
    errors = [((b[0] - a[0]).norm() / a[0].norm()).item() for a, b in zip(tp1_logits, tp2_logits)]
    print(f"bfloat16, TP=2 vs TP=1 prompt logits: relative errors {[f'{e:.1e}' for e in errors]}, first tokens "
          f"equal {sum(a[0] == b[0] for a, b in zip(tp1_tokens, tp2_tokens))}/{len(ps)}")
    assert max(errors) < 0.1, errors


def test_tp2_overlapped_loop_matches_serial(model_dir):
    """Under TP rank 0 fills the previous step's sampled ids on the host for the workers; the
    overlapped loop must give what the serial one gives, greedy (tokens and logits) and seeded
    sampling, with prefill chunks beside decodes."""
    ps = random_prompts(8, seed=2, hi=1500)
    serial, _ = run_engine(model_dir, 2, ps, "float32", overlap_scheduling=False)
    overlapped, _ = run_engine(model_dir, 2, ps, "float32")
    result = assert_greedy_runs_match(serial, overlapped, logits_rtol=1e-3)
    print(f"float32 TP=2, overlap vs serial, greedy: {result['summary']}")
    # seeded sampling: each request draws from its own generator, so the tokens match too; in float32
    # the logits agree to ~1e-6, so a flip needs a near-tie in the exponential race (allow one)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True)
    (serial_tokens, _), _ = run_engine(model_dir, 2, ps, "float32", seeded, overlap_scheduling=False)
    (overlapped_tokens, _), _ = run_engine(model_dir, 2, ps, "float32", seeded)
    same = sum(a == b for a, b in zip(serial_tokens, overlapped_tokens))
    print(f"float32 TP=2, overlap vs serial, seeded temperature 0.8: {same}/{len(ps)} sequences identical")
    assert same >= len(ps) - 1
