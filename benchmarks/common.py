"""Shared pieces of the benchmark scripts: checkpoints, workloads, timing, tables and JSON reports.

Run on its own, it builds a random-weight checkpoint (used by run_all.py, so that the GPU memory of
the build is freed before the benchmarks start):

    python benchmarks/common.py --shape 8b --out /tmp/ckpt-8b [--device cuda]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as `python benchmarks/x.py` without installing the package
    sys.path.insert(0, REPO_ROOT)

from asyncllm import SamplingParams  # noqa: E402
from asyncllm.cli import json_object  # noqa: E402
from asyncllm.config import parse_speculative_config  # noqa: E402
from asyncllm.runner.launched_step import LaunchedStep  # noqa: E402
from asyncllm.structured import StructuredOutput  # noqa: E402
from asyncllm.testing import QWEN3_0_6B, QWEN3_8B, QWEN3_30B_A3B_12L, TINY_SHAPE, build_tiny_checkpoint  # noqa: E402
from asyncllm.validation import FieldChecks  # noqa: E402
from load_clients import ChunkClock  # noqa: E402

# 30b-a3b: Qwen3-30B-A3B's shape at 12 of its 48 layers (asyncllm/testing.py says why)
# tiny-v16k: the tiny shape with a 16k vocabulary, so that a CPU step is cheap enough for the host's
# per-token work (detokenizing, the server's chunks) to show; random prompts draw ids below 10,000
SHAPES = {"tiny": TINY_SHAPE, "tiny-v16k": dict(TINY_SHAPE, vocab_size=16384), "0.6b": QWEN3_0_6B, "8b": QWEN3_8B,
          "30b-a3b": QWEN3_30B_A3B_12L}
ARCHITECTURES = {"30b-a3b": "qwen3_moe"}  # the rest are dense Qwen3
MARKER = "bench_checkpoint.json"  # written next to the weights: what shape they are


# ---- device, checkpoints --------------------------------------------------------------------------
def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return device


def default_backend(device: str) -> str:
    return "triton" if device == "cuda" else "torch"


def make_checkpoint(shape: str, out_dir: str, dtype: torch.dtype | None = None, device: str = "auto") -> str:
    """A random-weight Qwen3 (or Qwen3-MoE) checkpoint of `shape` in out_dir; reused when out_dir already holds one.

    0.6b/8b are built directly on the GPU (bf16) when there is one: from_config on the CPU is slow
    and needs the whole model in host RAM."""
    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {sorted(SHAPES)}, got {shape!r}")
    device = resolve_device(device)
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    if os.path.exists(os.path.join(out_dir, "config.json")):
        marker = os.path.join(out_dir, MARKER)
        if os.path.exists(marker):
            with open(marker) as f:
                built = json.load(f)
            if built.get("shape") != shape:
                raise ValueError(f"{out_dir} holds a {built.get('shape')!r} checkpoint, not {shape!r}")
        return out_dir
    partial = out_dir.rstrip("/") + ".partial"  # renamed once complete: a killed build is never reused
    shutil.rmtree(partial, ignore_errors=True)
    start = time.perf_counter()
    with torch.device(device):
        build_tiny_checkpoint(partial, ARCHITECTURES.get(shape, "qwen3"), dtype=dtype, **SHAPES[shape])
    release_memory()
    with open(os.path.join(partial, MARKER), "w") as f:
        json.dump({"shape": shape, "dtype": str(dtype), "build_s": round(time.perf_counter() - start, 1)}, f)
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # an empty directory given as --model-dir
    os.rename(partial, out_dir)
    return out_dir


@contextlib.contextmanager
def checkpoint_from_args(args) -> Iterator[str]:
    """--model-dir (built there if empty, reused if not), else a temporary directory removed afterwards."""
    if args.model_dir:
        yield make_checkpoint(args.shape, args.model_dir, device=args.device)
        return
    tmp = tempfile.mkdtemp(prefix=f"asyncllm-bench-{args.shape}-")
    try:
        yield make_checkpoint(args.shape, tmp, device=args.device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- command line -----------------------------------------------------------------------------------
def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the options every benchmark shares."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="default: cuda if present")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="model shape (random weights); default 0.6b on CUDA, tiny on CPU")
    parser.add_argument("--model-dir", default=None,
                        help="checkpoint directory: reused if it holds one, else built there (default: a temp dir)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    return parser


def add_engine_args(parser: argparse.ArgumentParser, multi_backend: bool = False) -> None:
    if multi_backend:
        parser.add_argument("--backends", default=None,
                            help="comma-separated attention backends to run in turn (default: triton on CUDA, "
                                 "torch on CPU)")
    else:
        parser.add_argument("--backend", default=None, help="attention backend (default: triton on CUDA, torch on CPU)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--max-num-seqs", type=int, default=512, help="engine max_num_seqs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="engine max_num_batched_tokens, the step's token budget (default: the engine's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (ranks) the model is sharded over")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="Config.kv_cache_dtype (fp8: e4m3, twice the blocks)")
    parser.add_argument("--kv-cache-rotation", default=True, action=argparse.BooleanOptionalAction,
                        help="Config.kv_cache_rotation (an FP8 cache's Hadamard rotation of q and k)")
    parser.add_argument("--quantization", default=None, choices=["fp8", "fp8_weight_only"],
                        help="Config.quantization (fp8: linear weights kept in FP8, per-channel scales, W8A8 above "
                             "16 rows; fp8_weight_only: never W8A8)")
    parser.add_argument("--speculative-config", default=None, type=json_object, metavar="JSON",
                        help="Config.speculative_config, as `asyncllm serve` takes it (default: off), e.g. "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    parser.add_argument("--overlap", default="auto", choices=["auto", "on", "off", "both"],
                        help="Config.overlap_scheduling (auto: on with CUDA; both: off and on, where the benchmark "
                             "compares them)")


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    args.shape = args.shape or ("0.6b" if args.device == "cuda" else "tiny")
    if hasattr(args, "backends"):
        args.backends = args.backends.split(",") if args.backends else [default_backend(args.device)]
    if hasattr(args, "backend"):
        args.backend = args.backend or default_backend(args.device)
    try:  # Config's own check, here so that a bad key fails before any checkpoint is built
        parse_speculative_config(getattr(args, "speculative_config", None), FieldChecks(None))
    except ValueError as e:
        parser.error(f"argument --speculative-config: {e}")
    return args


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the options `names` and their values (for a child run that sets them itself)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            kept.append(arg)
    return kept


def engine_kwargs(args, backend: str) -> dict:
    kwargs = dict(attention_backend=backend, enforce_eager=args.enforce_eager, device=args.device,
                  max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size,
                  kv_cache_dtype=args.kv_cache_dtype, kv_cache_rotation=args.kv_cache_rotation,
                  quantization=args.quantization, speculative_config=args.speculative_config)
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    target = getattr(args, "target_step_ms", "default")
    if isinstance(target, str) and target != "default" and "," not in target:
        kwargs["target_step_ms"] = None if target == "none" else float(target)
    if getattr(args, "overlap", "auto") in ("on", "off"):
        kwargs["overlap_scheduling"] = args.overlap == "on"
    return kwargs


# ---- workloads ------------------------------------------------------------------------------------------
def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randint(0, 10000) for _ in range(length)]


def bench_requests(num: int = 256, seed: int = 0, max_input: int = 1024,
                   max_output: int = 1024) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py workload, draw for draw: random token ids in [0, 10000], prompt lengths
    uniform in [100, max_input], then max_tokens uniform in [100, max_output], EOS ignored.
    (A max below 100, for quick CPU runs, lowers that bound too.)"""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(min(100, max_input), max_input)) for _ in range(num)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=rng.randint(min(100, max_output), max_output)) for _ in range(num)]
    return prompts, params


