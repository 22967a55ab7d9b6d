"""Tensor parallelism on CPU (gloo), tp=2 against tp=1 on tiny random-weight checkpoints.

Every engine here is a real multi-process one: rank 0 in the test process, rank 1 spawned (or, for
the env:// rendezvous, started by the test with `python -m asyncllm.cli tp-worker`). Start-up
costs several seconds per engine, so each test makes the few it needs. Every wait is bounded:
anyio.fail_after in the async tests, timeouts on joins, and pytest-timeout for the rest.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import anyio
import pytest
import torch
import torch.distributed as dist

from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.errors import EngineDeadError
from asyncllm.llm import LLM
from asyncllm.sampling_params import SamplingParams
from asyncllm.testing import build_tiny_checkpoint
from helpers import ScriptedProposer, free_port

pytestmark = pytest.mark.timeout(180)

BASE = dict(num_kvcache_blocks=128, kvcache_block_size=16)
# chunked prefill (a 75-token prompt in chunks of at most 32 / 48 tokens) for qwen3 and qwen2
OPTIONS = {"qwen3": dict(BASE, max_num_batched_tokens=32), "llama": dict(BASE),
           "qwen2": dict(BASE, max_num_batched_tokens=48), "qwen3_kv1": dict(BASE),
           "qwen3_moe": dict(BASE, max_num_batched_tokens=32)}
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
_rng = random.Random(7)
# mixed lengths crossing 16-token blocks, before and while decoding
PROMPTS = ["Hello, my name is", [_rng.randrange(1000, 32000) for _ in range(17)],
           [_rng.randrange(1000, 32000) for _ in range(40)], [_rng.randrange(1000, 32000) for _ in range(75)]]
ASYNC_TIMEOUT = 90


# ---- helpers -----------------------------------------------------------------------------------
def live_children() -> list[str]:
    """This process's child processes (zombies too) other than multiprocessing's resource tracker."""
    me, found = os.getpid(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == me and "resource_tracker" not in cmdline:
            found.append(f"{pid} ({state}) {cmdline[:120]}")
    return found


def assert_all_ended(baseline: list[str]) -> None:
    deadline = time.monotonic() + 10
    while (live_children() != baseline or multiprocessing.active_children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []
    assert live_children() == baseline, "a tensor-parallel worker outlived its engine"
    assert not dist.is_initialized(), "the process group was not destroyed"


def kill_worker_after(core, pid: int, steps: int) -> threading.Thread:
    def kill() -> None:
        deadline = time.monotonic() + 60
        while core.num_steps < steps and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def copy_config_only(src: str, dst: str, **changes) -> str:
    """A model directory with src's config.json, changed: enough for Config's start-up checks."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def bounded_collectives(monkeypatch):
    """A hung collective fails within a minute (in every rank: spawned ones inherit the variable),
    well inside pytest-timeout, which cannot interrupt a thread blocked in gloo."""
    monkeypatch.setenv("ASYNCLLM_TP_TIMEOUT_S", "60")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    # a 32000-token vocabulary (split 16000 + 16000): the full 151936 would make each CPU step
    # several times slower. build_tiny_checkpoint cuts the tokenizer to fit (the text prompt's ids
    # are the same as with the full one)
    def build(name, arch, **kw):
        return build_tiny_checkpoint(str(tmp_path_factory.mktemp(f"tp-{name}")), arch, tokenizer_dir,
                                     vocab_size=32000, **kw)
    return {"qwen3": build("qwen3", "qwen3", seed=2), "llama": build("llama", "llama", seed=3),
            "qwen2": build("qwen2", "qwen2", seed=4),
            # one KV head for two ranks: QKVParallelLinear replicates it (kv_replicas=2)
            "qwen3_kv1": build("kv1", "qwen3", seed=5, num_key_value_heads=1),
            # experts in layer 0, a dense MLP in layer 1: both split over the ranks' intermediate slices
            "qwen3_moe": build("moe", "qwen3_moe", seed=6, mlp_only_layers=[1])}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """tp=1 greedy completions per checkpoint, made once."""
    cache = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            with LLM(checkpoints[name], **OPTIONS[name]) as llm:
                outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            cache[name] = [o["token_ids"] for o in outputs]
            assert all(len(t) == MAX_TOKENS for t in cache[name])
        return cache[name]
    return get


