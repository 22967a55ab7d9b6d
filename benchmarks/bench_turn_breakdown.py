"""Where the time to first token of one new turn over a long cached history goes (issue 44).

    python benchmarks/bench_turn_breakdown.py [--model-dir DIR] [--cached-tokens 32768] [--new-tokens 64]
                                              [--answer-tokens 2] [--reps 5] [--paths async,sync]

The turn of bench_multiturn.py's "cached" case: one --cached-tokens prompt prefilled once, then --reps
times the same prompt + --new-tokens new random ids (the prefix cache serves the context), each asking
for --answer-tokens tokens. async: through AsyncLLMEngine.stream, as bench_multiturn measures it;
sync: the same turns through LLM.generate in the same process afterwards (no thread, no event loop).

The engine's own methods are wrapped on the instances (nothing in the package changes) and each call
timed with its thread, so a turn is a timeline from the submission to the consumer's first token:

  intake       the event loop's encode + check_request, up to the post to the engine thread (sync: up to add)
  to engine    post -> the engine thread applies the AddRequest (its wake-up, the interpreter lock)
  add          EngineCore.add_checked_request
  launch       the turn's step launched (EngineCore.launch_step), of which: schedule (match_prefix
               apart), inputs (ModelRunner.build_inputs), forward (host: graph replay or eager kernel
               launches; on CPU the compute itself), sampling (host)
  launch ahead the next step's launch before the turn's resolve (overlap: queued while the device runs
               the turn; on CPU, whose forward is synchronous, it adds its compute)
  device wait  the thread blocked on the step's results (LaunchedStep._on_host; the lock free)
  resolve      EngineCore.resolve_step less that wait
  next launch  a launch after the resolve, before the token goes out (async with overlap: the
               engine thread delivers after its next launch)
  deliver      EngineThread._deliver up to its wake-up of the consumers' event loops (async only)
  to consumer  that wake-up -> the consumer's `async for` has the token (the event loop's wake-up,
               the interpreter lock, the stream's own work)
  gaps         what the timeline does not cover (the loop's other work, waits for the lock)

On CUDA, events around the turn's forward and sampling give their GPU time. The step's path: the
CUDA graph it replayed (kind, token bucket, sequence slots) or eager, the varlen kernel's KV split
count that step ran with, and the count choose_prefill_splits gives the step's own shape (what an
eager step, or a graph captured for one sequence, would use). Medians over --reps; the timeline of
the median turn of each path is printed too.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time

import torch
from common import (Report, add_engine_args, checkpoint_from_args, engine_kwargs, format_table, make_parser, ms,
                    parse_args, random_prompt, release_memory)

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm import engine_thread as engine_thread_module
from asyncllm.runner.launched_step import LaunchedStep

PATHS = ("async", "sync")
# the summary's stages, in timeline order (ms); "-" where a path has none
STAGES = ("intake", "to engine", "add", "before launch", "launch", "schedule", "match_prefix", "inputs",
          "forward host", "sampling host", "launch ahead", "device wait", "resolve", "next launch", "deliver", "to consumer",
          "gaps", "ttft", "forward gpu", "sampling gpu")


class TurnTrace:
    """Timed spans of the engine's calls, from whichever thread made them, for the turn being traced."""

    def __init__(self, core, engine_thread=None):
        self.core = core
        self.spans: list[tuple[str, float, float, str]] = []  # (name, start, end, thread)
        self.steps: list[dict] = []  # per launch: its path and CUDA events
        self.marks: dict[str, float] = {}
        self.seq = None
        self._wake = None
        self._cuda = core.runner.device.type == "cuda"
        runner = core.runner
        self._wrap(core, "launch_step", "launch", self._launch_started)
        self._wrap(core, "resolve_step", "resolve")
        self._wrap(core, "add_checked_request", "add", after=self._added)
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.block_manager, "match_prefix", "match_prefix")
        self._wrap(runner, "build_inputs", "inputs")
        self._wrap(runner, "_forward", "forward host", self._gpu_start("forward"), self._gpu_stop("forward"))
        self._wrap(runner, "sample", "sampling host", self._gpu_start("sampling"), self._gpu_stop("sampling"))
        self._wrap(runner.attn_backend, "prepare_metadata", None, after=self._eager_metadata)
        if runner.graph_runner is not None:
            self._wrap(runner.graph_runner, "run", None, before=self._graph_run)
        if engine_thread is not None:
            self._wrap(engine_thread, "post", "post")
            self._wrap(engine_thread, "_deliver", "deliver")
            # the cross-thread wake-up of the consumers' event loops, inside _deliver
            self._wake = engine_thread_module.wake
            self._wrap(engine_thread_module, "wake", "wake")
        self._on_host = LaunchedStep._on_host
        trace = self

        def on_host(step):
            start = time.perf_counter()
            try:
                return trace._on_host(step)
            finally:
                trace._span("device wait", start)
        LaunchedStep._on_host = on_host  # restored by close()

    def close(self) -> None:
        LaunchedStep._on_host = self._on_host
        if self._wake is not None:
            engine_thread_module.wake = self._wake

    def begin(self) -> None:
        self.spans, self.steps, self.marks, self.seq = [], [], {"submit": time.perf_counter()}, None

    def _added(self, seq, *args, **kwargs) -> None:
        self.seq = seq  # the turn's sequence: how much of it the prefix cache served

    def _span(self, name: str, start: float) -> None:
        self.spans.append((name, start, time.perf_counter(), threading.current_thread().name))

    def _wrap(self, owner, attr: str, name: str | None, before=None, after=None) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            if before is not None:
                before(*args, **kwargs)
            start = time.perf_counter()
            try:
                result = inner(*args, **kwargs)
            finally:
                if name is not None:
                    self._span(name, start)
            if after is not None:
                after(result, *args, **kwargs)
            return result
        setattr(owner, attr, timed)

    # ---- the step's path and GPU time ------------------------------------------------------------
    def _launch_started(self, *args, **kwargs) -> None:
        self.steps.append(dict(path="eager", events={}))

    def _gpu_start(self, what: str):
        def record(*args, **kwargs):
            if self._cuda and self.steps:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.steps[-1]["events"][what] = [event, None]
        return record

    def _gpu_stop(self, what: str):
        def record(result, *args, **kwargs):
            if self._cuda and self.steps and what in self.steps[-1]["events"]:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.steps[-1]["events"][what][1] = event
        return record

    def _shape(self, batch) -> dict:
        shape = dict(tokens=batch.num_tokens, seqs=batch.num_seqs, max_query_len=batch.max_query_len,
                     max_seq_len=batch.max_seq_len)
        backend = self.core.runner.attn_backend
        if hasattr(backend, "_prefill_splits") and batch.max_query_len > 1:  # the Triton backend's choice
            shape["splits_for_shape"] = backend._prefill_splits(batch.num_tokens, batch.num_seqs,
                                                                batch.max_query_len, batch.max_seq_len)
        return shape

    def _graph_run(self, batch) -> None:
        graphs = self.core.runner.graph_runner
        key = graphs._key(batch)
        if key is None or not self.steps:
            return
        graph_batch = graphs.batches[key]
        meta = graph_batch.attn_metadata
        self.steps[-1].update(self._shape(batch), path=f"{key[0]} graph, {key[1]} tokens, {graph_batch.num_seqs} "
                              f"sequence slots", splits=getattr(meta, "prefill_splits", None))

    def _eager_metadata(self, result, batch) -> None:
        if self.steps:
            self.steps[-1].update(self._shape(batch), path="eager",
                                  splits=getattr(batch.attn_metadata, "prefill_splits", None))

    def gpu_ms(self, step: dict, what: str) -> float | None:
        pair = step["events"].get(what)
        if not pair or pair[1] is None:
            return None
        pair[1].synchronize()
        return pair[0].elapsed_time(pair[1])


