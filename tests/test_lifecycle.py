"""An engine's lifecycle in one process (issue 50), on CPU: several engines run side by side as each alone."""
from __future__ import annotations

import gc
import threading
import time

import anyio
import pytest
import torch

from asyncllm import AsyncLLMEngine, LLM, SamplingParams
from asyncllm.engine import startup_heap
from asyncllm.models import registry
from helpers import assert_all_blocks_free

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

KW = dict(device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# near-uniform draws: the tokens are the noise's, not the logits' argmax
SAMPLED = SamplingParams(temperature=50.0, max_tokens=8, ignore_eos=True)
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188]  # one full block and more
TIMEOUT = 120


def llm_tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate([PROMPT], params, use_tqdm=False)[0]["token_ids"]


async def stream_tokens(engine: AsyncLLMEngine, params: SamplingParams = GREEDY) -> list[int]:
    stream = engine.stream(PROMPT, params)
    async for _ in stream:
        pass
    return list(stream.token_ids)


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
