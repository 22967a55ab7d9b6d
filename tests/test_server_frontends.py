"""`asyncllm serve --api-server-count 2`: the engine in the main process, two front-end processes on the
port. Every answer is compared with the single-process server's on the same tiny model (greedy)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import live_server

httpx = pytest.importorskip("httpx", reason="the server tests need the server/test extras (httpx)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")

OPTIONS = ("--num-kvcache-blocks", "256", "--kvcache-block-size", "16", "--max-model-len", "4096",
           "--max-tokens-limit", "2048", "--log-level", "info")
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def single(tiny_qwen3, tmp_path_factory):
    with live_server(tiny_qwen3, tmp_path_factory.mktemp("single"), *OPTIONS) as served:
        yield served


@pytest.fixture(scope="module")
def frontends(tiny_qwen3, tmp_path_factory):
    with live_server(tiny_qwen3, tmp_path_factory.mktemp("frontends"), *OPTIONS, "--api-server-count", "2") as served:
        wait_for(lambda: len(frontend_pids(served)) == 2, "both front-ends started")
        yield served


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def frontend_pids(server) -> set[int]:
    return {int(pid) for pid in re.findall(r"Started server process \[(\d+)\]", server.log())}


def ready_frontend_pids(server) -> set[int]:
    """The front-ends that have the engine's readiness (each logs it; /health 200 says so of one)."""
    return {int(pid) for pid in re.findall(r"\[front-end (\d+)\] asyncllm: serving", server.log())}


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def streamed_text(base: str, path: str, body: dict, chat: bool) -> tuple[str, str]:
    """(the streamed text, the finish reason) of a streamed request."""
    text, finish = [], None
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append((choice["delta"].get("content") or "") if chat else choice["text"])
            finish = choice["finish_reason"] or finish
    return "".join(text), finish


def engine_metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("prompt", ["Hello there", [11, 22, 33, 44]])
def test_completions_match_the_single_process_server(single, frontends, prompt):
    body = {"prompt": prompt, **GREEDY, "logprobs": 2}
    want, got = post(single.base, "/v1/completions", body).json(), post(frontends.base, "/v1/completions", body).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "length"
    assert got["usage"] == want["usage"]
    assert streamed_text(frontends.base, "/v1/completions", body, chat=False) == (want["choices"][0]["text"], "length")


def test_chat_matches_the_single_process_server(single, frontends):
    body = {"messages": MESSAGES, **GREEDY}
    want = post(single.base, "/v1/chat/completions", body).json()["choices"][0]
    got = post(frontends.base, "/v1/chat/completions", body).json()["choices"][0]
    assert got["message"]["content"] == want["message"]["content"] and want["message"]["content"]
    assert streamed_text(frontends.base, "/v1/chat/completions", body, chat=True) == \
        (want["message"]["content"], "length")


def test_stop_strings_and_n_run_in_the_engine_process_as_before(single, frontends):
    first = post(single.base, "/v1/completions", {"prompt": "Hello there", **GREEDY}).json()["choices"][0]["text"]
    stop = first[3:6]
    body = {"prompt": "Hello there", **GREEDY, "stop": [stop], "n": 2}
    want, got = post(single.base, "/v1/completions", body).json(), post(frontends.base, "/v1/completions", body).json()
    assert [(c["text"], c["finish_reason"], c["stop_reason"]) for c in got["choices"]] == \
        [(c["text"], c["finish_reason"], c["stop_reason"]) for c in want["choices"]]
    assert got["choices"][0]["finish_reason"] == "stop" and stop not in got["choices"][0]["text"]


def test_concurrent_streams_across_the_front_ends(single, frontends):
    prompts = [f"Story number {i}:" for i in range(12)]
    want = [post(single.base, "/v1/completions", {"prompt": p, **GREEDY}).json()["choices"][0]["text"] for p in prompts]
    with ThreadPoolExecutor(12) as pool:  # a connection each: the kernel spreads them over both front-ends
        got = list(pool.map(lambda p: streamed_text(frontends.base, "/v1/completions", {"prompt": p, **GREEDY},
                                                    chat=False)[0], prompts))
    assert got == want
    assert len(frontend_pids(frontends)) == 2


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"input": ["Hello there", [5, 6, 7]]}),
    ("/tokenize", {"prompt": "Hello there"}),
    ("/v1/chat/completions", {"messages": MESSAGES, **GREEDY, "max_tokens": 24,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                                  "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}),
])
def test_the_other_routes_match_the_single_process_server(single, frontends, path, body):
    want, got = post(single.base, path, body), post(frontends.base, path, body)
    assert got.status_code == want.status_code == 200, got.text
    strip = lambda d: {k: v for k, v in d.items() if k not in ("id", "created")}  # noqa: E731
    assert strip(got.json()) == strip(want.json())


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": [10, 10 ** 9]}, "prompt"),
    ({"prompt": "Hi", "logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"prompt": "Hi", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": ""}, "prompt"),
])
def test_bad_input_is_the_same_400(single, frontends, body, param):
    want, got = post(single.base, "/v1/completions", body), post(frontends.base, "/v1/completions", body)
    assert got.status_code == want.status_code == 400
    assert got.json() == want.json()
    assert got.json()["error"]["param"] == param