# sampling features a benchmark's requests can turn on ("+"-joined): json holds every request to a
# schema whose first field is a string of at least 20,000 characters, so that on random weights
# each still runs to its max_tokens and every step fills a dense mask
FEATURES = {"plain": {}, "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
            "logprobs": dict(logprobs=5),
            "json": dict(structured_output=StructuredOutput(json={
                "type": "object", "properties": {"text": {"type": "string", "minLength": 20000}, "id": {"type": "integer"}},
                "required": ["text", "id"]}))}


def with_features(params: list[SamplingParams], features: str) -> list[SamplingParams]:
    """params with the '+'-joined features of FEATURES turned on (bench_throughput, bench_profile)."""
    changes = {}
    for name in features.split("+"):
        if name not in FEATURES:
            raise SystemExit(f"--features: unknown {name!r}; choose '+'-joined names of {sorted(FEATURES)}")
        changes.update(FEATURES[name])
    return [dataclasses.replace(p, **changes) for p in params] if changes else params


def warmup_requests(num: int = 64, max_input: int = 1024, seed: int = 1) -> tuple[list, list[SamplingParams]]:
    """Short requests of assorted prompt lengths and batch sizes (1..16 tokens each), run before the timed
    part so that Triton's JIT compiles (one per new kernel specialization) are not timed."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(min(100, max_input), max_input)) for _ in range(num)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1 + i % 16) for i in range(num)]
    return prompts, params


# ---- streams and the server ------------------------------------------------------------------------------
async def stream_timings(engine, prompt, params: SamplingParams, count: str = "tokens") -> dict:
    """One request through engine.stream, timed as its consumer sees it. An item counts when it
    has new token ids (count="tokens"), or new text (count="text": what the server sends as an SSE
    chunk). TTFT = submission to the first such item, ITL = every gap between them, TPOT = (E2E -
    TTFT) / (tokens - 1). Also the answer's token ids and the prompt tokens the prefix cache served."""
    if count not in ("tokens", "text"):
        raise ValueError(f"count: expected 'tokens' or 'text', got {count!r}")
    clock = ChunkClock()
    stream = engine.stream(prompt, params)
    async for out in stream:
        if out.token_ids if count == "tokens" else out.text:
            clock.tick()
    token_ids = list(stream.token_ids)
    metrics = stream.metrics
    return dict(clock.result(len(token_ids)), token_ids=token_ids, prompt_tokens=len(prompt),
                cached_tokens=metrics.num_cached_tokens if metrics else None)


