"""Helpers several test files share (fixtures shared by all of them are in conftest.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch


@pytest.fixture(params=["asyncio", "trio"], name="anyio_backend")
def anyio_asyncio_and_trio(request):
    """Import into a test file to run its async tests on both (conftest's anyio_backend: asyncio only)."""
    return request.param


def seed_every_test(seed: int):
    """An autouse fixture seeding torch before each test of the file that assigns it."""
    @pytest.fixture(autouse=True)
    def _seed():
        torch.manual_seed(seed)
    return _seed


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncllm-engine" and t.is_alive()]


def assert_all_blocks_free(engine) -> None:
    """Every KV block of an LLM (or an EngineCore) is back in the free pool, none referenced."""
    bm = getattr(engine, "core", engine).block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)


def serve_command() -> list[str]:
    script = shutil.which("asyncllm", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "asyncllm.cli"]


def wait_healthy(base: str, proc: subprocess.Popen, log_path: str, timeout: float = 180.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the server was not healthy after {timeout} s:\n{open(log_path).read()[-4000:]}")
