"""What one request can do to the engine (issue 18): parameters changed after submission, numbers
too large for a float, ids that collide, streams read from another event loop, prompts too long
to tokenize, stats read right after the last item. Each must leave the engine serving the others.
"""
from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.errors import QueueFullError
from asyncllm.llm import LLM
from asyncllm.runner.launched_step import LaunchedStep
from asyncllm.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from helpers import anyio_asyncio_and_trio  # noqa: F401 - a fixture: both event loops

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ENGINE_KW = dict(num_kvcache_blocks=128, kvcache_block_size=16)
TIMEOUT = 60


async def all_free(engine: AsyncLLMEngine) -> None:
    await engine.wait_idle()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.mark.parametrize("field, value", [
    ("top_k", 10 ** 30), ("max_tokens", "5"), ("temperature", "0.7"), ("stop_token_ids", [1.5]), ("min_p", None),
    ("stop", 7), ("seed", 2 ** 70)])
async def test_params_changed_after_submission_never_reach_the_engine(tiny_qwen3, field, value):
    shared = SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True, seed=1)
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
            stream = engine.stream("Hello there", shared)
            setattr(shared, field, value)  # after submission: the request kept its own snapshot
            token_ids = [t async for out in stream for t in out.token_ids]
            assert len(token_ids) == 6 and stream.finish_reason == "length"
            # the changed object is refused at the next submission, naming the field
            with pytest.raises((ValueError, TypeError), match=f"SamplingParams.{field}"):
                engine.stream("Hello again", shared)
            result = await engine.generate("Still serving", SamplingParams(temperature=0, max_tokens=3,
                                                                          ignore_eos=True))
            assert len(result.token_ids) == 3
            await all_free(engine)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [10 ** 400, -(10 ** 400), 10 ** 5000], ids=["1e400", "-1e400", "1e5000"])
def test_numbers_too_large_for_a_float_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}: expected a finite number") as info:
        SamplingParams(**{field: value})
    assert len(str(info.value)) < 200  # a 5,000-digit int is not printed whole