def test_a_client_that_disconnects_frees_its_blocks(frontends):
    total = engine_metric(frontends.base, "asyncllm_kv_blocks_total")
    with socket.create_connection(("127.0.0.1", frontends.port)) as sock:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True})
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        received = b""
        while received.count(b"data: ") < 3:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        wait_for(lambda: engine_metric(frontends.base, "asyncllm_kv_blocks_in_use") > 0, "blocks held while it streams")
    # the front-end sees the disconnect, the engine process aborts the request; the stats come every 0.25 s
    wait_for(lambda: engine_metric(frontends.base, "asyncllm_kv_blocks_in_use") == 0
             and engine_metric(frontends.base, "asyncllm_num_requests_running") == 0, "the blocks freed")
    assert engine_metric(frontends.base, "asyncllm_kv_blocks_total") == total


def test_sigterm_drains_and_exits_0(tiny_qwen3, tmp_path):
    # the drain's limit past what the request takes on a busy machine: it ends when the request does
    with live_server(tiny_qwen3, tmp_path, *OPTIONS, "--api-server-count", "2", "--graceful-shutdown-timeout", "60") \
            as served:
        wait_for(lambda: len(ready_frontend_pids(served)) == 2, "both front-ends ready")
        pids = frontend_pids(served)
        with ThreadPoolExecutor(1) as pool:  # a request in flight when the signal comes finishes
            running = pool.submit(post, served.base, "/v1/completions", {"prompt": "Hi", **GREEDY, "max_tokens": 40})
            # submitted to the engine (one not yet submitted gets the drain's 503)
            wait_for(lambda: running.done() or engine_metric(served.base, "asyncllm_num_requests_running") == 1,
                     "the request running")
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(60) == 0, served.log()[-3000:]
            assert running.result().status_code == 200, running.result().text
    for pid in pids:  # the front-ends are gone too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_front_end_that_dies_stops_the_server_with_an_error(tiny_qwen3, tmp_path):
    with live_server(tiny_qwen3, tmp_path, *OPTIONS, "--api-server-count", "2", exit_codes=(1,)) as served:
        wait_for(lambda: len(frontend_pids(served)) == 2, "both front-ends started")
        victim, survivor = sorted(frontend_pids(served))
        os.kill(victim, signal.SIGKILL)
        served.proc.wait(60)
        assert re.search(r"front-end .* exited with -9; stopping the server", served.log())
    with pytest.raises(ProcessLookupError):
        os.kill(survivor, 0)


def test_a_full_queue_is_a_429_and_an_engine_that_dies_stops_the_front_ends(tiny_qwen3, tmp_path):
    # the engine admits a request after the front-end has its stream: the 429 comes from the first read
    with live_server(tiny_qwen3, tmp_path, *OPTIONS, "--api-server-count", "2", "--max-num-seqs", "1",
                     "--max-queued-requests", "1", exit_codes=(-signal.SIGKILL,)) as served:
        wait_for(lambda: len(frontend_pids(served)) == 2, "both front-ends started")
        long = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, served.base, "/v1/completions", long)
            wait_for(lambda: engine_metric(served.base, "asyncllm_num_requests_running") == 1, "the first running")
            queued = pool.submit(post, served.base, "/v1/completions", long)
            wait_for(lambda: engine_metric(served.base, "asyncllm_num_requests_waiting") == 1, "the second queued")
            refused = post(served.base, "/v1/completions", {"prompt": "Hi", **GREEDY})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full", refused.text
            assert refused.headers["retry-after"] == "1"
            with httpx.stream("POST", served.base + "/v1/completions", json={"prompt": "Hi", **GREEDY, "stream": True},
                              timeout=60) as response:
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert json.loads(events[0][6:])["error"]["code"] == "queue_full" and events[-1] == "data: [DONE]"
            pids = frontend_pids(served)
            served.proc.kill()  # the engine process dies: the front-ends' streams end, and they exit
            assert running.result().status_code in (200, 503) and queued.result().status_code in (200, 503)

            def gone(pid: int) -> bool:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return True
                return False
            wait_for(lambda: all(gone(pid) for pid in pids), "the front-ends exited")


