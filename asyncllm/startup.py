"""An engine's start-up as an ordered sequence of named phases, each timed and logged at debug level.

STARTUP_PHASES is the whole sequence, in the order it runs: LLM and AsyncLLMEngine make the config,
EngineCore runs its phases with the ModelRunner's in the middle (a tensor-parallel worker rank runs
the ModelRunner's alone). A phase whose condition does not hold (CUDA graphs and what depends on
them, tensor parallelism, calibration) is skipped and absent from the timings. A new phase gets a
name here, in its place, and a `with timings.phase(NAME):` block where its work is.

Each phase's wall time on the host (device work a phase queued and did not wait for counts to a
later one) is kept (StartupTimings.seconds: LLM.startup_timings, AsyncLLMEngine.startup_timings)
and logged as "start-up: <phase> <seconds> s" on the "asyncllm" logger at debug level, the record
carrying `startup_phase` and `startup_s` (benchmarks/bench_startup.py reads them, also from a
server's process). Imports nothing of the package.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger("asyncllm")

CONFIG = "config"  # the options checked and resolved (a hub download, a GGUF conversion)
HEAP_FREEZE = "heap freeze"  # the first engine of a process: gc.freeze of the start-up heap
TOKENIZER = "tokenizer"  # loaded and checked against the model's config
TP_WORKERS = "TP workers"  # tensor parallelism: the other ranks started and joined
BUILD_MODEL = "build model"  # the model's modules on the device
LOAD_WEIGHTS = "load weights"
SAMPLER = "sampler"  # the sampler, its per-sequence inputs and the constrained steps' bitmasks
MEMORY_PROBE = "memory probe"  # KV blocks: on CUDA what a worst-case step leaves of the memory
KV_CACHE = "KV cache"  # allocated
ATTENTION_BACKEND = "attention backend"
CUDA_GRAPHS = "CUDA graphs"  # captured after the memory probe and the KV cache (CUDA, not eager)
DECODE_TUNING = "decode tuning"  # the batch-1 decode graph's tilings (after the graphs; one rank)
SAMPLER_GRAPHS = "sampler graphs"  # over the graphs' logits (after them; rank 0)
BLOCK_MANAGER = "block manager"
STEP_BUDGET = "step budget"  # the step-time model, timer and (with target_step_ms) prefill budget
STEP_MODEL_CALIBRATION = "step-model calibration"  # synthetic steps timed (one CUDA device, a target)
SCHEDULER = "scheduler"
REQUEST_INTAKE = "request intake"  # EOS ids, the prompt length bound, reasoning tags

STARTUP_PHASES = (CONFIG, HEAP_FREEZE, TOKENIZER, TP_WORKERS, BUILD_MODEL, LOAD_WEIGHTS, SAMPLER, MEMORY_PROBE,
                  KV_CACHE, ATTENTION_BACKEND, CUDA_GRAPHS, DECODE_TUNING, SAMPLER_GRAPHS, BLOCK_MANAGER,
                  STEP_BUDGET, STEP_MODEL_CALIBRATION, SCHEDULER, REQUEST_INTAKE)


class StartupTimings:
    """The phases run so far, by name, in the order they ran: their wall time in seconds."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase name (one of STARTUP_PHASES, after those already run). A phase
        that raises is not recorded."""
        if name not in STARTUP_PHASES:
            raise ValueError(f"start-up phase {name!r} is not in STARTUP_PHASES")
        last = next(reversed(self.seconds), None)
        if last is not None and STARTUP_PHASES.index(last) >= STARTUP_PHASES.index(name):
            raise RuntimeError(f"start-up phase {name!r} runs after {last!r}: STARTUP_PHASES says otherwise")
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.seconds[name] = seconds
        logger.debug("start-up: %s %.3f s", name, seconds, extra={"startup_phase": name, "startup_s": seconds})