async def stream_all(engine: AsyncLLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    """Every prompt streamed concurrently; each stream's token ids."""
    results: dict[int, list[int]] = {}

    async def consume(i: int) -> None:
        stream = engine.stream(prompts[i], params)
        results[i] = [t async for out in stream for t in out.token_ids]
        assert stream.finish_reason == "length"

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(consume, i)
    return [results[i] for i in range(len(prompts))]


# ---- start-up checks: no process is started ----------------------------------------------------
def test_indivisible_heads_or_kv_heads_fail_at_start(checkpoints, tmp_path):
    tiny_qwen3 = checkpoints["qwen3"]
    baseline = live_children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size.*num_attention_heads=4 .*divisible by 3"):
        LLM(tiny_qwen3, tensor_parallel_size=3, **BASE)
    with pytest.raises(ValueError, match=r"tensor_parallel_size.*num_attention_heads=4"):
        AsyncLLMEngine(tiny_qwen3, tensor_parallel_size=3, **BASE)
    # 6 heads split in two, but 3 KV heads neither split in two nor replicate evenly
    kv3 = copy_config_only(tiny_qwen3, str(tmp_path / "kv3"), num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size.*num_key_value_heads=3"):
        LLM(kv3, tensor_parallel_size=2, **BASE)
    odd_mlp = copy_config_only(tiny_qwen3, str(tmp_path / "odd-mlp"), intermediate_size=255)
    with pytest.raises(ValueError, match=r"tensor_parallel_size.*intermediate_size=255"):
        LLM(odd_mlp, tensor_parallel_size=2, **BASE)
    odd_experts = copy_config_only(checkpoints["qwen3_moe"], str(tmp_path / "odd-experts"), moe_intermediate_size=127)
    with pytest.raises(ValueError, match=r"tensor_parallel_size.*moe_intermediate_size=127 is not divisible by 2"):
        LLM(odd_experts, tensor_parallel_size=2, **BASE)
    assert live_children() == baseline and not dist.is_initialized()


# ---- tp=2 == tp=1 --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["quantization_fp8_kv1", "block_fp8_checkpoint"])
def test_fp8_weights_tp2_match_tp1(case, checkpoints, tmp_path):
    """FP8 weights sharded with their scales: quantization="fp8" (per-row scales) with one KV head that
    both ranks replicate, and a block-wise FP8 checkpoint (128x128 blocks: the row-parallel layers'
    shards take whole column groups of scales)."""
    from test_fp8_loading import write_pair
    if case == "quantization_fp8_kv1":
        model, options = checkpoints["qwen3_kv1"], dict(OPTIONS["qwen3_kv1"], quantization="fp8")
    else:
        model, options = write_pair(checkpoints["qwen3"], tmp_path)[0], OPTIONS["qwen3"]
    with LLM(model, **options) as llm:
        expected = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        layer = llm.core.runner.model.model.layers[0]
        assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        full_groups = layer.mlp.down_proj.weight_scale.shape[1]
    baseline = live_children()
    with LLM(model, tensor_parallel_size=2, **options) as llm:
        down = llm.core.runner.model.model.layers[0].mlp.down_proj
        assert down.weight.dtype == torch.float8_e4m3fn
        assert down.weight_scale.shape[1] == (1 if case == "quantization_fp8_kv1" else full_groups // 2)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected
    assert_all_ended(baseline)


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "qwen3_moe"])
def test_llm_tp2_matches_tp1(name, checkpoints, reference):
    expected = reference(name)  # tp=1 first: no tp=1 engine can be built beside a running tp=2 one
    baseline = live_children()
    with LLM(checkpoints[name], tensor_parallel_size=2, **OPTIONS[name]) as llm:
        assert [p.name for p in llm.core.runner.workers.processes] == ["asyncllm-tp1"]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == expected
        if name == "qwen3":
            # a second batch, served partly from rank 0's prefix cache: the workers' caches hold
            # the same blocks, since they ran the same steps
            again = llm.generate(PROMPTS[::-1], GREEDY, use_tqdm=False)
            assert [o["token_ids"] for o in again] == expected[::-1]
            assert llm.core.block_manager.prefix_cache_hit_rate > 0
            # a tp=1 engine beside a running tp=2 one would shard itself over its group: refused
            with pytest.raises(RuntimeError, match="tensor_parallel_size=1 engine cannot be built beside it"):
                LLM(checkpoints[name], **OPTIONS[name])
    assert_all_ended(baseline)


def test_sampling_features_tp2_match_tp1(checkpoints):
    """Penalties, logprobs, prompt_logprobs and n > 1 under tensor parallelism: rank 0 samples from
    the gathered logits, and its token counts and forks behave as with one rank."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=0.5, presence_penalty=0.5,
                            frequency_penalty=0.3, logprobs=2, prompt_logprobs=1, n=2)
    with LLM(checkpoints["qwen3"], **OPTIONS["qwen3"]) as llm:
        expected = llm.generate(PROMPTS[1:3], params, use_tqdm=False)
    baseline = live_children()
    with LLM(checkpoints["qwen3"], tensor_parallel_size=2, overlap_scheduling=True, **OPTIONS["qwen3"]) as llm:
        outputs = llm.generate(PROMPTS[1:3], params, use_tqdm=False)
    assert_all_ended(baseline)
    for got, want in zip(outputs, expected):
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
        for g, w in zip(got, want):
            assert [e.logprob for e in g["logprobs"]] == pytest.approx([e.logprob for e in w["logprobs"]], abs=1e-4)
        assert [e.logprob for e in got[0]["prompt_logprobs"][1:]] == pytest.approx(
            [e.logprob for e in want[0]["prompt_logprobs"][1:]], abs=1e-4)


def test_speculative_decoding_tp2_matches_tp1(checkpoints, reference):
    """Speculative decoding under tensor parallelism: a verification row reaches every rank as a
    prefill chunk's tokens do, rank 0 verifies; drafts accepted and rejected (a proposer that drafts
    the tp=1 output, now and then wrong), overlap on (speculating steps resolve before the next)."""
    expected = reference("qwen3")
    baseline = live_children()
    with LLM(checkpoints["qwen3"], tensor_parallel_size=2, overlap_scheduling=True, **OPTIONS["qwen3"],
             speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        prompt_ids = [llm.core.encode_prompt(p) for p in PROMPTS]
        llm.core.speculation.proposer = ScriptedProposer(zip(prompt_ids, expected))
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.core.stats()
    assert_all_ended(baseline)
    assert [o["token_ids"] for o in outputs] == expected
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_vocabulary_that_two_ranks_do_not_divide_is_padded(tmp_path, tokenizer_dir):
    """vocab_size 31999 over two ranks: 16000 rows each, the last one zero padding, whose logit is
    dropped after the gather. Greedy tokens and logits equal tp=1's, and the sampler sees exactly
    vocab_size columns. The last prompt ends with the last id, held by rank 1."""
    from helpers import generate_with_logits
    model_dir = build_tiny_checkpoint(str(tmp_path / "odd-vocab"), "qwen3", tokenizer_dir, seed=6, vocab_size=31999)
    prompts = [PROMPTS[1], PROMPTS[2][:-1] + [31998]]
    with LLM(model_dir, **BASE) as llm:
        expected_tokens, expected_logits = generate_with_logits(llm, prompts, GREEDY)
    baseline = live_children()
    with LLM(model_dir, tensor_parallel_size=2, **BASE) as llm:
        lm_head = llm.core.runner.model.lm_head
        assert (lm_head.shard_size, lm_head.num_real_rows) == (16000, 16000)  # rank 0: all real; rank 1: 15999
        tokens, logits = generate_with_logits(llm, prompts, GREEDY)
    assert_all_ended(baseline)
    assert tokens == expected_tokens
    for row, expected_row in zip(logits, expected_logits):
        for step_logits, expected_step in zip(row, expected_row):
            assert step_logits.shape == (31999,)
            torch.testing.assert_close(step_logits, expected_step, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_async_tp2_matches_tp1(name, checkpoints, reference):
    expected = reference(name)
    baseline = live_children()

    async def main():
        with anyio.fail_after(ASYNC_TIMEOUT):
            # llama's run overlaps its steps: rank 0 fills the pending ids in on the host for the workers
            async with AsyncLLMEngine(checkpoints[name], tensor_parallel_size=2, overlap_scheduling=name == "llama",
                                      **OPTIONS[name]) as engine:
                assert engine._core.overlap == (name == "llama")
                assert await stream_all(engine) == expected
    anyio.run(main)
    assert_all_ended(baseline)


def test_replicated_kv_head_and_idle_beyond_collective_timeout(checkpoints, reference, monkeypatch):
    """One KV head, two ranks: both hold a copy of it. The engine then idles longer than a worker's
    receive timeout (ASYNCLLM_TP_TIMEOUT_S): rank 0's heartbeat keeps it waiting, not failing."""
    expected = reference("qwen3_kv1")
    baseline = live_children()
    monkeypatch.setenv("ASYNCLLM_TP_TIMEOUT_S", "10")
    with LLM(checkpoints["qwen3_kv1"], tensor_parallel_size=2, **OPTIONS["qwen3_kv1"]) as llm:
        attn = llm.core.runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads, attn.qkv_proj.kv_replicas) == (2, 1, 2)
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        time.sleep(12)
        assert [o["token_ids"] for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == expected[:2]
    assert_all_ended(baseline)


# ---- a rank dies mid-run -----------------------------------------------------------------------
def test_llm_worker_killed_mid_run_then_new_engine_matches_tp1(checkpoints, reference):
    expected = reference("llama")
    baseline = live_children()
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, **OPTIONS["llama"])
    with llm:
        worker = llm.core.runner.workers.processes[0]
        killer = kill_worker_after(llm.core, worker.pid, steps=5)
        start = time.monotonic()
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
            llm.generate(PROMPTS, long, use_tqdm=False)
        assert time.monotonic() - start < 30
        assert llm.core.num_steps < 100  # it failed mid-run, not after finishing
        killer.join(timeout=10)
    assert_all_ended(baseline)
    # the process group is gone with it: a new tensor-parallel engine starts in this same process
    with LLM(checkpoints["llama"], tensor_parallel_size=2, **OPTIONS["llama"]) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert_all_ended(baseline)


