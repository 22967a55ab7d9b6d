"""Start-up time of `LLM`, `AsyncLLMEngine` and `asyncllm serve`, cold and warm, split by phase (issue 45).

    python benchmarks/bench_startup.py [--shapes 0.6b,8b] [--apis llm,async,serve] [--caches cold,warm]
        [--warm-env default,ASYNCLLM_STAGED_LOADING=1] [--warm-reps 2] [--checkpoints DIR] [--backend triton] [--json PATH]

Each measurement is a fresh process (this script with --child API): `LLM(model)` then a 16-token
generate of one token; `AsyncLLMEngine(model)` + start() then the first item of a stream; `asyncllm
serve` (asyncllm.cli.main, in the child) polled on /health every 20 ms from the spawn, then one
streamed /v1/completions request. Times are from the spawn: "imports" = the interpreter's start and
the imports of torch and asyncllm (for serve the server's too; and this script's own, httpx and
pytest, about 0.3 s on a CPU host), "ready" = the engine constructed /
started / /health answering 200, "first token" = ready -> the first request's first token (kernels
the start-up did not meet compile there).

cold: the caches empty: ASYNCLLM_CACHE, CUDA_CACHE_PATH and TORCHINDUCTOR_CACHE_DIR point at a
fresh directory per (shape, API), TRITON_CACHE_DIR is unset and the start-up cache on
(ASYNCLLM_STARTUP_CACHE=1), so the engine keeps both halves of its start-up cache under that
ASYNCLLM_CACHE as it does for a user: Triton's compiled kernels in triton/, the decisions start-up
measured (skinny GEMM, decode tuning, the memory probe, the step model's calibration; asyncllm/startup_cache.py) in
startup/. warm: a second run on the same directories, which reads them. Each row counts the files
there after its run ("triton_files", "startup_files") and the decisions its start-up read from the
cache and measured ("decisions_read", "decisions_measured", from the engine's "ready" line). (The
checkpoint's files stay in the page cache from the build: a fresh machine reads them from disk too.)
--warm-env compares start-up switches without a cold run each: after the one cold run, every warm
variant (`default`: the environment as it is; `NAME=VALUE[;NAME=VALUE]`: those set for the child) starts
--warm-reps times on the same caches, the variants alternated; each row says its "variant".

Phases: the engine's own start-up timings (asyncllm/startup.py: config, heap freeze, tokenizer,
build model, load weights, ..., CUDA graphs, decode tuning, sampler graphs, step-model calibration,
request intake; STARTUP_PHASES), read from the log records that end each phase (their
`startup_phase` and `startup_s`; also in the serve child, where the engine is the server's); a
phase that did not run (CUDA only) is None. "other" is ready - imports - the phases (the engine
thread's start, uvicorn's). The engine's own INFO/DEBUG log lines are kept with their time since the
spawn (JSON "logs"; the INFO ones printed: what each phase does as it starts and ends, the
engine's "start-up: ready after ..." and serve's "asyncllm serve: ready ..."). The 8B shape
and its cold runs take minutes: give a GPU call one shape (--shapes 0.6b, then --shapes 8b).
"""
from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from common import (REPO_ROOT, SHAPES, Report, add_engine_args, child_env, engine_kwargs, make_parser, parse_args,
                    random_prompt, serve_options, strip_options)
from load_clients import close_client, make_client

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.kernels import compiled_variants
from asyncllm.startup import STARTUP_PHASES

sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))  # tests/helpers.py: how the tests start and stop a server
from helpers import free_port, stop_process  # noqa: E402

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
APIS = ("llm", "async", "serve")
PHASE_NAMES = list(STARTUP_PHASES)  # the engine's, in order
CACHE_VARIABLES = ("ASYNCLLM_CACHE", "CUDA_CACHE_PATH", "TORCHINDUCTOR_CACHE_DIR")
FIRST_PROMPT = random_prompt(random.Random(0), 16)


