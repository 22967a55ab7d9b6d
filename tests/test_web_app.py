"""examples/web_app.py: its HTTP answers, and its page driven in headless Chromium (Debian's
/usr/bin/chromium) through Playwright (those tests skip without Chromium)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import free_port, stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]  # containers often have a tiny /dev/shm

httpx = pytest.importorskip("httpx")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)


@pytest.fixture(scope="module")
def web_app(tiny_qwen3, tmp_path_factory):
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("web_app") / "web_app.log")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "web_app.py"), "--model", tiny_qwen3, "--port", str(port),
           "--ignore-eos", "--num-kvcache-blocks", "64", "--max-model-len", "4096"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"web_app.py exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            return httpx.get(base + "/stats", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 180, "web_app.py to start", 0.25)
        yield base
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or set CHROMIUM=path)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def stats(base: str) -> dict:
    return httpx.get(base + "/stats", timeout=10).json()


def test_stream_into_the_page_and_stop(web_app, browser):
    page = browser.new_page()
    page.goto(web_app + "/")
    assert page.inner_text("#status") == "ready"
    page.fill("#prompt", "Tell me a long story about the sea.")
    page.fill("#max-tokens", "2000")  # the app runs with --ignore-eos: minutes of tokens on CPU
    page.click("#send")

    # the answer grows over several polls: streamed, not delivered at the end
    output = lambda: page.inner_text("#output")  # noqa: E731
    lengths = [len(wait_until(output, 60, "the first text"))]
    while len(lengths) < 4:
        lengths.append(len(wait_until(lambda: len(output()) > lengths[-1] and output(), 30, "more text")))
    assert lengths == sorted(set(lengths))
    assert page.inner_text("#status") == "generating…"
    busy = stats(web_app)
    assert busy["num_running"] == 1 and busy["num_free_blocks"] < busy["num_total_blocks"]

    page.click("#stop")
    page.wait_for_function("document.getElementById('status').dataset.state === 'stopped'", timeout=10_000)
    assert page.inner_text("#status") == "stopped"
    assert page.is_enabled("#send") and not page.is_enabled("#stop")

    # the server aborted the request: nothing running, every block back, long before 2000 tokens
    idle = wait_until(lambda: (s := stats(web_app))["num_running"] == 0 and s["num_waiting"] == 0
                      and s["num_free_blocks"] == s["num_total_blocks"] and s, 15, "the request to be aborted")
    assert idle["num_inbox"] == 0
    stopped_text = output()
    time.sleep(1.0)
    assert output() == stopped_text  # nothing more arrives
    assert stats(web_app)["num_steps"] == idle["num_steps"]  # and the engine is not generating for nobody

    # the page works again after a stop, to the end of a short answer
    page.fill("#max-tokens", "5")
    page.click("#send")
    page.wait_for_function("document.getElementById('status').dataset.state === 'done'", timeout=60_000)
    assert page.inner_text("#status") == "done (length, 5 tokens)"
    assert output() and output() != stopped_text
    page.close()


@pytest.fixture
def web_app_in_process(tiny_qwen3):
    """examples/web_app.py's app under uvicorn in a thread of this process, so a test can reach its engine."""
    uvicorn = pytest.importorskip("uvicorn")
    spec = importlib.util.spec_from_file_location("web_app_example", os.path.join(ROOT, "examples", "web_app.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    app = module.create_app(tiny_qwen3, ignore_eos=True, num_kvcache_blocks=64, max_model_len=4096)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="web-app-uvicorn", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 180, "web_app to start", 0.25)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}", app.state.engine
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.mark.parametrize("max_tokens", ["1e400", "2.9", "0", "true", '"5"', "{}"])
def test_a_bad_max_tokens_is_a_400_naming_it(web_app, max_tokens):
    # 1e400 (infinity) was a 500 (int() of it); 0 and {} became the default, 2.9 became 2, "5" became 5
    r = httpx.post(web_app + "/generate", content=f'{{"prompt": "hi", "max_tokens": {max_tokens}}}', timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"], r.text


def test_a_body_over_the_limit_is_a_413(web_app):
    # a 200 MB body was read whole, and accepted (issue 52, item 15)
    r = httpx.post(web_app + "/generate", json={"prompt": "hi " * (1 << 19), "max_tokens": 1}, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["error"], r.text
    with socket.create_connection(("127.0.0.1", int(web_app.rsplit(":", 1)[1])), timeout=60) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200000000\r\n\r\n{")  # refused by its length, before any more is sent
        assert sock.recv(65536).startswith(b"HTTP/1.1 413"), "no 413 before the body"
    r = httpx.post(web_app + "/generate", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def test_engine_death_mid_stream_shows_an_error(web_app_in_process, browser):
    from prometheus_client.parser import text_string_to_metric_families
    base, engine = web_app_in_process
    page = browser.new_page()
    page.goto(base + "/")
    page.fill("#prompt", "Tell me a long story about the sea.")
    page.fill("#max-tokens", "2000")
    page.click("#send")
    wait_until(lambda: page.inner_text("#output"), 60, "the first text")

    def failing_step():
        raise RuntimeError("injected step failure")

    engine._core.launch_step = failing_step  # the engine thread's next step fails: the engine dies mid-answer
    page.wait_for_function("document.getElementById('status').dataset.state === 'error'", timeout=30_000)
    assert "the engine failed" in page.inner_text("#status"), page.inner_text("#status")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")

    # the app's /metrics: the engine's collectors beside the app's own counter, parsed by prometheus_client
    samples = {(s.name, s.labels.get("finish_reason")): s.value
               for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text)
               for s in family.samples}
    assert samples[("asyncllm_requests_total", "error")] == 1
    assert samples[("asyncllm_requests_total", "stop")] == 0
    assert samples[("web_app_page_views_total", None)] == 1
    assert ("process_cpu_seconds_total", None) not in samples  # the app's registry: only what it registered
    page.close()