def serve_options(kwargs: dict) -> list[str]:
    """Engine keyword options (Config fields, as engine_kwargs makes them) as `asyncllm serve` flags:
    dashed names, bools as --name / --no-name, target_step_ms None as 0 (the server's throughput first)."""
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif name == "target_step_ms" and value is None:
            flags += [flag, "0"]
        elif value is not None:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def child_env(**extra: str) -> dict:
    """The environment for a benchmark's child process: this checkout's package first on its path
    (a server started as `asyncllm serve` imports it too), unbuffered output, and `extra`."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=REPO_ROOT + (os.pathsep + path if path else ""), PYTHONUNBUFFERED="1",
                **extra)


# ---- timing ------------------------------------------------------------------------------------------------
def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable, device: str):
    """(fn(), seconds), with the device drained before both clock reads."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


class HostWaits:
    """Seconds the engine thread sits blocked on the device's results (LaunchedStep._on_host), summed
    while in use: near 0 means the device finished each step before the host asked for it (the
    host is the bottleneck), near the wall time the device is."""

    def __init__(self):
        self.seconds = 0.0
        self._on_host = None

    def __enter__(self) -> "HostWaits":
        on_host = self._on_host = LaunchedStep._on_host

        def timed_on_host(step):
            t = time.perf_counter()
            on_host(step)
            self.seconds += time.perf_counter() - t
        LaunchedStep._on_host = timed_on_host
        return self

    def __exit__(self, *exc) -> None:
        LaunchedStep._on_host = self._on_host


def host_report(before: dict, after: dict, elapsed: float, waits: HostWaits, loop_cpu_s: float | None = None) -> dict:
    """The run's device against host figures, from engine stats taken before and after it: device busy
    (the steps' device time over the wall time), the engine thread's waits for the device, and the
    event loop thread's CPU time (stream / generate)."""
    busy = after["steps_total_s"] - before["steps_total_s"]
    return dict(device_busy=busy / elapsed if elapsed else None, host_waits_s=waits.seconds, loop_cpu_s=loop_cpu_s)