def test_async_tp2_matches_tp1_then_worker_killed(checkpoints, reference):
    expected = reference("qwen2")
    baseline = live_children()

    async def main():
        with anyio.fail_after(ASYNC_TIMEOUT):
            engine = AsyncLLMEngine(checkpoints["qwen2"], tensor_parallel_size=2, **OPTIONS["qwen2"])
            async with engine:
                assert await stream_all(engine) == expected
                # now kill rank 1 while four long streams run: every consumer hears EngineDeadError
                steps = engine._core.num_steps
                long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
                streams = [engine.stream(p, long) for p in PROMPTS]
                errors = []

                async def consume(stream):
                    try:
                        async for _ in stream:
                            pass
                    except EngineDeadError as e:
                        errors.append(e)

                async with anyio.create_task_group() as tg:
                    for s in streams:
                        tg.start_soon(consume, s)
                    while engine._core.num_steps < steps + 5:
                        await anyio.sleep(0.002)
                    os.kill(engine._core.runner.workers.processes[0].pid, signal.SIGKILL)
                assert len(errors) == len(streams)
                assert all("tensor-parallel rank 1 died" in str(e.__cause__) for e in errors)
                assert all(len(s.token_ids) < 400 for s in streams)
                with pytest.raises(EngineDeadError):
                    engine.stream("Hello", GREEDY)
    anyio.run(main)
    assert_all_ended(baseline)


