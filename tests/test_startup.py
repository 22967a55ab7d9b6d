"""Start-up reporting (asyncllm/startup.py): what each phase says at INFO as it starts and ends, the
line that says the engine is ready, the phase an AsyncLLMEngine is in while it starts, and that a CPU
engine leaves no start-up cache behind."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import anyio
import pytest

from asyncllm import startup
from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.models import tokenizer_loader
from asyncllm.errors import EngineDeadError
from asyncllm.llm import LLM

pytestmark = pytest.mark.timeout(300)
TIMEOUT = 120
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_KW = dict(num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=64)


def info_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "asyncllm" and r.levelno == logging.INFO
            and r.getMessage().startswith("start-up: ")]


def test_slow_phases_say_what_they_do_at_info_as_they_start_and_end(caplog):
    caplog.set_level(logging.DEBUG, logger="asyncllm")
    timings = startup.StartupTimings()
    with timings.phase(startup.LOAD_WEIGHTS):
        assert timings.current == startup.LOAD_WEIGHTS
        assert info_lines(caplog) == ["start-up: loading weights..."]  # said before the work, not after
    with timings.phase(startup.SAMPLER):  # milliseconds: its end at debug only
        pass
    with timings.phase(startup.CUDA_GRAPHS):
        pass
    assert timings.current == startup.CUDA_GRAPHS
    lines = info_lines(caplog)
    assert lines[0] == "start-up: loading weights..." and lines[1].startswith("start-up: loading weights: ")
    assert lines[1].endswith(" s") and lines[2:] == ["start-up: capturing CUDA graphs...", lines[3]]
    assert lines[3].startswith("start-up: capturing CUDA graphs: ")
    ends = [(r.startup_phase, r.levelno) for r in caplog.records if hasattr(r, "startup_phase")]
    assert ends == [(startup.LOAD_WEIGHTS, logging.INFO), (startup.SAMPLER, logging.DEBUG),
                    (startup.CUDA_GRAPHS, logging.INFO)]
    assert set(startup.PHASE_ACTIONS) <= set(startup.STARTUP_PHASES)


def test_ready_says_the_total_the_slowest_phases_and_the_start_up_cache(caplog):
    caplog.set_level(logging.INFO, logger="asyncllm")
    timings = startup.StartupTimings()
    for name, seconds in ((startup.CONFIG, 0.5), (startup.TOKENIZER, 2.0), (startup.LOAD_WEIGHTS, 1.0),
                          (startup.SAMPLER, 0.25), (startup.CUDA_GRAPHS, 3.0)):
        timings.seconds[name] = seconds
    timings.finish(decisions_read=12, decisions_measured=1)
    (record,) = [r for r in caplog.records if hasattr(r, "startup_total_s")]
    assert record.getMessage() == ("start-up: ready after 6.75 s (CUDA graphs 3.00 s, tokenizer 2.00 s, "
                                   "load weights 1.00 s); start-up cache: 12 decisions read, 1 measured")
    assert (record.startup_total_s, record.startup_decisions_read, record.startup_decisions_measured) == (6.75, 12, 1)
    assert timings.total_s == 6.75
    caplog.clear()
    timings.finish()  # nothing cached or measured (CPU): not mentioned
    assert [r.getMessage() for r in caplog.records][0].endswith("load weights 1.00 s)")


def test_an_engine_logs_its_start_up_and_says_when_it_is_ready(tiny_qwen3, caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="asyncllm")
    with LLM(tiny_qwen3, **ENGINE_KW) as llm:
        lines = info_lines(caplog)
        assert lines[0] == "start-up: building the model..." and "start-up: loading weights..." in lines
        ready = [line for line in lines if line.startswith("start-up: ready after ")]
        assert len(ready) == 1 and lines[-1] == ready[0]
        assert llm.core.startup.total_s == pytest.approx(sum(llm.startup_timings.values()))
        # on CPU nothing is measured: no start-up cache is opened, and Triton's cache is left alone
        assert llm.core.runner.decisions.path is None
    assert not os.path.exists(tmp_path / "cache")
    assert os.environ.get("TRITON_CACHE_DIR") != str(tmp_path / "cache" / "triton")


@pytest.mark.anyio
async def test_the_phase_under_way_while_an_async_engine_starts(tiny_qwen3, monkeypatch):
    release = threading.Event()
    real = tokenizer_loader.load_tokenizer

    def held_tokenizer(model):  # the tokenizer loads until the test lets it go
        release.wait(TIMEOUT)
        return real(model)
    monkeypatch.setattr(tokenizer_loader, "load_tokenizer", held_tokenizer)
    with anyio.fail_after(TIMEOUT):
        engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW)
        assert engine.startup_phase is None  # not started
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(engine.start)
            while engine.startup_phase is None:
                await anyio.sleep(0.01)
            # the tokenizer loads on its thread beside the model's build and weights: the start-up
            # goes on without it, and waits for it only at the request intake
            while engine.startup_phase != startup.REQUEST_INTAKE:
                await anyio.sleep(0.01)
            await anyio.sleep(0.2)
            assert engine.startup_phase == startup.REQUEST_INTAKE and not release.is_set()
            release.set()
        assert engine.startup_phase is None  # ready
        await engine.shutdown()


@pytest.mark.anyio
async def test_a_failed_start_is_not_a_phase(tiny_qwen3, monkeypatch):
    def no_tokenizer(model):
        raise ValueError("no tokenizer here")
    monkeypatch.setattr(tokenizer_loader, "load_tokenizer", no_tokenizer)
    with anyio.fail_after(TIMEOUT):
        engine = AsyncLLMEngine(tiny_qwen3, **ENGINE_KW)
        with pytest.raises(EngineDeadError):
            await engine.start()
        assert engine.startup_phase is None


# A fresh interpreter (this one has transformers imported already): two tokenizer loads at once, as two
# engines starting together do, or an engine started after a failed start whose tokenizer thread was
# still importing transformers. The second import raised "cannot import name 'AutoTokenizer'".
CONCURRENT_TOKENIZER_LOADS = """
import sys, threading
from asyncllm.models.tokenizer_loader import load_tokenizer
assert "transformers" not in sys.modules
errors = []
def load():
    try:
        load_tokenizer(sys.argv[1])
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=load) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
"""


def test_tokenizers_loading_at_once_in_a_fresh_process_all_load(tiny_qwen3):
    done = subprocess.run([sys.executable, "-c", CONCURRENT_TOKENIZER_LOADS, tiny_qwen3], capture_output=True,
                          text=True, timeout=TIMEOUT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
