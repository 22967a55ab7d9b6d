"""Where a batch-1 decode step's time goes on the host: stream() against LLM.generate, by temperature.

    python benchmarks/bench_step_phases.py [--model-dir DIR] [--temperatures 0,0.6] [--tokens 128] [--reps 3]
                                           [--detail] [--staging on|off|both] [--greedy-graph on|off|both]

One request at a time, --tokens output tokens after a --prompt-len prompt, --reps runs per row. The
engine's own methods are wrapped (on the instance; nothing in the package changes) to time each
phase of every step, in wall time and in the calling thread's CPU time:

- launch: EngineCore.launch_step (schedule, inputs, the forward queued or replayed, sampling queued),
  and inside it build_inputs (the engine's StepPlan, engine/step_planner.py, and the runner's
  ModelRunner.build_inputs), make_batch (the one upload, or a decode graph's step staged into the
  graph's buffers: DecodeStaging.stage), forward (_forward: graph replay or eager; replay_staged),
  sampling_inputs (SamplingInputs.plan) and sampler (the Sampler call, or the sampler graph's
  replay: both count where both run);
- wait: EngineCore.wait_step, the engine thread blocked on the device (the interpreter lock free;
  stream() only: LLM.generate waits inside resolve);
- resolve: EngineCore.resolve_step; deliver: EngineThread._deliver (stream() only).

With --detail, the parts of launch too (each inside one of the phases above): schedule and commit
(the scheduler's), timer (the step timer's events), upload (host_upload.upload_arrays, inside
make_batch), metadata (the backend's prepare_metadata: inside forward, eager steps only),
replay_inputs (the backend's prepare_for_replay, inside forward), replay (every CUDAGraph.replay:
the forward graph's inside forward, the sampler graph's inside sampler), sampling_tensors
(SamplingInputs.tensors) and queue_copy (LaunchedStep._queued: the sampled ids' copy to the host
and its event).

--staging both runs each row twice in the same engine, one after the other: decode graphs' steps
staged from the host in one copy (runner/decode_staging.py, the engine's way) and loaded from a
batch uploaded to the device (the way before it); one process, so that a host's speed, which can
differ between processes on one machine by up to 2x, is the same for both. --greedy-graph both does
the same for greedy rows: their tokens from the sampler graph's race at temperature 0 (the engine's
way), or from an eager argmax after the forward graph (the way before it); sampled rows run once.

A phase whose wall time is well over its CPU time waited for something: the device, or the
interpreter lock held by the other thread. The table gives each phase's median per step (us), the
step period (launch to launch), the device's share of it (steps' device time from stats), and the
event loop thread's CPU time per token (stream() only).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import random
import statistics
import threading
import time

import torch
from bench_latency import stream_tpot_runs
from common import (Report, add_engine_args, checkpoint_from_args, engine_kwargs, format_table, make_parser,
                    parse_args, random_prompt, release_memory)

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.engine import core as engine_core
from asyncllm.runner import model_runner
from asyncllm.runner.launched_step import LaunchedStep


class PhaseClock:
    """Wall and thread-CPU time of wrapped methods, per call, grouped into steps by `launch`."""

    def __init__(self):
        self.steps: list[dict[str, list[float]]] = []
        self.launch_starts: list[float] = []
        self.recording = False
        self._wrapped: list[tuple[object, str, object]] = []  # (owner, name, what owner.__dict__ held)

    def wrap(self, owner, name: str, phase: str) -> None:
        """Time owner.name (an instance's, a class's or a module's attribute) as part of phase."""
        method = getattr(owner, name, None) if owner is not None else None
        if method is None:  # another version of the engine (the script compares versions): no such phase
            return
        # a class's function: the wrapper is a function too, so the class binds it as it did the original
        wrapper = self._timed(method, phase)
        self._wrapped.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, wrapper)

    def _timed(self, method, phase: str):
        def timed(*args, **kwargs):
            if not self.recording:
                return method(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            if phase == "launch":
                self.launch_starts.append(wall)
                self.steps.append(collections.defaultdict(list))
            try:
                return method(*args, **kwargs)
            finally:
                if self.steps:
                    step = self.steps[-1]
                    step[phase].append(time.perf_counter() - wall)
                    step[phase + " cpu"].append(time.thread_time() - cpu)
        return timed

    def remove(self) -> None:
        """The wrappers go (the engine's own methods again; nothing keeps the engine alive)."""
        for owner, name, held in reversed(self._wrapped):
            if held is None:  # an instance's method came from its class
                delattr(owner, name)
            else:
                setattr(owner, name, held)
        self._wrapped = []

    def instrument(self, core, engine=None, detail: bool = False) -> None:
        runner = core.runner
        if detail:
            self.wrap(core.scheduler, "schedule", "schedule")
            self.wrap(core.scheduler, "commit", "commit")
            self.wrap(core.step_timer, "start", "timer")
            self.wrap(core.step_timer, "stop", "timer")
            self.wrap(model_runner, "upload_arrays", "upload")
            self.wrap(runner.attn_backend, "prepare_metadata", "metadata")
            self.wrap(runner.attn_backend, "prepare_for_replay", "replay_inputs")
            self.wrap(torch.cuda.CUDAGraph, "replay", "replay")
            self.wrap(runner.sampling_inputs, "tensors", "sampling_tensors")
            self.wrap(LaunchedStep, "_queued", "queue_copy")
        self.wrap(core, "launch_step", "launch")
        self.wrap(core, "wait_step", "wait")
        self.wrap(core, "resolve_step", "resolve")
        # the step's inputs: the engine's pass over the rows (its StepPlan), then the runner's numpy
        self.wrap(engine_core, "plan_step", "build_inputs")
        self.wrap(runner, "build_inputs", "build_inputs")
        self.wrap(runner, "_make_batch", "make_batch")
        self.wrap(getattr(runner.graph_runner, "staging", None), "stage", "make_batch")
        self.wrap(runner, "_forward", "forward")
        self.wrap(runner.graph_runner, "replay_staged", "forward")
        self.wrap(runner.sampling_inputs, "plan", "sampling_inputs")
        self.wrap(runner.sampler, "forward", "sampler")
        self.wrap(getattr(runner, "sampler_graphs", None), "sample", "sampler")
        if engine is not None:
            self.wrap(engine._engine_thread, "_deliver", "deliver")

    def summary(self, skip: int = 4) -> dict[str, float]:
        """Median per step (us) of each phase's summed calls, over steps after the first `skip`."""
        steps = self.steps[skip:-1]
        phases = sorted({p for s in steps for p in s})
        out = {p: statistics.median(sum(s.get(p, [0.0])) for s in steps) * 1e6 for p in phases}
        periods = [b - a for a, b in zip(self.launch_starts[skip:], self.launch_starts[skip + 1:])]
        out["period"] = statistics.median(periods) * 1e6 if periods else 0.0
        return out


def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


async def stream_rows(model_dir: str, kwargs: dict, rng: random.Random, args) -> list[dict]:
    rows = []
    async with AsyncLLMEngine(model_dir, **kwargs) as engine:
        await engine.generate(random_prompt(rng, args.prompt_len), SamplingParams(max_tokens=8, ignore_eos=True))
        engine_thread = engine._engine_thread.thread
        for temperature, staged, greedy_graph in variants(args):
            set_staging(engine._core.runner, staged, greedy_graph)
            params = SamplingParams(temperature=temperature, max_tokens=args.tokens, ignore_eos=True)
            await engine.generate(random_prompt(rng, args.prompt_len), params)  # this temperature's kernels warm
            clock = PhaseClock()
            clock.instrument(engine._core, engine, args.detail)
            await engine.wait_idle()
            before = engine.stats()
            loop_cpu, engine_cpu = time.thread_time(), thread_cpu(engine_thread)
            clock.recording = True
            tpots = await stream_tpot_runs(engine, rng, args.prompt_len, args.tokens - 1, args.reps, temperature)
            clock.recording = False
            loop_cpu, engine_cpu = time.thread_time() - loop_cpu, thread_cpu(engine_thread) - engine_cpu
            await engine.wait_idle()
            after = engine.stats()
            tokens = args.reps * args.tokens
            rows.append(row("stream()", temperature, staged, greedy_graph, tpots, clock, before, after, tokens,
                            engine_cpu, loop_cpu))
            clock.remove()
    return rows


def generate_rows(model_dir: str, kwargs: dict, rng: random.Random, args) -> list[dict]:
    rows = []
    llm = LLM(model_dir, **kwargs)
    llm.generate([random_prompt(rng, args.prompt_len)], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    clock = PhaseClock()
    clock.instrument(llm.core, detail=args.detail)
    for temperature, staged, greedy_graph in variants(args):
        set_staging(llm.core.runner, staged, greedy_graph)
        params = SamplingParams(temperature=temperature, max_tokens=args.tokens, ignore_eos=True)
        llm.generate([random_prompt(rng, args.prompt_len)], params, use_tqdm=False)
        clock.steps, clock.launch_starts = [], []
        before = llm.core.stats()
        cpu = time.thread_time()
        clock.recording = True
        tpots = []
        for _ in range(args.reps):
            start = time.perf_counter()
            llm.generate([random_prompt(rng, args.prompt_len)], params, use_tqdm=False)
            tpots.append((time.perf_counter() - start) / args.tokens)  # TTFT included: one prefill in 128 steps
        clock.recording = False
        cpu = time.thread_time() - cpu
        after = llm.core.stats()
        rows.append(row("LLM.generate", temperature, staged, greedy_graph, tpots, clock, before, after,
                        args.reps * args.tokens, cpu, None))
    clock.remove()
    llm.close()
    llm = None  # noqa: F841
    release_memory()
    return rows


def variants(args) -> list[tuple[float, bool, bool]]:
    """(temperature, staged, greedy rows through the sampler graph) of each row: --greedy-graph only
    varies greedy rows."""
    return [(t, staged, greedy_graph) for t, staged, greedy_graph in
            itertools.product(args.temperatures, args.staging, args.greedy_graph) if t == 0 or greedy_graph]


def set_staging(runner, staged: bool, greedy_graph: bool = True) -> None:
    """Decode graphs' steps staged from the host in one copy (runner/decode_staging.py, the engine's
    way), or loaded from a batch uploaded to the device as before it (--staging off); greedy steps'
    tokens from the sampler graph (the engine's way), or an eager argmax (--greedy-graph off)."""
    if staged:
        vars(runner).pop("_staged_decode_key", None)
    else:
        runner._staged_decode_key = lambda inputs: None
    vars(runner).pop("sample", None)
    if not greedy_graph:
        sample = runner.sample
        runner.sample = lambda logits, sampling: runner.sampler(logits, sampling) if sampling.all_greedy \
            else sample(logits, sampling)


def row(path: str, temperature: float, staged: bool, greedy_graph: bool, tpots: list[float], clock: PhaseClock,
        before: dict, after: dict, tokens: int, engine_cpu: float, loop_cpu: float | None) -> dict:
    phases = clock.summary()
    steps = after["num_steps"] - before["num_steps"]
    device_us = (after["steps_total_s"] - before["steps_total_s"]) / max(steps, 1) * 1e6
    out = dict(path=path, temperature=temperature, staging="on" if staged else "off",
               greedy_graph="on" if greedy_graph else "off", tpot_ms=statistics.median(tpots) * 1e3,
               period_us=phases.pop("period"), device_us=device_us,
               engine_cpu_us=engine_cpu / tokens * 1e6, loop_cpu_us=None if loop_cpu is None else loop_cpu / tokens * 1e6)
    out.update({f"{name}_us": value for name, value in phases.items()})
    return out


PHASES = ["launch", "build_inputs", "make_batch", "forward", "sampling_inputs", "sampler", "deliver", "wait",
          "resolve"]
DETAIL_PHASES = ["schedule", "commit", "timer", "upload", "metadata", "replay_inputs", "replay", "sampling_tensors",
                 "queue_copy"]
COLUMNS = [("path", "path"), ("T", "temperature"), ("staging", "staging"), ("greedy graph", "greedy_graph"),
           ("TPOT ms", "tpot_ms", "{:.3f}"),
           ("period us", "period_us", "{:.0f}"), ("device us/step", "device_us", "{:.0f}"),
           ("engine CPU us/tok", "engine_cpu_us", "{:.0f}"), ("loop CPU us/tok", "loop_cpu_us", "{:.0f}")] + [
    (f"{p} us (cpu)", f"{p}_pair") for p in PHASES]
DETAIL_COLUMNS = [("path", "path"), ("T", "temperature"), ("staging", "staging"), ("greedy graph", "greedy_graph")] + [
    (f"{p} us (cpu)", f"{p}_pair") for p in DETAIL_PHASES]


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--temperatures", default="0,0.6")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--detail", action="store_true",
                        help="also time the parts of launch (a second table; each wrapper adds ~1 us)")
    parser.add_argument("--staging", choices=["on", "off", "both"], default="on",
                        help="decode graphs' steps staged in one copy (on, the engine's way) or loaded from a "
                             "device batch (off); both: each row both ways, one after the other in one engine")
    parser.add_argument("--greedy-graph", choices=["on", "off", "both"], default="on",
                        help="greedy steps' tokens from the sampler graph (on, the engine's way) or an eager "
                             "argmax (off); both: each greedy row both ways in one engine")
    parser.set_defaults(max_num_seqs=8)
    args = parse_args(parser, argv)
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.staging = {"on": [True], "off": [False], "both": [True, False]}[args.staging]
    args.greedy_graph = {"on": [True], "off": [False], "both": [True, False]}[args.greedy_graph]
    report = Report("step_phases", args)
    rng = random.Random(args.seed)
    with checkpoint_from_args(args) as model_dir:
        kwargs = engine_kwargs(args, args.backend)
        results = generate_rows(model_dir, kwargs, rng, args)
        results += asyncio.run(stream_rows(model_dir, kwargs, rng, args))
    for r in results:
        for p in PHASES + DETAIL_PHASES:
            wall, cpu = r.get(f"{p}_us"), r.get(f"{p} cpu_us")
            r[f"{p}_pair"] = "-" if wall is None else f"{wall:.0f} ({cpu:.0f})"
        report.add(r)
    table = report.finish(f"Batch-1 step phases, {args.shape}, {args.backend}", COLUMNS)
    if args.detail:
        detail = format_table(report.data["results"], DETAIL_COLUMNS)
        print(f"\nThe parts of launch (us per step, median):\n\n{detail}", flush=True)
        report.set("table", f"{table}\n\nThe parts of launch:\n\n{detail}")
    return report.data


if __name__ == "__main__":
    main()
