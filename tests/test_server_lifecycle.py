"""The server's lifecycle routes (issue 45): POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping,
POST /reload, off unless enabled; 503 engine_sleeping for generation while asleep; a sleep that
waits for the requests in flight; a reload that reads the served directory again. In process
(Starlette's TestClient) and with `--api-server-count 2` (the engine process does them)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading

import pytest

from helpers import assert_all_blocks_free, live_server

httpx = pytest.importorskip("httpx", reason="the server tests need the test extras (httpx)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")

COMPLETIONS = "/v1/completions"
GREEDY = {"prompt": [11, 22, 33, 44, 55], "temperature": 0, "max_tokens": 8, "ignore_eos": True}


def tokens_of(client, body=GREEDY) -> list[int]:
    """The greedy answer's text (the tiny model's), as the tokens the completion returned."""
    r = client.post(COMPLETIONS, json={**body, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


@contextlib.contextmanager
def in_process(model: str, **options):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine
    from asyncllm.server import create_app

    engine = AsyncLLMEngine(model, num_kvcache_blocks=32)
    with TestClient(create_app(engine, "tiny", **options)) as client:
        yield client, engine


def test_routes_are_off_by_default(tiny_qwen3):
    with in_process(tiny_qwen3) as (client, _):
        for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/reload")]:
            assert client.request(method, path).status_code == 404, path
        assert client.get("/health").json() == {"status": "ready"}


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refuses_generation_and_wake_serves_the_same_tokens(tiny_qwen3, level):
    with in_process(tiny_qwen3, enable_lifecycle_routes=True) as (client, engine):
        before = tokens_of(client)
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        r = client.post(f"/sleep?level={level}")
        assert r.status_code == 200 and r.json() == {"is_sleeping": True}, r.text
        assert engine.is_sleeping
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert client.get("/health").json() == {"status": "sleeping"}
        assert_error(client.post(COMPLETIONS, json=GREEDY), 503, "engine_sleeping")
        assert_error(client.post(COMPLETIONS, json={**GREEDY, "stream": True}), 503, "engine_sleeping")
        assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}),
                     503, "engine_sleeping")
        assert_error(client.post("/v1/embeddings", json={"input": "Hi"}), 503, "engine_sleeping")
        assert_error(client.post("/reload"), 409, "engine_sleeping")  # wake it first
        r = client.post("/tokenize", json={"prompt": "Hello"})  # the tokenizer serves while asleep
        assert r.status_code == 200 and r.json()["tokens"], r.text
        assert client.post("/sleep?level=1").json() == {"is_sleeping": True}  # asleep already: nothing changes
        r = client.post("/wake_up")
        assert r.status_code == 200 and r.json() == {"is_sleeping": False}, r.text
        assert client.get("/health").json() == {"status": "ready"}
        assert tokens_of(client) == before
        assert client.post("/wake_up").json() == {"is_sleeping": False}  # awake: nothing changes
        assert_all_blocks_free(engine._engine_thread.core)


@pytest.mark.parametrize("query, param", [("level=3", "level"), ("level=one", "level"), ("level=", "level"),
                                          ("level=1&path=/etc", "path")])
def test_bad_sleep_queries_are_400_naming_the_parameter(tiny_qwen3, query, param):
    with in_process(tiny_qwen3, enable_lifecycle_routes=True) as (client, engine):
        error = assert_error(client.post(f"/sleep?{query}"), 400, "invalid_value")
        assert error["param"] == param
        assert not engine.is_sleeping
        assert_error(client.post("/reload?model=/etc"), 400, "invalid_value")  # a client never names a path


def test_lifecycle_routes_need_the_api_key(tiny_qwen3):
    with in_process(tiny_qwen3, api_key="k", enable_lifecycle_routes=True) as (client, engine):
        assert_error(client.post("/sleep"), 401, "invalid_api_key")
        assert_error(client.get("/is_sleeping"), 401, "invalid_api_key")
        assert not engine.is_sleeping
        assert client.post("/sleep", headers={"Authorization": "Bearer k"}).status_code == 200


def test_sleep_waits_for_the_request_in_flight(tiny_qwen3):
    # the request streaming when /sleep comes finishes whole; the sleep then happens
    with in_process(tiny_qwen3, enable_lifecycle_routes=True) as (client, engine):
        long = {**GREEDY, "max_tokens": 200, "stream": True}
        started, finish = threading.Event(), []

        def stream() -> None:
            with client.stream("POST", COMPLETIONS, json=long) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        finish.append(json.loads(line[6:])["choices"][0]["finish_reason"])
        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        r = client.post("/sleep?level=1")
        reader.join(60)
        assert r.status_code == 200, r.text
        assert finish[-1] == "length" and len(finish) > 1
        assert engine.is_sleeping
        assert client.post("/wake_up").status_code == 200
        assert_all_blocks_free(engine._engine_thread.core)


def test_reload_reads_the_served_directory_again(tiny_qwen3, tokenizer_dir, tmp_path):
    # new weights written into the served directory: /reload serves them, as a fresh server on them does
    from asyncllm.testing import build_tiny_checkpoint
    served = shutil.copytree(tiny_qwen3, tmp_path / "served")
    other = build_tiny_checkpoint(str(tmp_path / "other"), "qwen3", tokenizer_dir, seed=7)
    with in_process(other) as (client, _):
        expected = tokens_of(client)
    with in_process(str(served), enable_lifecycle_routes=True) as (client, engine):
        before = tokens_of(client)
        assert before != expected, "the two random checkpoints answer alike: the test could not tell"
        for name in os.listdir(other):
            if name.endswith(".safetensors"):
                shutil.copy(os.path.join(other, name), served / name)
        r = client.post("/reload")
        assert r.status_code == 200 and r.json() == {"reloaded": "tiny"}, r.text
        assert tokens_of(client) == expected
        assert_all_blocks_free(engine._engine_thread.core)


def test_front_ends_forward_the_routes_to_the_engine_process(tiny_qwen3, tmp_path):
    with live_server(tiny_qwen3, tmp_path, "--num-kvcache-blocks", "64", "--api-server-count", "2",
                     "--enable-lifecycle-routes") as server:
        with httpx.Client(base_url=server.base, timeout=120) as client:
            before = tokens_of(client)
            assert client.post("/sleep?level=2").json() == {"is_sleeping": True}
            # every front-end hears of it (the kernel hands each connection to one of them)
            for _ in range(8):
                with httpx.Client(base_url=server.base, timeout=120) as fresh:
                    assert fresh.get("/is_sleeping").json() == {"is_sleeping": True}
                    assert_error(fresh.post(COMPLETIONS, json=GREEDY), 503, "engine_sleeping")
            assert client.post("/wake_up").json() == {"is_sleeping": False}
            for _ in range(4):
                with httpx.Client(base_url=server.base, timeout=120) as fresh:
                    assert tokens_of(fresh) == before
            assert client.post("/reload").status_code == 200
            assert tokens_of(client) == before


class EngineRacedBySubmissions:
    """An engine whose sleep() finds a request that passed the gate as it closed, `races` times."""

    def __init__(self, races: int):
        self.races, self.sleep_calls, self.is_sleeping = races, 0, False

    async def wait_idle(self) -> None:
        pass

    async def sleep(self, level: int) -> None:
        from asyncllm.errors import EngineNotIdleError
        self.sleep_calls += 1
        if self.sleep_calls <= self.races:
            raise EngineNotIdleError("sleep(): 1 request(s) queued or running")
        self.is_sleeping = True


@pytest.mark.parametrize("races", [1, 3])
def test_a_sleep_raced_by_a_submission_waits_again(races):
    import anyio

    from asyncllm.server.lifecycle_routes import SLEEPING, LifecycleGate
    engine, changes = EngineRacedBySubmissions(races), []
    gate = LifecycleGate(engine, on_change=changes.append)
    anyio.run(gate.sleep, 1)
    assert engine.is_sleeping and engine.sleep_calls == races + 1
    assert changes == [SLEEPING, SLEEPING] and gate.closed_reason == SLEEPING  # closed, then asleep


def test_a_sleep_that_never_finds_the_engine_idle_gives_up_and_reopens():
    import anyio

    from asyncllm.errors import EngineNotIdleError
    from asyncllm.server.lifecycle_routes import MAX_IDLE_RETRIES, LifecycleGate
    engine = EngineRacedBySubmissions(races=10 ** 6)
    gate = LifecycleGate(engine)
    with pytest.raises(EngineNotIdleError):
        anyio.run(gate.sleep, 1)
    assert engine.sleep_calls == MAX_IDLE_RETRIES and gate.closed_reason is None and not engine.is_sleeping
