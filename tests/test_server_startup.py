"""The server while its engine starts (server/lifespan.py): HTTP answers at once, /health says 503
"starting" with the phase and then 200 "ready", every other route but /metrics gets a 503 at once
(never a wait), and a start-up that fails stops `asyncllm serve` with one line and exit code 2.

The start-up is held where it waits for its tokenizer (the request-intake phase: the tokenizer loads on a thread
beside the model's build, models/tokenizer_loader.py) until the test lets it go: in-process by a patched
load_tokenizer, in `asyncllm serve` by a wrapper that patches it the same way before running the
command (it waits for a file)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from asyncllm.startup import STARTUP_PHASES
from helpers import engine_threads, live_server, wait_healthy

httpx = pytest.importorskip("httpx", reason="the server tests need the server/test extras (httpx)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")

pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120
KEY = "start-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELD_PHASE = "request intake"  # where a held tokenizer load holds the start-up
ENGINE_KW = dict(num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=64)
COMPLETION = {"prompt": "Hi", "max_tokens": 2}

# `asyncllm ARGS...` with its start-up held at its tokenizer (the request-intake phase) until the file argv[1] exists;
# if that file says "fail", loading the tokenizer fails
_HELD_SERVE = """
import os, sys, time
from asyncllm.models import tokenizer_loader
real = tokenizer_loader.load_tokenizer
def held(model):
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    if open(sys.argv[1]).read() == "fail":
        raise ValueError("tokenizer refused by the test")
    return real(model)
tokenizer_loader.load_tokenizer = held
from asyncllm import cli
sys.exit(cli.main(sys.argv[2:]))
"""


def assert_starting_error(response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "server_starting", response.text
    assert "start-up phase: request intake" in response.json()["error"]["message"]
    assert response.headers["retry-after"] == "1"


# ---- in process ----------------------------------------------------------------------------------------
@pytest.fixture
def held_tokenizer(monkeypatch):
    from asyncllm.models import tokenizer_loader
    release, fail = threading.Event(), threading.Event()
    real = tokenizer_loader.load_tokenizer

    def held(model):
        release.wait(TIMEOUT)
        if fail.is_set():
            raise ValueError("tokenizer refused by the test")
        return real(model)
    monkeypatch.setattr(tokenizer_loader, "load_tokenizer", held)
    yield release, fail
    release.set()  # a test that failed early must not leave the engine thread waiting


def wait_for_health(get, status: int, phase: str | None = None):
    """/health's answer once it has this status (and phase); while starting, every answer says so."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        response = get()
        if response.status_code == 503 and response.json().get("status") == "starting":
            # "starting": before the engine's first phase, or after its last until the lifespan's background
            # start has finished (server/lifespan.py; a busy CI host met the second window)
            assert set(response.json()) == {"status", "phase"} and response.json()["phase"] in (*STARTUP_PHASES,
                                                                                               "starting")
            assert response.headers["retry-after"] == "1"
        if response.status_code == status and (phase is None or response.json().get("phase") == phase):
            return response
        assert time.monotonic() < deadline, response.text
        time.sleep(0.02)


def test_health_says_starting_with_the_phase_and_routes_answer_503_until_ready(tiny_qwen3, held_tokenizer):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine
    from asyncllm.server import create_app

    release, _ = held_tokenizer
    started = []
    engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW)
    app = create_app(engine, "tiny", api_key=KEY, start_in_background=True, on_engine_started=started.append)
    with TestClient(app) as http:  # the lifespan returns at once: the engine starts meanwhile
        wait_for_health(lambda: http.get("/health"), 503, HELD_PHASE)
        assert_starting_error(http.post("/v1/completions", json=COMPLETION, headers=AUTH))
        assert_starting_error(http.post("/v1/chat/completions", headers=AUTH,
                                        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}))
        assert_starting_error(http.get("/v1/models", headers=AUTH))
        assert_starting_error(http.post("/tokenize", json={"prompt": "Hi"}, headers=AUTH))
        assert http.post("/v1/completions", json=COMPLETION).status_code == 401  # the key first
        assert http.get("/metrics").status_code == 200
        assert started == []
        release.set()
        assert wait_for_health(lambda: http.get("/health"), 200).json() == {"status": "ready"}
        assert started == [None]
        response = http.post("/v1/completions", json=COMPLETION, headers=AUTH)
        assert response.status_code == 200, response.text
    assert not engine.started or engine.startup_phase is None


