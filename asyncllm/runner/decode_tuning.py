"""The batch-1 decode graph's projection tilings, chosen by the step's own time.

layers/skinny_linear picks each projection's tiling by timing the candidates one call at a time,
between two small kernels. Inside the decode step the order can come out otherwise: with PDL a
projection's time in the step depends on what it overlaps of its neighbours and on the cache and
memory traffic they leave, which stand-in neighbours reproduce only in part, so a tiling (the
grouped FMA form, or ours against cuBLAS) that times faster alone can run the step slower, and one
that times slower alone can run it faster. A chat's time per token is the batch-1 decode graph's,
so that graph is where its tilings are settled: one projection at a time, largest first, each
alternative is captured into the graph and the step timed, and a tiling replaces the decision only
where the step ran MIN_GAIN faster. Then every batch-1 decode graph is captured again. Once per
process: a later engine keeps the decisions, as it keeps every skinny-GEMM decision. It costs
seconds at start-up (per alternative a graph capture and five timings of 20 replays, plus a compile
per new tiling, which Triton caches); docs/DECISIONS.md lists what it measured against what it
saves. The tilings kept are stored in the start-up cache (startup_cache.py) under the question
asked (the graph's context bound and each alternative's tilings), and a later start-up that asks
the same takes them from there and only captures the batch-1 graphs again where one changed.
ASYNCLLM_DECODE_TUNING=0 turns it off.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from asyncllm import settings
from asyncllm.attention.base import ForwardBatch
from asyncllm.layers import skinny_linear
from asyncllm.runner.cuda_graph import CudaGraphRunner
from asyncllm.startup_cache import StartupDecisions

logger = logging.getLogger("asyncllm")

MIN_GAIN = 0.002  # of the step's time: below it (or MIN_GAIN_MS) a tiling is noise, and the decision stays
MIN_GAIN_MS = 0.002
REPEATS = 5  # timings per alternative, each of REPLAYS graph replays (the median counts)
REPLAYS = 20


def choose_by_step_time(alternatives: list[tuple[bool, tuple, list]], set_choice: Callable[[bool, tuple, object], None],
                        step_ms: Callable[[], float]) -> list[tuple[tuple, object, float, float]]:
    """For each (gated, key, tilings), the first tiling being the current decision: the tiling whose
    step_ms() is least, where it beats the first by MIN_GAIN and MIN_GAIN_MS; set_choice leaves it in
    place. Returns (key, tiling kept, the first's ms, the kept one's ms) per key."""
    kept = []
    for gated, key, tilings in alternatives:
        set_choice(gated, key, tilings[0])
        first_ms = best_ms = step_ms()
        best = tilings[0]
        for tiling in tilings[1:]:
            set_choice(gated, key, tiling)
            try:
                ms = step_ms()
            except Exception as exc:  # noqa: BLE001 - a tiling that fails to compile here only drops out
                logger.warning("decode tuning: tiling %s for %s left out: %s: %s", tiling.label(), key[3:5],
                               type(exc).__name__, str(exc)[:200])
                continue
            if ms < best_ms and ms < min(first_ms * (1 - MIN_GAIN), first_ms - MIN_GAIN_MS):
                best, best_ms = tiling, ms
        set_choice(gated, key, best)
        kept.append((key, best, first_ms, best_ms))
    return kept


@torch.inference_mode()
def tune_batch1_projections(graphs: CudaGraphRunner, decode_batch: Callable[[int], ForwardBatch],
                            decisions: StartupDecisions | None = None) -> None:
    """Settle the 1-row skinny-GEMM tilings in the batch-1 decode graph of `graphs` (one rank; before
    sampler graphs are captured over the forward graphs' outputs). decode_batch(context): a batch of
    one decode over that many tokens that stores nothing, to replay the graph on. decisions: the
    start-up cache that may hold the answer (and keeps a new one)."""
    if not settings.DECODE_TUNING.read():
        return
    alternatives = [item for item in skinny_linear.batch1_alternatives() if len(item[2]) > 1]
    if not alternatives:
        return
    start = time.perf_counter()
    bound = graphs.context_bounds[1][0]
    key = ("decode", 1, bound)

    measured = []  # whether tuned() ran: a measurement captured the graph with each tiling tried

    def tuned() -> list[list]:  # per alternative [index of the tiling kept, first ms, kept ms]
        measured.append(True)
        batch = decode_batch(max(1, bound // 2))

        def step_ms() -> float:
            graphs.recapture([key])
            graphs.run(batch)  # the decode's metadata into the graph's buffers (the capture cleared them)
            return sorted(graphs.replay_ms(key, REPLAYS) for _ in range(REPEATS))[REPEATS // 2]
        kept = choose_by_step_time(alternatives, skinny_linear.set_choice, step_ms)
        return [[tilings.index(tiling), first, best]
                for (_, _, tilings), (_, tiling, first, best) in zip(alternatives, kept)]

    question = {"context_bound": bound, "alternatives": [
        [gated, [str(part) for part in decided_key[1:]], [asdict(tiling) for tiling in tilings]]
        for gated, decided_key, tilings in alternatives]}
    answer = (decisions or StartupDecisions(None)).remembered(
        "decode tuning", question, tuned, valid=lambda answer: _valid_answer(answer, alternatives))
    for (gated, decided_key, tilings), (index, _, _) in zip(alternatives, answer):
        skinny_linear.set_choice(gated, decided_key, tilings[index])  # where measured, already so
        skinny_linear.settle(gated, decided_key)
    if measured or any(index != 0 for index, _, _ in answer):
        graphs.recapture([k for k in graphs.graphs if k[0] == "decode" and k[1] == 1])
    logger.info("batch-1 decode graph's projections %s in %.1f s: %s",
                "tuned" if measured else "set from the start-up cache", time.perf_counter() - start,
                "; ".join(f"({k[3]}, {k[4]}) {tilings[index].label()} {first:.4f} -> {best:.4f} ms"
                          for (_, k, tilings), (index, first, best) in zip(alternatives, answer)))


def _valid_answer(answer, alternatives: list) -> bool:
    """A stored answer fits these alternatives: [index, first ms, kept ms] for each."""
    return isinstance(answer, list) and len(answer) == len(alternatives) and all(
        isinstance(item, list) and len(item) == 3 and type(item[0]) is int and 0 <= item[0] < len(tilings)
        and all(isinstance(ms, (int, float)) for ms in item[1:]) for item, (_, _, tilings) in zip(answer, alternatives))