def speculation_report(before: dict, after: dict) -> dict:
    """A run's speculative decoding, from engine stats taken before and after it ({} with it off): draft
    tokens proposed and accepted, the acceptance rate, tokens a verifying row took per step, and the
    share of decoding rows' steps that verified drafts (adaptivity and the batch rule left the rest plain)."""
    if "spec_draft_tokens" not in after:
        return {}
    proposed, accepted, verifications, decode_steps = (after[f"spec_{key}"] - before[f"spec_{key}"] for key in (
        "draft_tokens", "accepted_tokens", "verifications", "decode_steps"))
    return dict(spec_proposed=proposed, spec_accepted=accepted,
                acceptance_rate=accepted / proposed if proposed else 0.0,
                mean_accepted_length=1 + accepted / verifications if verifications else None,
                speculating_share=verifications / decode_steps if decode_steps else 0.0)


def jit_compiled_since(before: dict[str, int]) -> str:
    """The JIT compiles a timed run paid for since `before` (a compiled_variants() snapshot), e.g. "0"
    or "1 _prefill_kernel". Each costs ~1 s of host time on a GPU: the warm-up should meet them all."""
    from asyncllm.kernels import compiled_variants
    grown = {name: count - before.get(name, 0) for name, count in compiled_variants().items()
             if count > before.get(name, 0)}
    return " ".join(f"{n} {name}" for name, n in grown.items()) or "0"


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def add_ratios(rows: list[dict], name: str, value: str, baseline: dict, same: tuple[str, ...]) -> None:
    """row[name] = row[value] / the value of the first row that is `baseline` (key -> value) and agrees
    with row on every key of `same` (e.g. each mode's throughput over sync's of the same backend)."""
    for row in rows:
        base = next((r for r in rows if r.get(value) and all(r.get(k) == v for k, v in baseline.items())
                     and all(r.get(k) == row.get(k) for k in same)), None)
        if base and row.get(value):
            row[name] = row[value] / base[value]


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def measure_copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Achievable memory bandwidth in bytes/s: a large device-to-device copy, bytes read + written,
    median of `iters` timed copies after a warm-up (CUDA events on the GPU, perf_counter on the CPU)."""
    if device != "cuda":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(timed(lambda: dst.copy_(src), device)[1])
    src = dst = None  # noqa: F841 - freed before release_memory
    release_memory()
    return 2 * nbytes / median(times)


# ---- output ----------------------------------------------------------------------------------------------------
def format_value(value, fmt: str = "{:.2f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return fmt.format(value)
    return str(value)


def format_table(rows: list[dict], columns: list[tuple]) -> str:
    """A markdown table. columns: (header, key) or (header, key, format string) tuples."""
    header = "| " + " | ".join(c[0] for c in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [header, rule]
    for row in rows:
        cells = [format_value(row.get(c[1]), *c[2:]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment(device: str) -> dict:
    import transformers
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": device}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


class Report:
    """The JSON a benchmark writes: environment, arguments, result rows. Rewritten after every row,
    so a run killed by a timeout still leaves what it finished."""

    def __init__(self, bench: str, args: argparse.Namespace):
        self.path = args.json
        self.data = {"bench": bench, "env": environment(args.device), "args": vars(args), "results": []}

    def add(self, row: dict) -> None:
        self.data["results"].append(row)
        self.write()

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.write()

    def write(self) -> None:
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2, default=str)
        os.replace(tmp, self.path)

    def finish(self, title: str, columns: list[tuple], rows: list[dict] | None = None) -> str:
        """Print the result rows as a table under `title`, and keep the table in the JSON too."""
        table = f"### {title}\n\n" + format_table(self.data["results"] if rows is None else rows, columns)
        print("\n" + table)
        self.set("table", table)
        return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Build a random-weight Qwen3 checkpoint for the benchmarks.")
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out", required=True, help="directory (reused if it already holds a checkpoint)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = make_checkpoint(args.shape, args.out, device=args.device)
    print(f"{args.shape} checkpoint in {path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
