"""An engine's lifecycle in one process (issue 50), on CPU: close() releases every tensor, several
engines run side by side as each alone, sleep() / wake() and reload() between requests, and their
misuse. The GPU side (device memory returned, graphs after a wake) is in tests/test_gpu.py, the
timings in benchmarks/bench_lifecycle.py."""
from __future__ import annotations

import gc
import json
import os
import shutil
import threading
import time
import types
import weakref

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncllm import AsyncLLMEngine, EngineAsleepError, EngineDeadError, LLM, SamplingParams
from asyncllm.engine import lifecycle, startup_heap
from asyncllm.models import registry
from asyncllm.runner.model_runner import ModelRunner
from asyncllm.testing import build_tiny_checkpoint
from helpers import assert_all_blocks_free
from test_odd_inputs import ODD_ARGUMENTS

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

KW = dict(device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# near-uniform draws: the tokens are the noise's, not the logits' argmax
SAMPLED = SamplingParams(temperature=50.0, max_tokens=8, ignore_eos=True)
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188]  # one full block and more
TIMEOUT = 120


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory, tokenizer_dir) -> str:
    """tiny_qwen3's structure, other weights, and a tokenizer with the ids of "a" and "b" swapped."""
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3-other")), "qwen3", tokenizer_dir, seed=7)
    with open(os.path.join(path, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    if os.path.exists(os.path.join(path, "vocab.json")):
        os.remove(os.path.join(path, "vocab.json"))  # the slow tokenizer's copy, unswapped
    return path


def llm_tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate([PROMPT], params, use_tqdm=False)[0]["token_ids"]


async def stream_tokens(engine: AsyncLLMEngine, params: SamplingParams = GREEDY) -> list[int]:
    stream = engine.stream(PROMPT, params)
    async for _ in stream:
        pass
    return list(stream.token_ids)


def engine_tensors(runner) -> dict[str, weakref.ref]:
    """Weak references to the device state a runner holds: the KV cache, every weight and buffer,
    and the penalties' token counts."""
    tensors = {"kv_cache": runner.kv_cache, "token_counts": runner.sampling_inputs.token_counts.output_counts,
               **dict(runner.model.named_parameters()), **dict(runner.model.named_buffers())}
    return {name: weakref.ref(tensor) for name, tensor in tensors.items()}


# ---- close ------------------------------------------------------------------------------------------------------
def test_llm_close_releases_every_tensor_while_the_llm_is_still_held(tiny_qwen3):
    llm = LLM(tiny_qwen3, **KW)
    llm_tokens(llm, SamplingParams(max_tokens=4, presence_penalty=0.5, logprobs=2))  # penalties: token counts
    tensors = engine_tensors(llm.core.runner)
    llm.close()  # no gc.collect() here: close() frees them itself
    assert [name for name, ref in tensors.items() if ref() is not None] == []
    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.close()  # again: nothing


async def test_async_engine_shutdown_releases_every_tensor_while_the_engine_is_still_held(tiny_qwen3):
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **KW) as engine:
            await stream_tokens(engine, SamplingParams(max_tokens=4, repetition_penalty=1.2))
            tensors = engine_tensors(engine._core.runner)
        assert [name for name, ref in tensors.items() if ref() is not None] == []
        with pytest.raises(EngineDeadError):
            await engine.sleep()


# ---- several engines in one process -----------------------------------------------------------------------------
async def test_two_engines_of_different_models_stream_at_once_as_each_alone(tiny_qwen3, tiny_qwen3_tied):
    """Greedy and sampled (unseeded) tokens of each engine with the other streaming beside it equal
    its tokens alone: each engine draws its noise from its own generator, seeded by its Config.seed,
    not from the process's (which another engine's start re-seeded)."""
    models = (tiny_qwen3, tiny_qwen3_tied)

    async def run(engine: AsyncLLMEngine, model: str, out: dict) -> None:
        out[model] = [await stream_tokens(engine, GREEDY), await stream_tokens(engine, SAMPLED),
                      await stream_tokens(engine, SAMPLED)]

    with anyio.fail_after(TIMEOUT):
        alone: dict[str, list] = {}
        for model in models:
            async with AsyncLLMEngine(model, **KW) as engine:
                await run(engine, model, alone)
        assert alone[tiny_qwen3][0] != alone[tiny_qwen3_tied][0]  # two different models
        together: dict[str, list] = {}
        async with AsyncLLMEngine(models[0], **KW) as first, AsyncLLMEngine(models[1], **KW) as second:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(run, first, models[0], together)
                tasks.start_soon(run, second, models[1], together)
            for engine in (first, second):
                await engine.wait_idle()
                assert_all_blocks_free(engine._core)
    assert together == alone


def test_an_engine_leaves_the_process_random_state_alone(tiny_qwen3):
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    with LLM(tiny_qwen3, **KW, seed=5) as llm:
        first = llm_tokens(llm, SAMPLED)
    assert torch.equal(torch.get_rng_state(), state)
    with LLM(tiny_qwen3, **KW, seed=5) as llm:  # its own generator: the same seed, the same draws
        assert llm_tokens(llm, SAMPLED) == first


def test_building_a_model_leaves_other_threads_default_dtype_alone(tiny_qwen3, monkeypatch):
    """The model is built in the engine's dtype without torch.set_default_dtype, which is the whole
    process's: another thread (another engine, the application) making a tensor meanwhile keeps float32."""
    seen = []
    build = registry.CausalLM

    def build_while_another_thread_makes_a_tensor(*args, **kwargs):
        other = threading.Thread(target=lambda: seen.append(torch.empty(1).dtype))
        other.start()
        other.join()
        return build(*args, **kwargs)

    monkeypatch.setattr(registry, "CausalLM", build_while_another_thread_makes_a_tensor)
    with LLM(tiny_qwen3, **KW, dtype="bfloat16") as llm:
        runner = llm.core.runner
        assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
        assert runner.model.model.rotary_emb.cos_sin_cache.dtype == torch.float32  # a buffer that names its dtype
    assert seen == [torch.float32] and torch.get_default_dtype() == torch.float32


def test_an_engine_starting_while_another_freezes_the_heap_keeps_its_objects_collectable(monkeypatch):
    """The first engine's start freezes the heap; a second engine starting meanwhile waits for that
    freeze, so nothing it makes after its own call is frozen (and never collected)."""
    frozen_ids, collecting = [], threading.Event()

    class SlowCollector:  # the first engine's collection takes a while; freeze records what it would freeze
        @staticmethod
        def collect():
            collecting.set()
            time.sleep(0.5)

        @staticmethod
        def freeze():
            frozen_ids.append({id(o) for o in gc.get_objects()})

    monkeypatch.setattr(startup_heap, "gc", SlowCollector)
    monkeypatch.setattr(startup_heap, "_frozen", False)
    first = threading.Thread(target=startup_heap.freeze_startup_heap)
    first.start()
    assert collecting.wait(30)
    startup_heap.freeze_startup_heap()  # the second engine's
    made_after = [object()]
    first.join()
    assert len(frozen_ids) == 1 and id(made_after) not in frozen_ids[0]


# ---- sleep and wake ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", [1, 2])
def test_llm_sleep_frees_the_kv_cache_and_wake_gives_the_same_tokens(tiny_qwen3, level):
    with LLM(tiny_qwen3, **KW) as llm:
        before = llm_tokens(llm)
        assert llm_tokens(llm) == before and llm.core.stats()["prefix_cache_hits"] > 0  # the prompt's block hit
        runner = llm.core.runner
        kv_cache, weight = weakref.ref(runner.kv_cache), runner.model.lm_head.weight
        llm.sleep(level)
        assert llm.is_sleeping and kv_cache() is None and runner.graph_runner is None
        # level 2 drops the weights; level 1 keeps them in host memory, which on CPU is where they are
        assert (weight.untyped_storage().nbytes() == 0) == (level == 2)
        with pytest.raises(EngineAsleepError, match="wake"):
            llm.generate([PROMPT], GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="asleep already"):
            llm.sleep(1)
        with pytest.raises(EngineAsleepError, match="wake"):
            llm.reload(tiny_qwen3)
        llm.wake()
        assert not llm.is_sleeping
        hits = llm.core.stats()["prefix_cache_hits"]
        assert llm_tokens(llm) == before
        assert llm.core.stats()["prefix_cache_hits"] == hits  # the prefix cache was emptied
        llm.wake()  # awake: nothing
        assert llm_tokens(llm) == before
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
async def test_async_sleep_between_requests_and_wake(tiny_qwen3, overlap):
    """Straight after a stream ends (with overlap a step of its may still be in flight), sleep()
    runs; a stream while asleep is refused at the call; after wake() the tokens are the same."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **KW, overlap_scheduling=overlap) as engine:
            before = await stream_tokens(engine)
            await engine.sleep(2)
            assert engine.is_sleeping
            with pytest.raises(EngineAsleepError):
                engine.stream(PROMPT, GREEDY)
            with pytest.raises(EngineAsleepError):
                await engine.generate(PROMPT, GREEDY)
            assert engine.encode("hello") and engine.max_seq_len  # what needs no device still answers
            await engine.wake()
            assert not engine.is_sleeping and await stream_tokens(engine) == before
            await engine.wait_idle()
            assert_all_blocks_free(engine._core)


async def test_sleep_and_reload_while_a_request_runs_are_refused_and_it_goes_on(tiny_qwen3):
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **{**KW, "num_kvcache_blocks": 256}) as engine:
            alone = await stream_tokens(engine)
            running = engine.stream(PROMPT, SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
            await running.__anext__()
            with pytest.raises(RuntimeError, match="1 request"):
                await engine.sleep()
            with pytest.raises(RuntimeError, match="1 request"):
                await engine.reload(tiny_qwen3)
            assert not engine.is_sleeping and engine.config.model == tiny_qwen3
            engine.abort(running.request_id)
            await engine.sleep()  # posted after the abort: applied after it, with nothing left running
            async for _ in running:
                pass
            made = min(len(alone), len(running.token_ids))
            assert running.finish_reason == "abort" and made and list(running.token_ids[:made]) == alone[:made]
            await engine.wake()
            assert await stream_tokens(engine) == alone
            await engine.wait_idle()
            assert_all_blocks_free(engine._core)


def test_a_wake_that_fails_leaves_the_engine_asleep(tiny_qwen3, monkeypatch):
    with LLM(tiny_qwen3, **KW) as llm:
        before = llm_tokens(llm)
        llm.sleep(2)
        allocate = ModelRunner._allocate_kv_cache

        def no_memory(self):
            raise MemoryError("no memory for the KV cache")

        monkeypatch.setattr(ModelRunner, "_allocate_kv_cache", no_memory)
        with pytest.raises(MemoryError):
            llm.wake()
        runner = llm.core.runner
        assert llm.is_sleeping and runner.kv_cache is None and runner.attn_backend is None
        assert runner.model.lm_head.weight.untyped_storage().nbytes() == 0  # dropped again
        monkeypatch.setattr(ModelRunner, "_allocate_kv_cache", allocate)
        llm.wake()
        assert llm_tokens(llm) == before


def test_sleep_levels_and_reload_models_are_checked_at_the_call(tiny_qwen3):
    with LLM(tiny_qwen3, **KW) as llm:
        counts = {"refused": 0}
        for value in ODD_ARGUMENTS:
            for call, argument in ((llm.sleep, "level"), (llm.reload, "model")):
                if argument == "level" and value in (1, 2) and not isinstance(value, bool):
                    continue
                with pytest.raises((ValueError, TypeError)) as refused:
                    call(value)
                assert argument in str(refused.value) and len(str(refused.value)) < 500, (value, refused.value)
                counts["refused"] += 1
        assert not llm.is_sleeping and counts["refused"] == 2 * len(ODD_ARGUMENTS) - 2  # all but level 1 and 2
        assert_all_blocks_free(llm)


def test_sleep_wake_and_reload_are_refused_with_tensor_parallelism():
    core = types.SimpleNamespace(config=types.SimpleNamespace(tensor_parallel_size=2), sleep_level=None)
    for call in (lambda: lifecycle.sleep(core, 1), lambda: lifecycle.wake(core),
                 lambda: lifecycle.reload(core, None)):
        with pytest.raises(NotImplementedError, match="tensor parallelism"):
            call()


# ---- reload -----------------------------------------------------------------------------------------------------
def test_reload_serves_the_other_checkpoint_as_a_fresh_engine_does(tiny_qwen3, other_weights):
    with LLM(other_weights, **KW) as fresh:
        theirs, their_a = llm_tokens(fresh), fresh.tokenizer.encode("a")
        their_text = fresh.generate(["a b"], GREEDY, use_tqdm=False)[0]
    with LLM(tiny_qwen3, **KW) as llm:
        ours, our_a = llm_tokens(llm), llm.tokenizer.encode("a")
        assert ours != theirs and our_a != their_a  # other weights, and another tokenizer
        llm_tokens(llm)  # the prompt's first block is cached now
        hits = llm.core.stats()["prefix_cache_hits"]
        llm.reload(other_weights)
        assert llm_tokens(llm) == theirs
        assert llm.core.stats()["prefix_cache_hits"] == hits  # the old weights' KV is gone
        assert llm.tokenizer.encode("a") == their_a and llm.core.tokenizer is llm.tokenizer
        assert llm.generate(["a b"], GREEDY, use_tqdm=False)[0] == their_text  # encoded, decoded by the new one
        assert llm.core.config.model == other_weights
        llm.reload(tiny_qwen3)
        assert llm_tokens(llm) == ours and llm.tokenizer.encode("a") == our_a
        assert_all_blocks_free(llm)


async def test_async_reload(tiny_qwen3, other_weights):
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(other_weights, **KW) as fresh:
            theirs = await stream_tokens(fresh)
        async with AsyncLLMEngine(tiny_qwen3, **KW) as engine:
            ours = await stream_tokens(engine)
            await engine.reload(other_weights)
            assert await stream_tokens(engine) == theirs and engine.encode("a") == engine.tokenizer.encode("a")
            assert engine.config.model == other_weights
            await engine.reload(tiny_qwen3)
            assert await stream_tokens(engine) == ours


def test_reload_of_another_structure_is_refused_and_the_engine_serves_on(tiny_qwen3, tiny_qwen3_tied, tmp_path,
                                                                          tokenizer_dir):
    wider = build_tiny_checkpoint(str(tmp_path / "wider"), "qwen3", tokenizer_dir, hidden_size=256)
    with LLM(tiny_qwen3, **KW) as llm:
        before = llm_tokens(llm)
        with pytest.raises(ValueError, match=r"hidden_size 256 \(the engine's: 128\)"):
            llm.reload(wider)
        with pytest.raises(ValueError, match="tie_word_embeddings True"):
            llm.reload(tiny_qwen3_tied)
        with pytest.raises(ValueError, match="model"):
            llm.reload(str(tmp_path / "nowhere"))
        assert llm_tokens(llm) == before and llm.core.config.model == tiny_qwen3


def test_a_checkpoint_that_fails_to_load_leaves_the_engine_on_its_own_weights(tiny_qwen3, other_weights, tmp_path):
    """Every tensor of the broken checkpoint but one loads before the missing one is noticed: the
    engine reads its own weights back."""
    broken = tmp_path / "broken"
    shutil.copytree(other_weights, broken)
    (weights_file,) = [name for name in os.listdir(broken) if name.endswith(".safetensors")]
    tensors = load_file(broken / weights_file)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, broken / weights_file, metadata={"format": "pt"})
    with LLM(tiny_qwen3, **KW) as llm:
        before, our_a = llm_tokens(llm), llm.tokenizer.encode("a")
        with pytest.raises(ValueError, match="missing weights"):
            llm.reload(str(broken))
        assert llm_tokens(llm) == before and llm.core.config.model == tiny_qwen3
        assert llm.tokenizer.encode("a") == our_a  # its own tokenizer still


async def test_a_reload_that_cannot_restore_the_weights_ends_the_engine(tiny_qwen3, other_weights, tmp_path,
                                                                        monkeypatch):
    """Neither the new checkpoint nor the engine's own can be read: the engine is dead, and says so
    to the caller and to every later call."""
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **KW) as engine:
            await stream_tokens(engine)
            load = ModelRunner.load_checkpoint

            def load_then_fail(self, weights):
                load(self, list(weights)[:3])  # a few tensors in, then the files are gone
                raise ValueError("the file vanished")

            monkeypatch.setattr(ModelRunner, "load_checkpoint", load_then_fail)
            with pytest.raises(EngineDeadError, match="cannot serve"):
                await engine.reload(other_weights)
            with pytest.raises(EngineDeadError):
                engine.stream(PROMPT, GREEDY)