def test_the_link_carries_plain_data_and_raises_errors_as_their_own_class():
    import asyncio
    import pickle

    import numpy as np

    from asyncllm.errors import (ArgumentError, EngineAsleepError, PromptTooLongError, QueueFullError,
                                 UnsatisfiableConstraintsError)
    from asyncllm.outputs import TokenLogprob
    from asyncllm.sampling_params import SamplingParams
    from asyncllm.server.engine_link import (error_in, error_out, frame, logprobs_in, logprobs_out, params_in,
                                             params_out, read_message)
    from asyncllm.structured import StructuredOutput

    async def roundtrip(message):
        reader = asyncio.StreamReader()
        reader.feed_data(frame(message) if isinstance(message, tuple) else message)
        reader.feed_eof()
        return await read_message(reader)

    def carried(message):
        return asyncio.run(roundtrip(message))

    for spec in (StructuredOutput(regex="a+"), StructuredOutput(json={"type": "object", "__reduce__": [1]}),
                 StructuredOutput(json='{"type": "string"}'), StructuredOutput(choice=["x", "y"]),
                 StructuredOutput(json_object=True), None):
        params = SamplingParams(temperature=0.5, stop=["x", "\ud800"], logit_bias={7: -100, 12: 2.5}, seed=2**64 - 1,
                                allowed_token_ids=[3, 7, 12], structured_output=spec, timeout=1.5, max_tokens=None)
        kind, request_id, ids, fields = carried(("submit", "r1", [1, 2], params_out(params)))
        got = params_in(fields)
        assert (kind, request_id, ids) == ("submit", "r1", [1, 2])
        assert got == params and got.logit_bias == {7: -100.0, 12: 2.5} and list(got.logit_bias) == [7, 12]

    errors = [PromptTooLongError("prompts[0]", "too long", "SamplingParams"), UnsatisfiableConstraintsError("no token"),
              QueueFullError("8 requests are already queued"), EngineAsleepError("asleep"), KeyError("k"),
              ValueError("bad", 3), TypeError(object())]
    for error in errors:
        _, got = carried(("reply", error_out(error)))
        got = error_in(got)
        assert type(got) is type(error) and str(got) == str(error), (error, got)
        if isinstance(error, ArgumentError):
            assert (got.argument, got.field, got.reason, got.owner) == \
                (error.argument, error.field, error.reason, error.owner)

    class DeviceError(RuntimeError):  # a class the link does not know goes as its nearest known base
        pass
    got = error_in(carried(("reply", error_out(DeviceError("CUDA out of memory"))))[1])
    assert type(got) is RuntimeError and str(got) == "CUDA out of memory"

    entries = [None, TokenLogprob(np.int64(5), float("-inf"), 1, np.array([5, 9]), np.array([-0.25, -1.5],
                                                                                             dtype=np.float32))]
    _, got = carried(("out", logprobs_out(entries)))
    got = logprobs_in(got)
    assert got[0] is None and (got[1].token_id, got[1].logprob, got[1].rank) == (5, float("-inf"), 1)
    assert (got[1].top_ids, got[1].top_logprobs) == ([5, 9], [-0.25, -1.5])

    # nothing is unpickled: a pickle's bytes are not a message (the link fails; no code runs)
    class Payload:
        def __reduce__(self):
            return os.system, ("echo pwned",)
    data = pickle.dumps(("submit", Payload()))
    with pytest.raises(ValueError):
        carried(len(data).to_bytes(4, "big") + data)
    with pytest.raises(TypeError, match="does not carry Payload"):
        frame(("submit", Payload()))


