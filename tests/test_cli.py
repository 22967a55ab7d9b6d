"""The `asyncllm` command answers at once: --help and flag errors without importing torch, a busy
port refused before the model loads, a hub id it cannot get refused in one line (and one in the
hub's cache served offline). Each runs the command in a fresh interpreter (a wrapper that runs cli.main and then reports whether torch was
imported); nothing here asserts a time."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import httpx
import pytest

from helpers import lay_out_in_hub_cache, live_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# runs `asyncllm ARGS...`, then prints its exit code and whether torch was imported, as JSON, last
_WRAPPER = """
import json, sys
from asyncllm import cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> tuple[dict, str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    run = subprocess.run([sys.executable, "-c", _WRAPPER, *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stdout, run.stderr


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"], ["tp-worker", "--help"], ["--version"]])
def test_help_imports_no_torch(args):
    result, out, _ = run_cli(*args)
    assert result == {"code": 0, "torch": False}
    assert "usage: asyncllm" in out or out.startswith("asyncllm ")


@pytest.mark.parametrize("args, says", [
    (["serve", "--max-num-seqs", "x"], "argument --max-num-seqs: invalid int value: 'x'"),
    (["serve", "--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    (["serve", "--port", "70000"], "must be a port number"),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["nonsense"], "invalid choice: 'nonsense'")])
def test_flag_errors_import_no_torch(args, says):
    result, _, err = run_cli(*args)
    assert result == {"code": 2, "torch": False}
    assert says in err


def test_an_empty_api_key_is_refused_without_torch(tiny_qwen3):
    result, _, err = run_cli("serve", tiny_qwen3, "--api-key", " ")
    assert result == {"code": 2, "torch": False}
    assert "--api-key is empty" in err


def test_a_busy_port_fails_before_the_model_loads(tiny_qwen3):
    with socket.socket() as other_server:
        other_server.bind(("127.0.0.1", 0))
        other_server.listen()
        port = other_server.getsockname()[1]
        result, _, err = run_cli("serve", tiny_qwen3, "--port", str(port))
    # torch never imported: the model was not loaded (before the check, it loaded and uvicorn then failed)
    assert result == {"code": 2, "torch": False}
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"asyncllm serve: cannot listen on 127.0.0.1:{port}: Address already in use")


def test_a_hub_id_offline_and_not_cached_is_one_line(tmp_path):
    result, _, err = run_cli("serve", "org/not-cached", "--port", "0",
                             env={"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"})
    assert result["code"] == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("asyncllm serve: no network (HF_HUB_OFFLINE is set) and 'org/not-cached' is not in "
                               f"the Hugging Face cache {tmp_path / 'hf-home' / 'hub'}")
    assert "`hf download org/not-cached`" in lines[0]


def test_serve_a_cached_hub_id_offline(tiny_qwen3, tmp_path):
    home = tmp_path / "hf-home"
    lay_out_in_hub_cache(tiny_qwen3, str(home / "hub"), "org/tiny")
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with live_server("org/tiny", tmp_path, "--num-kvcache-blocks", "16", env=env) as server:
        models = httpx.get(f"{server.base}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["org/tiny"]
        r = httpx.post(f"{server.base}/v1/completions", json={"model": "org/tiny", "prompt": "Hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text


def test_serve_runs_its_event_loop_under_the_serving_gc_thresholds(tiny_qwen3, monkeypatch):
    """`asyncllm serve` owns its process: uvicorn runs with cli.SERVE_GC_THRESHOLDS (rarer young
    collections than the interpreter's 700 allocations; docs/BENCHMARKS_ARCHIVE.md, Run Z-CPU)."""
    import gc

    from asyncllm import cli
    from asyncllm.server.connections import DrainingServer

    seen = []
    monkeypatch.setattr(DrainingServer, "run", lambda self: seen.append(gc.get_threshold()))
    before = gc.get_threshold()
    try:
        assert cli.main(["serve", tiny_qwen3, "--num-kvcache-blocks", "16"]) == 0
    finally:
        gc.set_threshold(*before)
    assert seen == [cli.SERVE_GC_THRESHOLDS] and cli.SERVE_GC_THRESHOLDS[0] > before[0], (seen, before)