# ---- the child: one start-up, recorded --------------------------------------------------------------------------
class Recorder(logging.Handler):
    """Events, the engine's start-up phases and its log lines, each a JSON line (wall-clock times)
    appended at once, so that a server stopped by a signal leaves them all."""

    def __init__(self, path: str):
        super().__init__(logging.DEBUG)
        self.file = open(path, "a")
        self.write_lock = threading.Lock()

    def write(self, **record) -> None:
        with self.write_lock:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def event(self, name: str) -> None:
        self.write(event=name, t=time.time())

    def emit(self, record: logging.LogRecord) -> None:
        phase = getattr(record, "startup_phase", None)  # the engine's start-up timings (asyncllm/startup.py)
        if phase is not None:
            self.write(phase=phase, seconds=record.startup_s)
        if hasattr(record, "startup_total_s"):  # the engine's "ready" line: what its start-up cache held
            self.write(decisions_read=record.startup_decisions_read,
                       decisions_measured=record.startup_decisions_measured)
        self.write(log=record.getMessage(), level=record.levelname, t=record.created)


async def first_stream_item(model_dir: str, kwargs: dict, recorder: Recorder) -> None:
    async with AsyncLLMEngine(model_dir, **kwargs) as engine:
        recorder.event("ready")
        async for out in engine.stream(FIRST_PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)):
            if out.token_ids:
                recorder.event("first_token")
                break


