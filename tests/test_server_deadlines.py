"""Request deadlines at the OpenAI server: a request's `timeout` field and the server's
request_timeout (`asyncllm serve --request-timeout`), in-process through httpx.ASGITransport, and
through the official openai client.

A request with no token by its deadline gets 408 (streamed: an error event with that body, then
[DONE]); one generating then ends with finish_reason "timeout" and the text so far, which the
official client accepts (its finish_reason Literal is not enforced on responses). The engine's
deadlines run on a StepClock (one second per step), so a timeout counts steps.
"""
from __future__ import annotations

import json

import anyio
import pytest

from asyncllm import AsyncLLMEngine
from helpers import StepClock

httpx = pytest.importorskip("httpx", reason="the server tests need the test extras (httpx)")
openai = pytest.importorskip("openai", reason="the server tests need the test extras (openai)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
from asyncllm.server import RequestLimits, create_app  # noqa: E402 - after the skip

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
TIMEOUT = 120  # seconds of real time for a test: a hang fails, a busy machine does not
LONG = {"max_tokens": 60, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
async def engine(tiny_qwen3):
    """One sequence slot, so that a request waits while another runs; deadlines on a StepClock."""
    async with AsyncLLMEngine(tiny_qwen3, num_kvcache_blocks=64, kvcache_block_size=16, max_model_len=256,
                              max_num_seqs=1) as engine:
        StepClock().install(engine._core)
        yield engine


def client_of(engine, **options) -> httpx.AsyncClient:
    app = create_app(engine, "tiny", manage_engine=False, **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    # max_retries=0: the client retries a 408 by default
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)


def sse_data(text: str) -> list:
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


async def assert_idle(engine) -> None:
    await engine.wait_idle()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def while_another_runs(engine, http: httpx.AsyncClient, request) -> None:
    """Run request() while a long completion holds the engine's one slot (it must still complete)."""
    async with anyio.create_task_group() as tasks:
        async def long_one() -> None:
            response = await http.post(COMPLETIONS, json={"prompt": "Hello", **LONG})
            assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
        tasks.start_soon(long_one)
        while engine.stats()["num_running"] == 0:
            await anyio.sleep(0.01)
        await request()


async def test_an_answer_that_runs_past_its_timeout_ends_with_finish_reason_timeout(engine):
    with anyio.fail_after(TIMEOUT):
        async with client_of(engine) as http:
            client = openai_client(http)
            answer = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=60,
                                                          extra_body={"timeout": 5, "ignore_eos": True})
            assert answer.choices[0].finish_reason == "timeout"
            assert 1 <= answer.usage.completion_tokens < 60 and answer.choices[0].message.content
            chunks = [chunk async for chunk in await client.completions.create(
                model="tiny", prompt="Hello", max_tokens=60, stream=True, extra_body={"timeout": 5, "ignore_eos": True})]
            finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices]
            assert finishes[-1] == "timeout" and finishes[:-1] == [None] * (len(finishes) - 1)
            assert "".join(choice.text for chunk in chunks for choice in chunk.choices)
            # the raw stream: the finish chunk, then [DONE]
            response = await http.post(CHAT, json={"messages": MESSAGES, "timeout": 5, "stream": True, **LONG})
            events = sse_data(response.text)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "timeout"
            metrics = (await http.get("/metrics")).text
            assert 'asyncllm_requests_total{finish_reason="timeout",model_name="tiny"} 3.0' in metrics
    await assert_idle(engine)


async def test_a_request_with_no_token_by_its_timeout_gets_408(engine):
    with anyio.fail_after(TIMEOUT):
        async with client_of(engine) as http:
            async def refused() -> None:
                response = await http.post(CHAT, json={"messages": MESSAGES, "timeout": 3, **LONG})
                assert response.status_code == 408, response.text
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
                assert "no token within its timeout of 3 s" in error["message"]
            await while_another_runs(engine, http, refused)

            async def refused_to_the_official_client() -> None:
                with pytest.raises(openai.APIStatusError) as info:
                    await openai_client(http).completions.create(model="tiny", prompt="Hi", max_tokens=5,
                                                                 extra_body={"timeout": 3})
                assert info.value.status_code == 408
            await while_another_runs(engine, http, refused_to_the_official_client)

            async def refused_streamed() -> None:  # the status line went out: an error event, then [DONE]
                response = await http.post(CHAT, json={"messages": MESSAGES, "timeout": 3, "stream": True, **LONG})
                assert response.status_code == 200
                events = sse_data(response.text)
                assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
                assert all(not e["choices"][0]["delta"].get("content") for e in events[:-2])
            await while_another_runs(engine, http, refused_streamed)
    await assert_idle(engine)


async def test_the_server_request_timeout_is_the_default_and_the_most_a_request_may_ask(engine):
    with anyio.fail_after(TIMEOUT):
        async with client_of(engine, request_timeout=5) as http:
            for body in ({}, {"timeout": 2}):  # the default; a shorter one of its own
                response = await http.post(COMPLETIONS, json={"prompt": "Hello", **LONG, **body})
                assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "timeout"
            response = await http.post(COMPLETIONS, json={"prompt": "Hello", **LONG, "timeout": 6})
            assert response.status_code == 400 and response.json()["error"]["param"] == "timeout"
            assert "limit of 5 s" in response.json()["error"]["message"]
        async with client_of(engine) as http:  # no server timeout: no limit
            response = await http.post(COMPLETIONS, json={"prompt": "Hello", **LONG, "max_tokens": 5})
            assert response.json()["choices"][0]["finish_reason"] == "length"
    await assert_idle(engine)


@pytest.mark.parametrize("value", [0, -1, float("inf"), "5", True])
def test_a_bad_server_request_timeout_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="^request_timeout: expected None or a finite number of seconds > 0"):
        RequestLimits(request_timeout=value)