# ---- start-up failures -------------------------------------------------------------------------
def test_startup_failure_in_every_rank_is_an_error_not_a_hang(checkpoints, tmp_path):
    """A checkpoint missing one tensor: every rank fails while loading, rank 0 raises."""
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "missing-tensor"
    shutil.copytree(checkpoints["qwen3"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    baseline = live_children()
    start = time.monotonic()
    with pytest.raises(ValueError, match="checkpoint is missing weights.*layers.1.mlp.down_proj"):
        LLM(str(broken), tensor_parallel_size=2, **BASE)
    assert time.monotonic() - start < 60
    assert_all_ended(baseline)


def test_worker_dying_at_start_is_reported_at_once(checkpoints, tmp_path, monkeypatch):
    """Rank 1's interpreter exits before it joins the group (a sitecustomize that only spawned
    children run): rank 0 reports it without waiting for the rendezvous timeout, via LLM and via
    AsyncLLMEngine.start (EngineDeadError)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\nif '--multiprocessing-fork' in sys.argv:\n    os._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook)] + sys.path))
    tiny_qwen3 = checkpoints["qwen3"]
    baseline = live_children()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"start-up failed: tensor-parallel rank 1 died \(exit code 3\)"):
        LLM(tiny_qwen3, tensor_parallel_size=2, **BASE)
    assert time.monotonic() - start < 30
    assert_all_ended(baseline)

    async def main():
        with anyio.fail_after(ASYNC_TIMEOUT):
            with pytest.raises(EngineDeadError, match="failed to start.*rank 1 died"):
                async with AsyncLLMEngine(tiny_qwen3, tensor_parallel_size=2, **BASE):
                    pass
    anyio.run(main)
    assert_all_ended(baseline)


# ---- several machines: env:// rendezvous, rank 1 started by hand ---------------------------------
def test_env_rendezvous_with_a_separately_started_rank(checkpoints, reference, monkeypatch, tmp_path):
    name = "qwen3"
    expected = reference(name)
    baseline = live_children()
    rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    log = open(tmp_path / "rank1.log", "w")
    options = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS[name].items()]
    rank1 = subprocess.Popen([sys.executable, "-m", "asyncllm.cli", "tp-worker", "--model", checkpoints[name],
                              *options], env=dict(os.environ, RANK="1", **rendezvous), stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        for key, value in rendezvous.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("ASYNCLLM_TP_INIT_METHOD", "env://")
        with LLM(checkpoints[name], tensor_parallel_size=2, **OPTIONS[name]) as llm:
            assert llm.core.runner.workers.processes == []  # rank 0 started none itself
            assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        # closing rank 0 tells rank 1 to exit, and it does, cleanly
        assert rank1.wait(timeout=30) == 0, (tmp_path / "rank1.log").read_text()
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait(timeout=10)
        log.close()
    assert_all_ended(baseline)