def turn_stages(trace: TurnTrace, first_token: float) -> tuple[dict, list]:
    """The stages (ms) of the traced turn whose first token reached its consumer at first_token, and
    its timeline [(offset ms, name, ms, thread)] up to then."""
    t0 = trace.marks["submit"]
    spans = sorted((s for s in trace.spans if t0 <= s[1] <= first_token), key=lambda s: s[1])
    timeline = [(ms(start - t0), name, ms(end - start), thread) for name, start, end, thread in spans]

    def first(name: str, after: float = 0.0):
        return next((s for s in spans if s[0] == name and s[1] >= after), None)

    def inside(name: str, outer) -> float:
        return sum(e - s for n, s, e, _ in spans if n == name and outer is not None and s >= outer[1] and e <= outer[2])

    stages = dict.fromkeys(STAGES)
    post, add = first("post"), first("add")
    if post is not None:  # async: the event loop's intake, then the hand-off
        stages["intake"], stages["to engine"] = post[2] - t0, add[1] - post[2]
    else:
        stages["intake"] = add[1] - t0
    stages["add"] = add[2] - add[1]
    launch = first("launch", add[2])
    stages["before launch"] = launch[1] - add[2]
    stages["launch"] = launch[2] - launch[1]
    for name in ("schedule", "match_prefix", "inputs", "forward host", "sampling host"):
        stages[name] = inside(name, launch)
    # the resolve that returned the turn's token: the last one before it went out
    resolve = [s for s in spans if s[0] == "resolve" and s[1] >= launch[2]]
    deliver = first("deliver", launch[2])
    if post is not None and deliver is not None:
        resolve = [s for s in resolve if s[2] <= deliver[1]]
    resolve = resolve[-1]
    waits = [s for s in spans if s[0] == "device wait" and launch[2] <= s[1] <= resolve[2]]
    stages["device wait"] = sum(e - s for _, s, e, _ in waits)
    stages["resolve"] = resolve[2] - resolve[1] - inside("device wait", resolve)
    # launches between the turn's and its resolve: overlap's next step, queued while the device runs the turn
    stages["launch ahead"] = sum(e - s for n, s, e, _ in spans if n == "launch" and launch[2] <= s and e <= resolve[1])
    if deliver is not None:
        next_launch = [s for s in spans if s[0] == "launch" and s[1] >= resolve[2] and s[2] <= deliver[1]]
        stages["next launch"] = sum(e - s for _, s, e, _ in next_launch)
        wake = first("wake", deliver[1])
        stages["deliver"] = wake[1] - deliver[1]
        stages["to consumer"] = first_token - wake[1]
    stages["ttft"] = first_token - t0
    covered = sum(stages[k] or 0.0 for k in ("intake", "to engine", "add", "before launch", "launch", "launch ahead",
                                              "device wait",
                                              "resolve", "next launch", "deliver", "to consumer"))
    stages["gaps"] = stages["ttft"] - covered
    stages = {k: (None if v is None else v * 1e3) for k, v in stages.items()}
    step = trace.steps[0] if trace.steps else {}
    stages["forward gpu"], stages["sampling gpu"] = trace.gpu_ms(step, "forward"), trace.gpu_ms(step, "sampling")
    stages["path"] = step.get("path")
    for key in ("tokens", "seqs", "max_seq_len", "splits", "splits_for_shape"):
        stages[key] = step.get(key)
    return stages, timeline


