"""A flood of large-grammar requests whose clients leave, against a live `asyncllm serve` (issue 52).

Before: 41 chat requests with distinct large enums, dropped by their clients after 3 s, kept both
cores compiling for 11 minutes, /health took 7 s meanwhile and memory grew by 8 GB for good: every
request compiled on a thread of its own to the end, and the cache kept 512 grammars whatever their
size. Now a compile runs on the engine's compile threads, one at a time; one whose client has left
before it starts never starts; and the cache is bounded by bytes.

The tiny model has the real Qwen3 vocabulary (152k tokens), which is what compiles scale with.
Bounds are generous (a busy 2-core machine): the figures are printed.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import subprocess
import sys
import time

import pytest

from helpers import live_server

httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")
pytestmark = pytest.mark.timeout(600)

NUM_REQUESTS = 40
ENUM_SIZE = 8000  # of 12-letter words: 128,000 bytes of schema, within the limits, about a second's compile
CLIENT_TIMEOUT_S = 3.0  # each client gives up and closes its connection after this
IDLE_WITHIN_S = 30.0  # after the last client left: no compile left and the CPU quiet (issue's target: 10 s)
RSS_GROWTH_LIMIT = 500 << 20
# /health timed from a process of its own (in this one, 40 client threads would delay it): each
# answer's seconds, one a line, until the file argv[3] exists
HEALTH_PROBE = """
import http.client, os, sys, time
while not os.path.exists(sys.argv[3]):
    started = time.monotonic()
    connection = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=60)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    connection.close()
    print(time.monotonic() - started, flush=True)
    time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with live_server(tiny_qwen3, tmp_path_factory.mktemp("flood"), "--num-kvcache-blocks", "64",
                     "--log-level", "warning", healthy_within=300) as served:
        yield served


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compiles_in_flight(base: str) -> float:
    """Grammar compiles queued, running or detached, from /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    names = ("asyncllm_grammar_compiles_queued", "asyncllm_grammar_compiles_running",
             "asyncllm_grammar_compiles_detached")
    found = {sample.name: sample.value for family in prometheus_parser.text_string_to_metric_families(text)
             for sample in family.samples if sample.name in names}
    assert set(found) == set(names), f"/metrics lacks the compile gauges: {sorted(found)}"
    return sum(found.values())


def chat_body(schema: dict) -> dict:
    return {"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 4, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}}


def probe_health(base: str, stop_file: str) -> subprocess.Popen:
    host, port = base.removeprefix("http://").split(":")
    return subprocess.Popen([sys.executable, "-c", HEALTH_PROBE, host, port, stop_file], stdout=subprocess.PIPE,
                            text=True)


def health_seconds(probe: subprocess.Popen, stop_file: str) -> list[float]:
    open(stop_file, "w").close()
    out, _ = probe.communicate(timeout=120)
    assert probe.returncode == 0
    return [float(line) for line in out.split()]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def test_a_flood_of_large_grammars_whose_clients_leave(server, tmp_path):
    base, proc = server.base, server.proc
    url = f"{base}/v1/chat/completions"
    # the first constrained request builds xgrammar's view of the vocabulary: not part of the flood
    warm = httpx.post(url, json=chat_body({"enum": ["yes", "no"]}), timeout=300)
    assert warm.status_code == 200, warm.text
    rng = random.Random(52)
    schemas = [{"enum": sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(12))
                                for _ in range(ENUM_SIZE)})} for _ in range(NUM_REQUESTS)]
    assert all(len(json.dumps(schema)) < 131072 for schema in schemas)
    bodies = [json.dumps(chat_body(schema)).encode() for schema in schemas]
    rss_before = rss_bytes(proc.pid)
    probe = probe_health(base, str(tmp_path / "stop-before"))  # what the machine's own load costs /health
    time.sleep(2)
    health_before = health_seconds(probe, str(tmp_path / "stop-before"))

    def send_and_leave(body: bytes) -> int | None:
        try:
            return client.post(url, content=body, headers={"Content-Type": "application/json"}).status_code
        except httpx.TimeoutException:
            return None  # gave up: httpx closes the connection, the server sees the client leave

    probe = probe_health(base, str(tmp_path / "stop"))
    try:
        with httpx.Client(timeout=CLIENT_TIMEOUT_S, limits=httpx.Limits(max_connections=NUM_REQUESTS)) as client, \
                concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
            statuses = list(pool.map(send_and_leave, bodies))
        left_at = time.monotonic()
        idle_after = None
        cpu_window = []
        while time.monotonic() - left_at < IDLE_WITHIN_S:
            cpu_start = cpu_seconds(proc.pid)
            time.sleep(1.0)
            cpu_window.append(cpu_seconds(proc.pid) - cpu_start)
            if compiles_in_flight(base) == 0 and cpu_window[-1] < 0.3:
                idle_after = time.monotonic() - left_at
                break
        health = health_seconds(probe, str(tmp_path / "stop"))
    finally:
        probe.kill()
    rss_growth = rss_bytes(proc.pid) - rss_before
    print(f"FLOOD {NUM_REQUESTS} requests, statuses {sorted(set(map(str, statuses)))}: idle {idle_after} s after the "
          f"clients left (CPU s per second since: {[round(c, 2) for c in cpu_window]}); /health worst "
          f"{max(health):.3f} s, median {median(health):.3f} s over {len(health)} (before the flood: worst "
          f"{max(health_before):.3f} s, median {median(health_before):.3f} s); RSS {rss_before / 2**20:.0f} MiB "
          f"+ {rss_growth / 2**20:.0f} MiB")
    assert idle_after is not None, f"still busy {IDLE_WITHIN_S} s after the clients left: {cpu_window}"
    assert rss_growth < RSS_GROWTH_LIMIT
    assert max(health) < 3.0  # generous: the issue saw 7 s; well under 0.1 s on an idle machine
    again = httpx.post(url, json=chat_body({"enum": ["red", "green"]}), timeout=300)  # still serving
    assert again.status_code == 200 and json.loads(again.json()["choices"][0]["message"]["content"]) in ("red", "green")
