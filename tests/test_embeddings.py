"""Embeddings (engine.embed, LLM.embed) == Hugging Face transformers' AutoModel on the same weights.

The reference is `AutoModel.from_pretrained(dir)(ids).last_hidden_state` (after the final norm), one
prompt at a time in float32: its last token ("last" pooling) or its mean over the prompt ("mean"),
L2-normalised. The engine embeds in batches through the scheduler: chunked prefill, prefix-cache
hits, preemption, overlapped steps, and beside generation requests in the same steps (whose tokens
must not change).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import threading

import anyio
import numpy as np
import pytest
import torch

from asyncllm import LLM, EngineDeadError, PromptTooLongError, SamplingParams
from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.pooling_params import PoolingParams
from asyncllm.testing import build_tiny_checkpoint
from helpers import assert_all_blocks_free

pytestmark = pytest.mark.timeout(600)

CHUNK = 32  # max_num_batched_tokens of the chunked engines
SMALL = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=CHUNK)


def rand_ids(n: int, seed: int, vocab: int = 150_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000 if vocab > 2000 else 10, vocab) for _ in range(n)]


# lengths around the chunk (32) and block (16) sizes: 1, 15, 16, 17, 33 (one token left for a last
# chunk of its own), 64, 100 (four chunks), and text
PROMPTS = [rand_ids(1, 1), rand_ids(15, 2), rand_ids(16, 3), rand_ids(17, 4), rand_ids(33, 5), rand_ids(64, 6),
           rand_ids(100, 7), "Hello, my name is", "The quick brown fox jumps over the lazy dog. " * 6]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Speed only: these ops are tiny and the machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class HFEmbeddings:
    """HF's AutoModel per checkpoint; its final-norm hidden states per prompt, cached."""

    def __init__(self):
        self.models, self.tokenizers, self.hidden = {}, {}, {}

    def ids(self, model_dir: str, prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if model_dir not in self.tokenizers:
            from transformers import AutoTokenizer
            self.tokenizers[model_dir] = AutoTokenizer.from_pretrained(model_dir)
        return self.tokenizers[model_dir].encode(prompt)

    def vector(self, model_dir: str, prompt, pooling: str = "last", normalize: bool = True,
               dimensions: int | None = None) -> torch.Tensor:
        ids = self.ids(model_dir, prompt)
        key = (model_dir, tuple(ids))
        if key not in self.hidden:
            if model_dir not in self.models:
                from transformers import AutoModel
                self.models[model_dir] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
            with torch.inference_mode():
                self.hidden[key] = self.models[model_dir](torch.tensor([ids])).last_hidden_state[0]
        hidden = self.hidden[key]
        vector = hidden[-1] if pooling == "last" else hidden.mean(0)
        if dimensions is not None:
            vector = vector[:dimensions]
        return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="module")
def hf() -> HFEmbeddings:
    return HFEmbeddings()


def assert_matches_hf(hf: HFEmbeddings, model_dir: str, prompts, vectors, **pooling) -> None:
    assert len(vectors) == len(prompts)
    for i, (prompt, vector) in enumerate(zip(prompts, vectors)):
        assert isinstance(vector, list) and all(type(x) is float for x in vector)
        expected = hf.vector(model_dir, prompt, **pooling)
        torch.testing.assert_close(torch.tensor(vector), expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"prompt {i} ({len(hf.ids(model_dir, prompt))} tokens): {m}")


def assert_idle(llm: LLM) -> None:
    assert_all_blocks_free(llm)
    assert llm.core.scheduler.num_unfinished == 0 and not llm.core.requests and not llm.core.has_unfinished()


@pytest.fixture(scope="module")
def llm(tiny_qwen3) -> LLM:
    """Chunked prefill (32 tokens a step) over 16-token blocks."""
    return LLM(tiny_qwen3, **SMALL)