def turn_prompts(args) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(args.seed + 11)
    context = random_prompt(rng, args.cached_tokens)
    return context, [context + random_prompt(rng, args.new_tokens) for _ in range(args.reps)]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)


async def async_turns(model_dir: str, kwargs: dict, args) -> list[tuple[dict, list]]:
    context, prompts = turn_prompts(args)
    async with AsyncLLMEngine(model_dir, **kwargs) as engine:
        await engine.generate(context[:1024], params(4))  # warm-up: kernels compiled before timing
        await engine.generate(context, params(1))  # the context prefilled: cached from now on
        await engine.generate(context + [7] * args.new_tokens, params(args.answer_tokens))  # this shape once
        await engine.wait_idle()
        thread = engine._engine_thread
        trace = TurnTrace(thread.core, thread)
        turns = []
        try:
            for prompt in prompts:
                await engine.wait_idle()
                trace.begin()
                stream = engine.stream(prompt, params(args.answer_tokens))
                first = None
                async for out in stream:
                    if out.token_ids and first is None:
                        first = time.perf_counter()
                check_cached(trace.seq, args)
                turns.append(turn_stages(trace, first))
        finally:
            trace.close()
    return turns


def sync_turns(model_dir: str, kwargs: dict, args) -> list[tuple[dict, list]]:
    context, prompts = turn_prompts(args)
    with LLM(model_dir, **kwargs) as llm:
        llm.generate([context[:1024]], params(4), use_tqdm=False)
        llm.generate([context], params(1), use_tqdm=False)
        llm.generate([context + [7] * args.new_tokens], params(args.answer_tokens), use_tqdm=False)
        core = llm.core
        trace = TurnTrace(core)
        resolve = core.resolve_step
        first_token = {}

        def resolve_noting_the_first_token():
            events = resolve()
            if events and "t" not in first_token:
                first_token["t"] = time.perf_counter()
            return events
        core.resolve_step = resolve_noting_the_first_token
        turns = []
        try:
            for prompt in prompts:
                first_token.clear()
                trace.begin()
                llm.generate([prompt], params(args.answer_tokens), use_tqdm=False)
                check_cached(trace.seq, args)
                turns.append(turn_stages(trace, first_token["t"]))
        finally:
            trace.close()
            core.resolve_step = resolve
    return turns


