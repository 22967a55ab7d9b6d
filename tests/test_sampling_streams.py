"""n > 1, logprobs and stop reasons through AsyncLLMEngine: streams tagged by index, generate()
returning every sequence, and cancelling one stream ending all of its sequences."""
from __future__ import annotations

import anyio
import pytest

from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.llm import LLM
from asyncllm.sampling_params import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ENGINE_KW = dict(num_kvcache_blocks=64, kvcache_block_size=16)
PROMPT = list(range(1000, 1040))  # 40 tokens: 2 full blocks and a partial one
TIMEOUT = 60


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlap"])
def overlap(request):
    return request.param


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    llm = LLM(tiny_qwen3, **ENGINE_KW)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=5, logprobs=2)
    return llm.generate([PROMPT], params, use_tqdm=False)[0]


async def idle(engine: AsyncLLMEngine) -> None:
    await engine.wait_idle()
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_stream_and_generate_with_n(tiny_qwen3, overlap, reference):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=5, logprobs=2)
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, overlap_scheduling=overlap, **ENGINE_KW) as engine:
            tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
            texts: dict[int, str] = {0: "", 1: "", 2: ""}
            finished = {}
            async for out in engine.stream(PROMPT, params):
                tokens[out.index] += out.token_ids
                texts[out.index] += out.text
                assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
                assert [lp.token_id for lp in out.logprobs] == out.token_ids
                if out.finish_reason is not None:
                    finished[out.index] = out.finish_reason
            assert finished == {0: "length", 1: "length", 2: "length"}
            assert [tokens[i] for i in range(3)] == [r["token_ids"] for r in reference]
            assert [texts[i] for i in range(3)] == [r["text"] for r in reference]
            results = await engine.generate(PROMPT, params)
            assert [r.index for r in results] == [0, 1, 2]
            assert [r.token_ids for r in results] == [r["token_ids"] for r in reference]
            assert all(len(r.logprobs) == 10 and r.finish_reason == "length" for r in results)
            assert results[0].metrics.num_completion_tokens == 30
            single = await engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
            assert single.index == 0 and single.logprobs is None and len(single.token_ids) == 4
            await idle(engine)


async def test_cancelling_a_stream_aborts_all_its_sequences(tiny_qwen3, overlap):
    params = SamplingParams(temperature=1.0, max_tokens=500, ignore_eos=True, n=4)
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, overlap_scheduling=overlap, **ENGINE_KW) as engine:
            seen = set()
            stream = engine.stream(PROMPT, params)
            async for out in stream:
                seen.add(out.index)
                if len(seen) == 4:
                    break
            await stream.aclose()
            await idle(engine)  # every block of the four sequences (and the shared prompt) is free
            assert stream.finish_reason == "abort"


async def test_stop_string_ends_only_its_sequence_and_reports_stop_reason(tiny_qwen3, overlap):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, overlap_scheduling=overlap, **ENGINE_KW) as engine:
            plain = await engine.generate("Hello, my name is", greedy)
            stop = plain.text[len(plain.text) // 2:][:2]
            if not stop.strip():
                pytest.skip("no printable text to stop on")
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2, stop=[stop])
            results = await engine.generate("Hello, my name is", params)
            for result in results:
                assert result.finish_reason == "stop" and result.stop_reason == stop
                assert stop not in result.text and plain.text.startswith(result.text)
            stop_id = plain.token_ids[4]
            result = await engine.generate("Hello, my name is", SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]))
            assert result.finish_reason == "stop" and result.stop_reason == stop_id
            assert result.token_ids == plain.token_ids[:5]
            await idle(engine)


async def test_generate_returns_prompt_logprobs(tiny_qwen3, overlap):
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, overlap_scheduling=overlap, **ENGINE_KW) as engine:
            result = await engine.generate(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=1, logprobs=1))
            assert len(result.prompt_logprobs) == len(PROMPT) and result.prompt_logprobs[0] is None
            assert [e.token_id for e in result.prompt_logprobs[1:]] == PROMPT[1:]
            assert all(isinstance(e.token, str) and len(e.top) == 1 for e in result.prompt_logprobs[1:])
            await idle(engine)
