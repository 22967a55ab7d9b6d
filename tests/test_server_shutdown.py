"""`asyncllm serve` shutting down (SIGTERM) with requests in flight (issue 52, item 6): they may finish
within --graceful-shutdown-timeout; then streams end with an OpenAI error event and [DONE], whole
answers get an OpenAI 503, and the server exits; it exits as soon as nothing runs."""
from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import pytest

from helpers import environment_without_api_key, live_server, read_until_closed

httpx = pytest.importorskip("httpx", reason="the server tests need the test extras (httpx)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
NUM_STREAMS = 16
LIMIT_S = 120  # every wait's bound: generous for a busy 2-core machine


def serve(model: str, tmp_path, *options: str):
    """The server these tests send SIGTERM to: it may exit by the signal's default action too."""
    return live_server(model, tmp_path, "--num-kvcache-blocks", "256", "--max-num-seqs", "32", *options,
                       "--log-level", "info", env=environment_without_api_key(), exit_codes=(0, -signal.SIGTERM))


class StreamReader(threading.Thread):
    """Reads a streamed chat answer; events: its data payloads (JSON, or the string "[DONE]")."""

    def __init__(self, base: str, body: dict):
        super().__init__(daemon=True)
        self.base, self.body = base, body
        self.events: list = []
        self.status = None
        self.generating = threading.Event()  # set at the first chunk after the role's

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base + CHAT, json={**self.body, "stream": True}, timeout=LIMIT_S) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        if len(self.events) >= 2:
                            self.generating.set()
        except httpx.HTTPError as e:  # the connection cut: events end without [DONE]
            self.events.append(e)
        finally:
            self.generating.set()


def running_requests(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    return float(re.search(r"^asyncllm_num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


def assert_shutting_down_error(error: dict) -> None:
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error", error


def test_sigterm_ends_requests_in_flight_in_openai_shape_after_the_drain(tiny_qwen3, tmp_path):
    long = {"messages": MESSAGES, "max_tokens": 3500, "ignore_eos": True}  # minutes on a CPU
    with serve(tiny_qwen3, tmp_path, "--graceful-shutdown-timeout", "2", "--body-timeout", "600") as server:
        proc, base, port = server.proc, server.base, server.port
        streams = [StreamReader(base, long) for _ in range(NUM_STREAMS)]
        for stream in streams:
            stream.start()
        whole = {}
        whole_thread = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
            base + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 3500, "ignore_eos": True}, timeout=LIMIT_S)))
        whole_thread.start()
        for stream in streams:
            assert stream.generating.wait(LIMIT_S) and stream.status == 200, stream.events[-1:]
        deadline = time.monotonic() + LIMIT_S
        while running_requests(base) < NUM_STREAMS + 1:  # the whole answer too
            assert time.monotonic() < deadline and whole_thread.is_alive(), whole
            time.sleep(0.1)
        # a body still arriving: not submitted when the drain ends
        slow_body = socket.create_connection(("127.0.0.1", port))
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        assert httpx.get(base + "/health", timeout=LIMIT_S).status_code == 200  # the server has read that head

        proc.send_signal(signal.SIGTERM)
        for stream in streams:
            stream.join(LIMIT_S)
        whole_thread.join(LIMIT_S)
        reply = read_until_closed(slow_body, LIMIT_S)
        slow_body.close()
        proc.wait(LIMIT_S)

    for stream in streams:
        assert not stream.is_alive()
        *chunks, error, done = stream.events
        assert done == "[DONE]" and isinstance(error, dict), stream.events[-3:]
        assert_shutting_down_error(error["error"])
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks), "it finished before the drain's end"
    assert_shutting_down_error(whole["r"].json()["error"])
    assert whole["r"].status_code == 503
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), reply[:300]
    assert_shutting_down_error(json.loads(body)["error"])
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-4000:]


def test_sigterm_lets_requests_finish_refuses_new_ones_and_exits_once_nothing_runs(tiny_qwen3, tmp_path):
    # a drain of 600 s: the server must exit when the stream has finished, not when the drain ends
    with serve(tiny_qwen3, tmp_path, "--graceful-shutdown-timeout", "600", "--body-timeout", "600") as server:
        proc, base, port = server.proc, server.base, server.port
        stream = StreamReader(base, {"messages": MESSAGES, "max_tokens": 40, "ignore_eos": True})
        stream.start()
        assert stream.generating.wait(LIMIT_S) and stream.status == 200, stream.events[-1:]
        # a request whose body ends after the shutdown has begun: refused, not run
        body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
        late = socket.create_connection(("127.0.0.1", port))
        late.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        assert httpx.get(base + "/health", timeout=LIMIT_S).status_code == 200  # the server has read that head
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + LIMIT_S
        while "Shutting down" not in server.log():  # uvicorn's line as its shutdown begins
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.1)
        late.sendall(body[5:])
        reply = read_until_closed(late, LIMIT_S)
        late.close()
        stream.join(LIMIT_S)
        proc.wait(LIMIT_S)  # raises TimeoutExpired if the server waited out the drain
    head, _, answer = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), reply[:300]
    assert_shutting_down_error(json.loads(answer)["error"])
    *_, last, done = stream.events
    assert done == "[DONE]" and last["choices"][0]["finish_reason"] == "length", stream.events[-3:]
    assert "Traceback" not in server.log()