def test_a_start_that_fails_in_the_background_is_reported_and_health_says_unavailable(tiny_qwen3,
                                                                                       held_tokenizer):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine, EngineDeadError
    from asyncllm.server import create_app

    release, fail = held_tokenizer
    started = []
    engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW)
    app = create_app(engine, "tiny", start_in_background=True, on_engine_started=started.append)
    with TestClient(app) as http:
        wait_for_health(lambda: http.get("/health"), 503, HELD_PHASE)
        fail.set()
        release.set()
        deadline = time.monotonic() + TIMEOUT
        while not started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        (error,) = started
        assert isinstance(error, EngineDeadError) and "tokenizer refused" in str(error.__cause__)
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
        assert http.post("/v1/completions", json=COMPLETION).json()["error"]["code"] == "engine_unavailable"


def test_a_shutdown_during_the_start_up_waits_for_the_engine_thread(tiny_qwen3, held_tokenizer):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine
    from asyncllm.server import create_app

    release, _ = held_tokenizer
    engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW)
    with TestClient(create_app(engine, "tiny", start_in_background=True)) as http:
        wait_for_health(lambda: http.get("/health"), 503, HELD_PHASE)
        threading.Timer(0.5, release.set).start()  # the start-up goes on while the lifespan shuts down
    assert engine_threads() == [], "the lifespan's shutdown returned with the engine thread still running"


def test_without_background_the_lifespan_waits_for_the_engine_as_before(tiny_qwen3):
    from starlette.testclient import TestClient

    from asyncllm import AsyncLLMEngine
    from asyncllm.server import create_app

    engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW)
    with TestClient(create_app(engine, "tiny")) as http:
        assert engine.startup_phase is None and engine.startup_timings
        response = http.get("/health")
        assert (response.status_code, response.json()) == (200, {"status": "ready"})


# ---- `asyncllm serve` ------------------------------------------------------------------------------------
def held_serve(model: str, tmp_path, *options: str, exit_codes: tuple[int, ...] = (0,)):
    """The held `asyncllm serve` (a live_server yielded at once, before /health answers) and the file
    that lets its start-up go on."""
    gate = str(tmp_path / "go")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), ASYNCLLM_API_KEY=KEY,
               ASYNCLLM_CACHE=str(tmp_path / "cache"))
    server = live_server(model, tmp_path, "--num-kvcache-blocks", "8", "--kvcache-block-size", "16",
                         "--max-model-len", "64", *options, env=env, healthy_within=None, exit_codes=exit_codes,
                         launcher=[sys.executable, "-c", _HELD_SERVE, gate])
    return server, gate


def wait_until_held(base: str, proc: subprocess.Popen) -> None:
    """Until /health says the start-up is held at its tokenizer (the port listens once uvicorn has
    started; from then on /health says "starting")."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            httpx.get(f"{base}/health", timeout=30)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server never answered /health"
            time.sleep(0.1)
    wait_for_health(lambda: httpx.get(f"{base}/health", timeout=30), 503, HELD_PHASE)


def test_serve_answers_while_it_starts_and_logs_its_time_to_ready(tiny_qwen3, tmp_path):
    serving, gate = held_serve(tiny_qwen3, tmp_path)
    with serving as server:
        base, proc = server.base, server.proc
        wait_until_held(base, proc)
        # a request during start-up is answered at once (a hang would run into the client's timeout)
        assert_starting_error(httpx.post(f"{base}/v1/completions", json=COMPLETION, headers=AUTH, timeout=30))
        assert_starting_error(httpx.get(f"{base}/v1/models", headers=AUTH, timeout=30))
        with open(gate, "w") as f:
            f.write("go")
        wait_healthy(base, proc, server.log_path)
        assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ready"}
        response = httpx.post(f"{base}/v1/completions", json=dict(COMPLETION, model=os.path.basename(tiny_qwen3)),
                              headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
    stderr = server.log()
    assert "start-up: waiting for the tokenizer..." in stderr and "start-up: loading weights: " in stderr
    assert "start-up: ready after " in stderr
    ready = [line for line in stderr.splitlines() if "asyncllm serve: ready " in line]
    assert len(ready) == 1 and "after the command started, on http://127.0.0.1:" in ready[0], stderr[-4000:]


def test_serve_stops_with_one_line_and_exit_code_2_when_its_start_up_fails(tiny_qwen3, tmp_path):
    serving, gate = held_serve(tiny_qwen3, tmp_path, exit_codes=(2,))
    with serving as server:
        wait_until_held(server.base, server.proc)
        with open(gate, "w") as f:
            f.write("fail")
        server.proc.wait(timeout=TIMEOUT)
    stderr = server.log()
    assert stderr.strip().splitlines()[-1] == "asyncllm serve: tokenizer refused by the test", stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