def run_child(args) -> int:
    if args.child == "serve":
        importlib.import_module("asyncllm.cli")
        importlib.import_module("asyncllm.server")  # what `asyncllm serve` imports before the engine starts
    recorder = Recorder(args.phases_file)
    recorder.event("imports")
    engine_logger = logging.getLogger("asyncllm")
    engine_logger.setLevel(logging.DEBUG)
    engine_logger.addHandler(recorder)
    kwargs = engine_kwargs(args, args.backend)
    if args.child == "llm":
        llm = LLM(args.model_dir, **kwargs)
        recorder.event("ready")
        if args.device == "cuda":  # what a cold start compiles, per kernel (the first token's compiles not counted)
            recorder.write(compiled_variants=compiled_variants())
        llm.generate([FIRST_PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
        recorder.event("first_token")
        return 0
    if args.child == "async":
        asyncio.run(first_stream_item(args.model_dir, kwargs, recorder))
        return 0
    cli = importlib.import_module("asyncllm.cli")
    return cli.main(["serve", args.model_dir, "--port", str(args.port), "--served-model-name", "bench",
                     *serve_options(kwargs)])


# ---- the parent: spawn, wait, read the record -------------------------------------------------------------------
def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> float:
    """time.time() when /health first answers 200 (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return time.time()
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    raise RuntimeError(f"the server was not ready after {timeout:g} s")


def served_first_token(base: str) -> float:
    """time.time() of the first chunk with text of one streamed completion."""
    async def run() -> float:
        client, send = make_client("httpx", base, "bench", 1.0)
        sent = time.time()
        result = await send(FIRST_PROMPT, 8)
        await close_client(client)
        if result["ttft"] is None:
            raise RuntimeError("the first request brought no text")
        return sent + result["ttft"]
    return asyncio.run(run())


def spawn_child(args, model_dir: str, api: str, caches: str, log_path: str,
                variant: dict | None = None) -> tuple[list[dict], float]:
    """One start-up in a fresh process, with variant's variables set; (its records, the spawn's time.time())."""
    argv = strip_options(args.raw_argv, ("--shapes", "--apis", "--caches", "--checkpoints", "--json", "--model-dir",
                                         "--shape", "--warm-env", "--warm-reps"))
    records = os.path.join(os.path.dirname(log_path), "records.jsonl")
    if os.path.exists(records):
        os.remove(records)
    command = [sys.executable, os.path.abspath(__file__), *argv, "--child", api, "--model-dir", model_dir,
               "--phases-file", records]
    env = child_env(**{"ASYNCLLM_STARTUP_CACHE": "1", **(variant or {}),
                       **{name: os.path.join(caches, name.lower()) for name in CACHE_VARIABLES}})
    env.pop("TRITON_CACHE_DIR", None)  # the engine places Triton's cache under ASYNCLLM_CACHE, as for a user
    with open(log_path, "w") as log:
        if api != "serve":
            spawn = time.time()
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout_s)
            if done.returncode != 0:
                raise RuntimeError(f"the {api} child exited with {done.returncode}: {tail(log_path)}")
            return read_records(records), spawn
        port = free_port()
        spawn = time.time()
        proc = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready = wait_ready(f"http://127.0.0.1:{port}", proc, args.timeout_s)
            first = served_first_token(f"http://127.0.0.1:{port}")
        except Exception as exc:
            raise RuntimeError(f"{exc}: {tail(log_path)}") from None
        finally:
            stop_process(proc)
    return read_records(records) + [dict(event="ready", t=ready), dict(event="first_token", t=first)], spawn


def tail(path: str) -> str:
    with open(path) as f:
        return "".join(f.readlines()[-6:])


def read_records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def cached_files(caches: str) -> dict:
    """The files in the engine's start-up cache under this run's ASYNCLLM_CACHE: Triton's, the decisions'."""
    root = os.path.join(caches, "asyncllm_cache")
    return {f"{part}_files": sum(len(files) for _, _, files in os.walk(os.path.join(root, part)))
            for part in ("triton", "startup")}


def startup_row(records: list[dict], spawn: float) -> dict:
    events = {r["event"]: r["t"] - spawn for r in records if "event" in r}
    row = dict(imports_s=events["imports"], ready_s=events["ready"],
               first_token_s=events["first_token"] - events["ready"], total_s=events["first_token"])
    for phase in PHASE_NAMES:
        seconds = [r["seconds"] for r in records if r.get("phase") == phase]
        row[phase] = sum(seconds) if seconds else None
    row["other_s"] = row["ready_s"] - row["imports_s"] - sum(row[p] or 0 for p in PHASE_NAMES)
    (ready,) = [r for r in records if "decisions_read" in r]  # one engine started
    row.update(decisions_read=ready["decisions_read"], decisions_measured=ready["decisions_measured"])
    row["compiled_variants"] = next((r["compiled_variants"] for r in records if "compiled_variants" in r), None)
    row["logs"] = [[round(r["t"] - spawn, 3), r["level"], r["log"]] for r in records if "log" in r]
    return row


def measure_shape(args, shape: str, model_dir: str, report: Report) -> None:
    for api in args.apis:
        caches = tempfile.mkdtemp(prefix="asyncllm-startup-caches-")
        try:
            # warm alone: the cold run fills the caches, unreported
            runs = [("cold", "default")]
            if "warm" in args.caches:
                runs += [("warm", name) for _ in range(args.warm_reps) for name in args.warm_env]
            for state, variant in runs:
                with tempfile.TemporaryDirectory() as tmp:
                    head = dict(shape=shape, api=api, caches=state, variant=variant)
                    try:
                        records, spawn = spawn_child(args, model_dir, api, caches, os.path.join(tmp, "child.log"),
                                                     args.warm_env[variant] if state == "warm" else None)
                        row = dict(head, **startup_row(records, spawn), **cached_files(caches))
                    except Exception as exc:  # noqa: BLE001 - one failed start-up must not end the run
                        row = dict(head, error=f"{type(exc).__name__}: {exc}"[:2000])
                if state in args.caches:
                    report.add(row)
                    print_row(row)
        finally:
            shutil.rmtree(caches, ignore_errors=True)


def parse_variant(parser, text: str) -> dict:
    """A --warm-env variant's variables: {} for "default", else NAME=VALUE pairs split at ';'."""
    if text == "default":
        return {}
    pairs = [part.partition("=") for part in text.split(";")]
    if any(not name or sep != "=" for name, sep, _ in pairs):
        parser.error(f"--warm-env: {text!r} is neither 'default' nor NAME=VALUE[;NAME=VALUE]")
    return {name: value for name, _, value in pairs}


def print_row(row: dict) -> None:
    head = f"{row['shape']} {row['api']} {row['caches']}" + (f" [{row['variant']}]" if row["variant"] != "default" else "")
    if "error" in row:
        print(f"{head}: FAILED {row['error']}", flush=True)
        return
    phases = ", ".join(f"{p} {row[p]:.2f}" for p in PHASE_NAMES if row[p] is not None)
    print(f"{head}: ready {row['ready_s']:.2f} s, first token +{row['first_token_s']:.2f} s (imports "
          f"{row['imports_s']:.2f}; {phases}; other {row['other_s']:.2f}); start-up cache: "
          f"{row['decisions_read']} decisions read, {row['decisions_measured']} measured, "
          f"{row['triton_files']} Triton files, {row['startup_files']} decision files", flush=True)
    if row["compiled_variants"]:
        counts = sorted(row["compiled_variants"].items(), key=lambda item: -item[1])
        print(f"    Triton variants at ready: {sum(n for _, n in counts)} "
              f"({', '.join(f'{name} {n}' for name, n in counts)})", flush=True)
    for t, level, message in row["logs"]:
        if level != "DEBUG":
            print(f"    {t:8.2f} s  {message}", flush=True)


COLUMNS = ([("shape", "shape"), ("API", "api"), ("caches", "caches"), ("variant", "variant"), ("ready (s)", "ready_s"),
            ("first token (s after ready)", "first_token_s"), ("imports", "imports_s")]
           + [(phase, phase) for phase in PHASE_NAMES]
           + [("other", "other_s"), ("decisions read", "decisions_read"), ("decisions measured", "decisions_measured"),
              ("Triton files", "triton_files"), ("error", "error")])


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--shapes", default=None, help="comma-separated of 0.6b, 8b, tiny (default: 0.6b,8b on "
                                                       "CUDA, tiny on CPU)")
    parser.add_argument("--apis", default=",".join(APIS), help=f"comma-separated of {', '.join(APIS)}")
    parser.add_argument("--caches", default="cold,warm", help="comma-separated of cold, warm (warm alone: a cold "
                                                              "run fills the caches first, unreported)")
    parser.add_argument("--checkpoints", default=None, help="checkpoints in DIR/<shape>, built there if missing "
                                                            "(default: a temp dir, removed at the end)")
    parser.add_argument("--warm-env", default="default", help="comma-separated warm variants: default (the "
                        "environment as it is) or NAME=VALUE[;NAME=VALUE] set for that child")
    parser.add_argument("--warm-reps", type=int, default=1, help="warm start-ups of each variant (alternated)")
    parser.add_argument("--timeout-s", type=float, default=900, help="longest start-up waited for")
    parser.add_argument("--child", default=None, choices=APIS, help="(internal) run one start-up in this process")
    parser.add_argument("--phases-file", default=None, help="(internal) the child's record")
    parser.add_argument("--port", type=int, default=None, help="(internal) the serve child's port")
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(parser, raw_argv)
    if args.child:
        sys.exit(run_child(args))
    args.raw_argv = raw_argv
    args.shapes = (args.shapes or ("0.6b,8b" if args.device == "cuda" else "tiny")).split(",")
    args.apis, args.caches = args.apis.split(","), args.caches.split(",")
    for option, given, known in (("--shapes", args.shapes, SHAPES), ("--apis", args.apis, APIS),
                                 ("--caches", args.caches, ("cold", "warm"))):
        if set(given) - set(known):
            parser.error(f"{option}: unknown {sorted(set(given) - set(known))}; choose from {sorted(known)}")
    args.warm_env = {name: parse_variant(parser, name) for name in args.warm_env.split(",")}
    if args.warm_reps < 1:
        parser.error(f"--warm-reps: must be >= 1, got {args.warm_reps}")
    report = Report("startup", args)
    root = args.checkpoints or tempfile.mkdtemp(prefix="asyncllm-startup-ckpt-")
    try:
        for shape in args.shapes:
            model_dir = os.path.join(root, shape)
            # built in a process of its own: the build's GPU memory is gone before the start-ups
            subprocess.run([sys.executable, os.path.join(BENCHMARKS, "common.py"), "--shape", shape, "--out",
                            model_dir, "--device", args.device], check=True, env=child_env())
            measure_shape(args, shape, model_dir, report)
    finally:
        if not args.checkpoints:
            shutil.rmtree(root, ignore_errors=True)
    report.finish(f"Start-up, {args.backend}, seconds from the spawn", COLUMNS)
    return report.data


if __name__ == "__main__":
    main()