def test_stop_strings_are_bounded_in_count_and_length():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS + [], include_stop_str_in_output=False)
    SamplingParams(stop=["y" * MAX_STOP_STRING_CHARS])
    with pytest.raises(ValueError, match=f"SamplingParams.stop: at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match="SamplingParams.stop: a stop string may have at most"):
        SamplingParams(stop=["y" * (MAX_STOP_STRING_CHARS + 1)])


async def test_automatic_request_ids_never_collide_with_chosen_ones(tiny_qwen3):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
            # the ids an automatic counter would hand out first, taken by callers
            chosen = [engine.stream("Hi", params, request_id=f"req-{i}") for i in range(3)]
            automatic = [engine.stream("Hi", params) for _ in range(3)]
            for stream in chosen + automatic:
                async for _ in stream:
                    pass
                assert stream.finish_reason == "length", stream.request_id
            assert len({s.request_id for s in chosen + automatic}) == 6
            await all_free(engine)


async def test_stats_show_the_request_gone_when_its_last_item_arrives(tiny_qwen3):
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
            for i in range(20):
                params = SamplingParams(temperature=0, max_tokens=1 + i % 3, ignore_eos=True)
                async for out in engine.stream("Count with me", params):
                    if out.finish_reason is not None:
                        stats = engine.stats()
                        assert stats["num_running"] == 0 and stats["num_waiting"] == 0, (i, stats)
                        assert stats["num_free_blocks"] == stats["num_total_blocks"], (i, stats)


async def test_stream_created_in_another_event_loop_is_woken_in_the_reading_one(tiny_qwen3):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
            # made under asyncio.run in another thread, whose loop has ended by the time we read
            made = []

            async def make() -> None:
                made.append(engine.stream("Made elsewhere", params))
            thread = threading.Thread(target=lambda: asyncio.run(make()))
            thread.start()
            await anyio.to_thread.run_sync(thread.join)

            # made in a loop that stays alive but idle (it would only wake when something else woke it)
            idle_loop_ready, stop_idle_loop = threading.Event(), threading.Event()

            async def make_and_idle() -> None:
                made.append(engine.stream("Made in an idle loop", params))
                idle_loop_ready.set()
                await asyncio.get_running_loop().run_in_executor(None, stop_idle_loop.wait)
            idle = threading.Thread(target=lambda: asyncio.run(make_and_idle()))
            idle.start()
            await anyio.to_thread.run_sync(idle_loop_ready.wait)
            try:
                for stream in made:
                    token_ids = [t async for out in stream for t in out.token_ids]
                    assert len(token_ids) == 8 and stream.finish_reason == "length"
            finally:
                stop_idle_loop.set()
                await anyio.to_thread.run_sync(idle.join)
            await all_free(engine)


async def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(tiny_qwen3, monkeypatch):
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
            core = engine._core
            limit = core.max_prompt_chars
            assert limit >= core.max_seq_len

            def must_not_tokenize(*args, **kwargs):
                raise AssertionError("the tokenizer ran on a prompt that cannot fit")
            monkeypatch.setattr(core.tokenizer, "encode", must_not_tokenize)
            with pytest.raises(ValueError, match=fr"prompt: {limit + 1} characters cannot fit in max_model_len "
                                                 fr"\({core.max_seq_len} tokens\)"):
                engine.stream("a" * (limit + 1))
            monkeypatch.undo()
            result = await engine.generate("a short one", SamplingParams(max_tokens=2, ignore_eos=True))
            assert len(result.token_ids) == 2


def test_a_step_that_returns_the_wrong_number_of_tokens_fails_loudly(tiny_qwen3, monkeypatch):
    llm = LLM(tiny_qwen3, **ENGINE_KW)
    token_ids = LaunchedStep.token_ids
    monkeypatch.setattr(LaunchedStep, "token_ids", lambda self: token_ids(self) + [0])
    with pytest.raises(RuntimeError, match="sampled 2 tokens for 1 sampling rows"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)


# ---- issue 52 -------------------------------------------------------------------------------------
async def test_constraints_that_leave_no_token_to_sample_are_refused_at_submission(tiny_qwen3):
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
            tokenizer = engine.tokenizer
            hello = sorted({*tokenizer.encode("Hello", add_special_tokens=False),
                            *tokenizer.encode(" Hello", add_special_tokens=False)})
            assert len(hello) == 2  # one token in each form: a one-token bad word
            eos = sorted(engine._core.eos_token_ids)
            refused = [(dict(allowed_token_ids=hello, bad_words=["Hello"]), "allowed_token_ids, bad_words:"),
                       (dict(allowed_token_ids=[7, 8], stop_token_ids=[7, 8], min_tokens=1),
                        "allowed_token_ids, stop_token_ids, min_tokens:"),
                       (dict(allowed_token_ids=eos, min_tokens=3), "allowed_token_ids, ignore_eos, min_tokens:"),
                       (dict(allowed_token_ids=[hello[0], 7], bad_words=["Hello"], stop_token_ids=[7], min_tokens=1),
                        "allowed_token_ids, bad_words, stop_token_ids, min_tokens:")]
            for fields, named in refused:
                params = SamplingParams(temperature=0, max_tokens=4, **fields)
                with pytest.raises(ValueError, match=f"SamplingParams.{named} .* no token could be sampled"):
                    engine.stream("Say it", params)
            # the same bans leave a token where a constraint is lifted: these run, within their constraints
            accepted = [dict(allowed_token_ids=[*hello, 9], bad_words=["Hello"]),
                        dict(allowed_token_ids=[7, 8], stop_token_ids=[7, 8]),  # no min_tokens: 7 or 8 ends it
                        dict(allowed_token_ids=eos + [9], min_tokens=2),
                        dict(allowed_token_ids=eos, min_tokens=2, ignore_eos=True)]
            for fields in accepted:
                result = await engine.generate("Say it", SamplingParams(temperature=0, max_tokens=4, **fields))
                banned = set(hello) if "bad_words" in fields else set()
                assert set(result.token_ids) <= set(fields["allowed_token_ids"]) - banned, (fields, result)
            await all_free(engine)


async def test_the_queue_limit_counts_only_requests_beyond_the_free_sequence_slots(tiny_qwen3):
    # --max-queued-requests 4 --max-num-seqs 2 admitted 4 of a burst of 40, not 2 to run + 4 to wait
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    def burst() -> list:
        streams = []
        with pytest.raises(QueueFullError):
            for _ in range(40):  # no await between them: the engine thread applies them as it can
                streams.append(engine.stream([5, 6, 7], params))
        return streams

    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, max_num_seqs=2, max_queued_requests=4, **ENGINE_KW) as engine:
            streams = burst()
            assert len(streams) == 6  # on an idle engine: 2 slots free + 4 queued
            for stream in streams[:2]:  # the first two run (first come, first served)
                await stream.__anext__()
            for stream in streams[2:]:
                await stream.aclose()
            while engine.stats()["num_waiting"] or engine.stats()["num_inbox"]:  # the aborts applied
                await anyio.sleep(0.01)
            assert engine.stats()["num_running"] == 2
            more = burst()
            assert len(more) == 4  # no slot free: only the queue's 4
            for stream in streams[:2] + more:
                await stream.aclose()
            await all_free(engine)