@pytest.fixture(scope="module")
def other_archs(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    # a small vocabulary: HF's reference and the build are quick
    return {arch: build_tiny_checkpoint(str(tmp_path_factory.mktemp(f"embed-{arch}")), arch, tokenizer_dir,
                                        seed=5, vocab_size=4096) for arch in ("qwen2", "llama")}


# ---- against HF -------------------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_batches_match_hf(llm, tiny_qwen3, hf, pooling):
    log = []
    schedule = llm.core.scheduler.schedule

    def recording():
        out = schedule()
        log.append([(item.num_tokens, item.samples) for item in out.scheduled])
        return out
    llm.core.scheduler.schedule = recording
    try:
        vectors = llm.embed(PROMPTS, pooling=pooling)
    finally:
        del llm.core.scheduler.schedule
    assert_matches_hf(hf, tiny_qwen3, PROMPTS, vectors, pooling=pooling)
    assert all(sum(n for n, _ in step) <= CHUNK for step in log) and len(log) > 8  # chunked across steps
    assert not any(samples for step in log for _, samples in step)  # an embedding never samples
    assert_idle(llm)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_other_architectures_match_hf(other_archs, hf, arch):
    model_dir = other_archs[arch]
    engine = LLM(model_dir, **SMALL)
    prompts = [rand_ids(n, n, vocab=4000) for n in (1, 17, 33, 70)]
    for pooling in ("last", "mean"):
        assert_matches_hf(hf, model_dir, prompts, engine.embed(prompts, pooling=pooling), pooling=pooling)
    assert_idle(engine)


def test_unnormalized_and_shortened_vectors_match_hf(llm, tiny_qwen3, hf):
    prompts = PROMPTS[3:6]
    for pooling in ("last", "mean"):
        raw = llm.embed(prompts, pooling=pooling, normalize=False)
        assert_matches_hf(hf, tiny_qwen3, prompts, raw, pooling=pooling, normalize=False)
        assert any(abs(np.linalg.norm(v) - 1) > 0.1 for v in raw)
        short = llm.embed(prompts, pooling=pooling, dimensions=24)
        assert [len(v) for v in short] == [24] * 3
        # Matryoshka: the first 24 entries, normalised again
        assert_matches_hf(hf, tiny_qwen3, prompts, short, pooling=pooling, dimensions=24)
    assert_idle(llm)


def test_a_repeated_prompt_hits_the_prefix_cache_with_last_pooling_only(llm, tiny_qwen3, hf):
    bm = llm.core.block_manager
    prompt = rand_ids(70, 42)  # 4 full blocks and a partial one
    first = llm.embed([prompt])
    hits = bm.num_prefix_hit_tokens
    again = llm.embed([prompt, prompt + [7, 8]])
    assert bm.num_prefix_hit_tokens - hits >= 2 * 64  # both found the 4 cached full blocks
    assert_matches_hf(hf, tiny_qwen3, [prompt, prompt + [7, 8]], again)
    np.testing.assert_allclose(again[0], first[0], rtol=1e-5, atol=1e-6)
    # mean pooling needs every position's hidden state: it computes them all, cached or not
    hits = bm.num_prefix_hit_tokens
    mean = llm.embed([prompt], pooling="mean")
    assert bm.num_prefix_hit_tokens == hits
    assert_matches_hf(hf, tiny_qwen3, [prompt], mean, pooling="mean")
    assert_idle(llm)


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen3Model"])
def test_a_base_model_checkpoint_as_qwen3_embedding_ships_loads_and_embeds(tiny_qwen3, tmp_path, hf, caplog,
                                                                          architecture):
    # Qwen3-Embedding's checkpoints are saved from the base model: tensors named without "model.",
    # no LM head (its config.json still says Qwen3ForCausalLM); AutoModel saves the same, saying Qwen3Model
    from transformers import AutoModel
    base = tmp_path / "base"
    AutoModel.from_pretrained(tiny_qwen3, dtype=torch.float32).save_pretrained(base)
    for name in os.listdir(tiny_qwen3):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny_qwen3, name), base)
    config = json.loads((base / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Model"] and not config.get("tie_word_embeddings")
    (base / "config.json").write_text(json.dumps(dict(config, architectures=[architecture])))
    from safetensors import safe_open
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head")) for n in names)
    with caplog.at_level("WARNING", logger="asyncllm"):
        engine = LLM(str(base), **SMALL)
    assert "no LM head" in caplog.text
    prompts = PROMPTS[3:6]
    assert_matches_hf(hf, tiny_qwen3, prompts, engine.embed(prompts))
    assert engine.generate([[5, 6]], GREEDY, use_tqdm=False)[0]["finish_reason"] == "length"  # runs, meaning nothing
    assert_idle(engine)


# ---- beside generation ------------------------------------------------------------------------------
def run_core(llm: LLM, requests: list[tuple[list[int], object]]) -> tuple[dict, dict, list, list]:
    """Add the requests (SamplingParams: generation; PoolingParams: an embedding) to llm's core and
    step it until all end; returns ({index: generated ids}, {index: vector}, per step the kinds of
    its rows ('s' sampling, 'p' pooling plan rows), the requests' sequences)."""
    core = llm.core
    seqs = [core.add_request(ids, p) if isinstance(p, SamplingParams) else
            core.add_checked_request(ids, core.check_embedding_request(ids, p)) for ids, p in requests]
    index = {seq.request_id: i for i, seq in enumerate(seqs)}
    tokens, vectors, steps = {}, {}, []
    launch = core.runner.launch

    def recording_launch(step_plan, prev, **kwargs):
        plan, sched = kwargs.get("pooling_plan"), step_plan.engine_step
        steps.append("s" * len(step_plan.sampling_ids) + "p" * (plan.num_rows if plan else 0))
        for item in sched.scheduled:
            if item.seq.pooling is not None:
                assert item.seq.num_in_flight == 0
        return launch(step_plan, prev, **kwargs)
    core.runner.launch = recording_launch
    try:
        while core.has_unfinished():
            for event in core.step():
                i = index[event.seq.request_id]
                if event.embedding is not None:
                    assert event.finish_reason == "stop" and event.new_token_ids == [] and i not in vectors
                    vectors[i] = event.embedding.tolist()
                else:
                    tokens.setdefault(i, []).extend(event.new_token_ids)
    finally:
        del core.runner.launch
    return tokens, vectors, steps, seqs


@pytest.mark.parametrize("overlap", [False, True])
def test_embeddings_share_steps_with_generation_which_is_unchanged(tiny_qwen3, hf, overlap):
    engine = LLM(tiny_qwen3, overlap_scheduling=overlap, **SMALL)
    gen_prompts = [rand_ids(20, 200), rand_ids(9, 201)]
    alone = [o["token_ids"] for o in engine.generate(gen_prompts, GREEDY, use_tqdm=False)]
    embed_prompts = [rand_ids(40, 300), rand_ids(5, 301), rand_ids(90, 302)]
    requests = [(gen_prompts[0], GREEDY), (embed_prompts[0], PoolingParams()), (gen_prompts[1], GREEDY),
                (embed_prompts[1], PoolingParams("mean")), (embed_prompts[2], PoolingParams())]
    tokens, vectors, steps, _ = run_core(engine, requests)
    assert [tokens[0], tokens[2]] == alone
    assert sorted(vectors) == [1, 3, 4] and not {1, 3, 4} & set(tokens)
    assert any("s" in kinds and "p" in kinds for kinds in steps), steps  # decodes beside pooling rows
    for i, pooling in ((1, "last"), (3, "mean"), (4, "last")):
        assert_matches_hf(hf, tiny_qwen3, [requests[i][0]], [vectors[i]], pooling=pooling)
    assert_idle(engine)


@pytest.mark.anyio
@pytest.mark.parametrize("overlap", [False, True])
async def test_async_embed_beside_streams(tiny_qwen3, hf, overlap):
    gen_prompt = rand_ids(12, 400)
    with anyio.fail_after(240):
        async with AsyncLLMEngine(tiny_qwen3, overlap_scheduling=overlap, **SMALL) as engine:
            alone = await engine.generate(gen_prompt, GREEDY)
            stream = engine.stream(gen_prompt, GREEDY)
            first = await stream.__anext__()
            vectors = await engine.embed(PROMPTS[4:])
            single = await engine.embed("Hello, my name is", pooling="mean", normalize=False)
            rest = [out async for out in stream]
            assert first.token_ids + [t for out in rest for t in out.token_ids] == alone.token_ids
            assert rest[-1].finish_reason == "length"
            await engine.wait_idle()
            stats = engine.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert_matches_hf(hf, tiny_qwen3, PROMPTS[4:], vectors)
    assert_matches_hf(hf, tiny_qwen3, ["Hello, my name is"], single, pooling="mean", normalize=False)


@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_embeddings_start_over_and_match_hf(tiny_qwen3, hf, overlap):
    # 8 blocks of 16 for two generations growing to 80 and 85 tokens and four 40..67-token prompts:
    # decodes preempt the newest sequences, embeddings among them, which start over (mean pooling:
    # its sum too)
    engine = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=8, max_num_batched_tokens=CHUNK,
                 overlap_scheduling=overlap, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    gen_prompts = [rand_ids(20, 700), rand_ids(25, 701)]
    alone = [o["token_ids"] for o in engine.generate(gen_prompts, params, use_tqdm=False)]
    requests = [(gen_prompts[0], params), (gen_prompts[1], params)] + \
        [(rand_ids(40 + 9 * i, 710 + i), PoolingParams("mean" if i % 2 else "last")) for i in range(4)]
    tokens, vectors, _, seqs = run_core(engine, requests)
    assert [tokens[0], tokens[1]] == alone
    assert any(seq.num_preemptions for seq in seqs[2:] if seq.pools_every_token)  # a mean pooling one
    for i in range(2, 6):
        assert_matches_hf(hf, tiny_qwen3, [requests[i][0]], [vectors[i]], pooling=requests[i][1].pooling)
    assert_idle(engine)


# ---- ends other than the vector ---------------------------------------------------------------------
class LaunchPause:
    """Holds the engine thread at its next step's launch until released: what a test does meanwhile
    happens while the embedding is under way, however fast the machine."""

    def __init__(self, engine: AsyncLLMEngine):
        self.runner = engine._engine_thread.core.runner
        self.reached, self.released = threading.Event(), threading.Event()
        launch = self.runner.launch

        def paused_launch(*args, **kwargs):
            self.reached.set()
            self.released.wait(120)
            return launch(*args, **kwargs)
        self.runner.launch = paused_launch

    async def wait_reached(self) -> None:
        assert await anyio.to_thread.run_sync(self.reached.wait, 120)

    def release(self) -> None:
        del self.runner.launch  # the bound method again
        self.released.set()


LONG_PROMPTS = [rand_ids(250, 500 + i) for i in range(8)]  # 2,000 tokens: 125 steps of 16


@pytest.mark.anyio
async def test_a_cancelled_embed_aborts_its_prompts_and_frees_their_blocks(tiny_qwen3):
    with anyio.fail_after(240):
        async with AsyncLLMEngine(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=160,
                                  max_num_batched_tokens=16) as engine:
            pause = LaunchPause(engine)
            try:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(lambda: engine.embed(LONG_PROMPTS, pooling="mean"))
                    await pause.wait_reached()
                    tasks.cancel_scope.cancel()
            finally:
                pause.release()
            await engine.wait_idle()
            stats = engine.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0
            assert stats["num_steps"] < 10  # aborted, not computed to the end
            assert not engine._engine_thread.channels and not engine._engine_thread.core.requests
            # the engine serves on
            assert len((await engine.embed([[5, 6, 7]]))[0]) == 128


@pytest.mark.anyio
async def test_an_embed_cut_short_by_shutdown_raises_engine_dead(tiny_qwen3):
    with anyio.fail_after(240):
        async with AsyncLLMEngine(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=160,
                                  max_num_batched_tokens=16) as engine:
            pause = LaunchPause(engine)
            async with anyio.create_task_group() as tasks:
                async def shut_down() -> None:
                    await pause.wait_reached()
                    tasks.start_soon(engine.shutdown)  # requested while the step launches
                    await anyio.sleep(0.05)
                    pause.release()
                tasks.start_soon(shut_down)
                with pytest.raises(EngineDeadError, match="shut down before the embedding"):
                    await engine.embed(LONG_PROMPTS)
            with pytest.raises(EngineDeadError):
                await engine.embed("Hello")


def test_embed_on_a_closed_llm_says_it_is_closed(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=64)
    llm.close()
    with pytest.raises(EngineDeadError, match="closed"):  # was an AttributeError from the released runner
        llm.embed("Hello")


def test_prompt_length_limits(tiny_qwen3):
    engine = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=64)
    # nothing is generated, so a prompt may fill the whole context (generate's must leave room)
    assert len(engine.embed([rand_ids(64, 7)])[0]) == 128
    with pytest.raises(PromptTooLongError, match=r"prompts\[1\]: 65 tokens exceed max_model_len \(64 tokens\)"):
        engine.embed([[1, 2], rand_ids(65, 7)])
    assert_idle(engine)


def test_tensor_parallelism_is_refused_at_the_call(llm, monkeypatch):
    monkeypatch.setattr(llm.core.intake, "tensor_parallel_size", 2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        llm.embed("Hello")
    assert_idle(llm)