def check_cached(seq, args) -> None:
    """The turn is the case only if the prefix cache served its context's full KV blocks."""
    expected = args.cached_tokens // seq.block_size * seq.block_size
    if seq.num_cached_prompt_tokens != expected:
        raise RuntimeError(f"the prefix cache served {seq.num_cached_prompt_tokens} tokens of the turn, not {expected}")


def summary_row(path: str, turns: list[tuple[dict, list]]) -> dict:
    row = dict(path=path)
    for stage in STAGES:
        values = [t[0][stage] for t in turns if t[0][stage] is not None]
        row[stage] = statistics.median(values) if values else None
    first = turns[0][0]
    for key in ("path", "tokens", "seqs", "max_seq_len", "splits", "splits_for_shape"):
        row["step " + key if key == "path" else key] = first[key]
    return row


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--cached-tokens", type=int, default=32768, help="the cached context's tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="the turn's new tokens")
    parser.add_argument("--answer-tokens", type=int, default=2,
                        help="tokens each turn asks for (>= 2: the next step launches before the first goes out)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--paths", default="async,sync", help=f"comma-separated of {', '.join(PATHS)}")
    args = parse_args(parser, argv)
    args.paths = [p for p in args.paths.split(",") if p]
    if set(args.paths) - set(PATHS) or args.reps < 1 or args.answer_tokens < 1:
        parser.error(f"--paths: of {list(PATHS)}; --reps and --answer-tokens >= 1")
    report = Report("turn_breakdown", args)
    kwargs = dict(engine_kwargs(args, args.backend), enable_prefix_caching=True,
                  max_model_len=args.cached_tokens + args.new_tokens + args.answer_tokens + 8)
    timelines = {}
    with checkpoint_from_args(args) as model_dir:
        for path in args.paths:
            turns = asyncio.run(async_turns(model_dir, kwargs, args)) if path == "async" else \
                sync_turns(model_dir, kwargs, args)
            release_memory()
            report.add(summary_row(path, turns))
            median_turn = sorted(turns, key=lambda t: t[0]["ttft"])[len(turns) // 2]
            timelines[path] = median_turn[1]
    rows = report.data["results"]
    # the stages as rows, the paths as columns: one column per path reads as a breakdown
    table_rows = [dict(stage=stage, **{row["path"]: row[stage] for row in rows}) for stage in STAGES]
    table_rows += [dict(stage=key, **{row["path"]: row[key] for row in rows})
                   for key in ("step path", "tokens", "seqs", "max_seq_len", "splits", "splits_for_shape")]
    columns = [("stage (ms)", "stage")] + [(row["path"], row["path"], "{:.3f}") for row in rows]
    title = (f"TTFT of {args.cached_tokens} cached + {args.new_tokens} new tokens, {args.shape}, {args.backend}, "
             f"{args.device}, median of {args.reps}")
    table = f"### {title}\n\n" + format_table(table_rows, columns)
    for path, timeline in timelines.items():
        table += f"\n\n{path}: the median turn's timeline (offset ms, call, ms, thread)\n" + "\n".join(
            f"  {offset:9.3f}  {name:14s} {dur:8.3f}  {thread}" for offset, name, dur, thread in timeline)
    print("\n" + table)
    report.set("table", table)
    report.set("timelines", timelines)
    return report.data


if __name__ == "__main__":
    main()
