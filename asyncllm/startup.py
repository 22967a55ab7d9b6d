"""An engine's start-up as an ordered sequence of named phases, each timed and logged as it runs.

STARTUP_PHASES is the whole sequence, in the order it runs: LLM and AsyncLLMEngine make the config,
EngineCore runs its phases with the ModelRunner's in the middle (a tensor-parallel worker rank runs
the ModelRunner's alone). A phase whose condition does not hold (CUDA graphs and what depends on
them, tensor parallelism, calibration) is skipped and absent from the timings. A new phase gets a
name here, in its place, a line in PHASE_ACTIONS if it can take long, and a
`with timings.phase(NAME):` block where its work is.

Each phase's wall time on the host (device work a phase queued and did not wait for counts to a
later one) is kept (StartupTimings.seconds: LLM.startup_timings, AsyncLLMEngine.startup_timings).
On the "asyncllm" logger, a phase that can take long (PHASE_ACTIONS) says what it does at INFO as it
starts ("start-up: loading weights...") and how long it took as it ends ("start-up: loading
weights: 1.23 s"); the others only end, at DEBUG. Each end's record carries `startup_phase` and
`startup_s`, and the INFO line of finish(), once the engine is ready, `startup_total_s` (the phases'
sum) and the start-up cache's counts: benchmarks/bench_startup.py reads them, also from a server's
process. `current` is the phase under way (or the last one run): a server's /health reports it.
Imports nothing of the package.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger("asyncllm")

CONFIG = "config"  # the options checked and resolved (a hub download, a GGUF conversion)
HEAP_FREEZE = "heap freeze"  # the first engine of a process: gc.freeze of the start-up heap
TOKENIZER = "tokenizer"  # its files checked against the weights; loading started on a thread (joined at the intake)
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
REQUEST_INTAKE = "request intake"  # the tokenizer awaited and checked; EOS ids, the prompt bound, reasoning tags

STARTUP_PHASES = (CONFIG, HEAP_FREEZE, TOKENIZER, TP_WORKERS, BUILD_MODEL, LOAD_WEIGHTS, SAMPLER, MEMORY_PROBE,
                  KV_CACHE, ATTENTION_BACKEND, CUDA_GRAPHS, DECODE_TUNING, SAMPLER_GRAPHS, BLOCK_MANAGER,
                  STEP_BUDGET, STEP_MODEL_CALIBRATION, SCHEDULER, REQUEST_INTAKE)

# the phases that can take seconds, as their INFO lines say what they do; the rest take milliseconds.
# Not the config: what it refuses must be the one line `asyncllm serve` prints, and a download or a
# GGUF conversion in it says so itself (models/hub.py, models/gguf.py).
PHASE_ACTIONS = {
    TP_WORKERS: "starting the tensor-parallel workers",
    BUILD_MODEL: "building the model",
    LOAD_WEIGHTS: "loading weights",
    MEMORY_PROBE: "sizing the KV cache",  # on CUDA a worst-case step (kernels compile on a cold cache), or its
    # figures read from the start-up cache
    KV_CACHE: "allocating the KV cache",
    CUDA_GRAPHS: "capturing CUDA graphs",
    DECODE_TUNING: "tuning the batch-1 decode graph",
    SAMPLER_GRAPHS: "capturing sampler graphs",
    STEP_MODEL_CALIBRATION: "calibrating the step-time model",
    REQUEST_INTAKE: "waiting for the tokenizer",  # loaded on a thread since TOKENIZER; seconds on a cold import
}
SLOWEST_SHOWN = 3  # phases named in the line that says the engine is ready


class StartupTimings:
    """The phases run so far, by name, in the order they ran: their wall time in seconds."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.current: str | None = None  # the phase under way, or the last one begun
        self.total_s: float | None = None  # the phases' sum, once finish() has said the engine is ready

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase name (one of STARTUP_PHASES, after those already run). A phase
        that raises is not recorded."""
        if name not in STARTUP_PHASES:
            raise ValueError(f"start-up phase {name!r} is not in STARTUP_PHASES")
        last = next(reversed(self.seconds), None)
        if last is not None and STARTUP_PHASES.index(last) >= STARTUP_PHASES.index(name):
            raise RuntimeError(f"start-up phase {name!r} runs after {last!r}: STARTUP_PHASES says otherwise")
        action = PHASE_ACTIONS.get(name)
        if action is not None:
            logger.info("start-up: %s...", action)
        self.current = name
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.seconds[name] = seconds
        logger.log(logging.INFO if action is not None else logging.DEBUG, "start-up: %s: %.2f s", action or name,
                   seconds, extra={"startup_phase": name, "startup_s": seconds})

    def finish(self, decisions_read: int = 0, decisions_measured: int = 0) -> None:
        """Say at INFO that the engine is ready: the phases' total, the slowest of them, and what the
        start-up cache held (decisions read from it; measured, and stored in it)."""
        self.total_s = total = sum(self.seconds.values())
        slowest = sorted(self.seconds.items(), key=lambda item: -item[1])[:SLOWEST_SHOWN]
        cache = f"; start-up cache: {decisions_read} decisions read, {decisions_measured} measured" \
            if decisions_read or decisions_measured else ""
        logger.info("start-up: ready after %.2f s (%s)%s", total,
                    ", ".join(f"{name} {seconds:.2f} s" for name, seconds in slowest), cache,
                    extra={"startup_total_s": total, "startup_decisions_read": decisions_read,
                           "startup_decisions_measured": decisions_measured})