def test_health_says_starting_with_the_phase_while_the_engine_starts(tiny_qwen3, tmp_path):
    # the engine process's start-up held at its tokenizer (the front-ends load theirs unheld)
    from test_server_startup import AUTH, COMPLETION, HELD_PHASE, assert_starting_error, held_serve, wait_until_held
    serving, gate = held_serve(tiny_qwen3, tmp_path, "--api-server-count", "2")
    with serving as server:
        wait_until_held(server.base, server.proc)
        wait_for(lambda: len(frontend_pids(server)) == 2, "both front-ends answering while the engine starts")
        for _ in range(4):  # a connection each: both front-ends say so
            assert_starting_error(httpx.post(f"{server.base}/v1/completions", json=COMPLETION, headers=AUTH, timeout=30))
            response = httpx.get(f"{server.base}/health", timeout=30)
            assert (response.status_code, response.json()) == (503, {"status": "starting", "phase": HELD_PHASE})
        assert httpx.get(f"{server.base}/metrics", timeout=30).status_code == 200
        with open(gate, "w") as f:
            f.write("go")
        wait_for(lambda: httpx.get(f"{server.base}/health", timeout=30).status_code == 200, "ready")
        assert httpx.get(f"{server.base}/health", timeout=30).json() == {"status": "ready"}
        response = httpx.post(f"{server.base}/v1/completions", json=COMPLETION, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
    assert len([line for line in server.log().splitlines() if "asyncllm serve: ready " in line]) == 1


def test_a_front_end_that_stops_reading_is_dropped_and_the_server_exits_1(tiny_qwen3, tmp_path):
    env = dict(os.environ, ASYNCLLM_FRONTEND_MAX_PENDING_BYTES="65536")
    # a long drain limit: the dropped front-end is killed at once, not past it (the server ends promptly)
    with live_server(tiny_qwen3, tmp_path, *OPTIONS, "--api-server-count", "2", "--graceful-shutdown-timeout", "60",
                     env=env, exit_codes=(1,)) as served:
        wait_for(lambda: len(ready_frontend_pids(served)) == 2, "both front-ends ready")
        idle, reading = sorted(frontend_pids(served))
        os.kill(idle, signal.SIGSTOP)  # the stream's connection goes to the other one
        try:
            with socket.create_connection(("127.0.0.1", served.port)) as sock:
                body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "n": 4,
                                   "logprobs": 5, "stream": True})
                sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
                received = b""
                while b"data: " not in received:
                    chunk = sock.recv(65536)
                    assert chunk, received
                    received += chunk
                os.kill(reading, signal.SIGSTOP)  # stops reading its link: the engine's outputs pile up
                os.kill(idle, signal.SIGCONT)
                # (the kernel's socket buffer fills first, then 64 KiB in the link's transport)
                wait_for(lambda: "stopped reading its link" in served.log(), "the link dropped", timeout=120)
                assert served.proc.wait(30) == 1, served.log()[-3000:]  # not the drain's 60 s + 10 s
        finally:
            for pid in (idle, reading):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        log = served.log()
        assert re.search(r"a front-end stopped reading its link \(\d+ bytes pending, past 65536: "
                         r"\$ASYNCLLM_FRONTEND_MAX_PENDING_BYTES\); aborting its 1 request\(s\)", log), log[-3000:]


def test_sigterm_with_a_stopped_front_end_drains_and_exits_0_promptly(tiny_qwen3, tmp_path):
    # SIGCONT follows the SIGTERM: the stopped front-end drains as the others do, instead of being
    # killed past the drain's limit (60 s here) and the server exiting 1
    with live_server(tiny_qwen3, tmp_path, *OPTIONS, "--api-server-count", "2", "--graceful-shutdown-timeout", "60") as served:
        wait_for(lambda: len(ready_frontend_pids(served)) == 2, "both front-ends ready")
        stopped, running = sorted(frontend_pids(served))
        os.kill(stopped, signal.SIGSTOP)
        try:
            assert post(served.base, "/v1/completions", {"prompt": "Hi", **GREEDY}).status_code == 200
            served.proc.send_signal(signal.SIGTERM)
            assert served.proc.wait(40) == 0, served.log()[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
    for pid in (stopped, running):  # both drained and exited (the server waited for them)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_start_up_that_fails_stops_the_front_ends_and_exits_2(tiny_qwen3, tmp_path):
    from test_server_startup import held_serve, wait_until_held
    serving, gate = held_serve(tiny_qwen3, tmp_path, "--api-server-count", "2", exit_codes=(2,))
    with serving as server:
        wait_until_held(server.base, server.proc)
        wait_for(lambda: len(frontend_pids(server)) == 2, "both front-ends answering while the engine starts")
        pids = frontend_pids(server)
        with open(gate, "w") as f:
            f.write("fail")
        server.proc.wait(60)
    assert "asyncllm serve: tokenizer refused by the test" in server.log(), server.log()[-3000:]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
