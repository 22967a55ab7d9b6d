"""An engine's lifecycle in one process (issue 50): the device memory close() returns, and sleep() /
wake() against a fresh start.

    python benchmarks/bench_lifecycle.py [--shape 0.6b] [--model-dir DIR] [--levels 1,2] [--json PATH]

In one process, with LLM (the engine's own work, no event loop): a first engine started (cold: the
process's first, which compiles kernels and decides the skinny GEMM and decode tunings) and
closed; then a second (warm: what a fresh start costs once the process has started one), whose
greedy tokens are the reference; for each sleep level, sleep(), wake() and the same greedy request
again; then close(). Memory is torch.cuda.memory_allocated (tensors) and memory_reserved (the
caching allocator's hold), each plus the stable (VMM) memory that holds the weights and KV cache
where the driver allows (runner/stable_memory.py: torch's statistics leave it out), before the
first engine, with each engine, asleep, awake and after each close; on CPU the memory columns are
empty. `sleep_path` says whether wake kept the CUDA graphs (stable memory) or re-captured them.

Targets (issue 50): after close() allocated memory within 64 MiB of before the engine
(`closed_delta_mib`); wake() at least 3x faster than a fresh start (`wake_speedup`, over the warm
start; also over the cold one). Asleep, allocated memory drops by the KV cache and, at both levels,
the weights (level 1 keeps them in pinned host memory, level 2 reads the checkpoint again).
"""
from __future__ import annotations

import time

import torch
from common import Report, add_engine_args, checkpoint_from_args, engine_kwargs, make_parser, parse_args, release_memory

from asyncllm import LLM, SamplingParams
from asyncllm.runner.stable_memory import mapped_bytes

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def memory_mib(device: str) -> tuple[float | None, float | None]:
    """(allocated, reserved) MiB on the device; None on CPU."""
    if device != "cuda":
        return None, None
    torch.cuda.synchronize()
    stable = mapped_bytes()
    return (torch.cuda.memory_allocated() + stable) / 2**20, (torch.cuda.memory_reserved() + stable) / 2**20


def tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"]


def start(model: str, kwargs: dict) -> tuple[LLM, float]:
    begin = time.perf_counter()
    llm = LLM(model, **kwargs)
    return llm, time.perf_counter() - begin


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--levels", default="1,2", help="comma-separated sleep levels to time in turn")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parse_args(parser, argv)
    report = Report("lifecycle", args)
    kwargs = engine_kwargs(args, args.backend)
    if args.device == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        kwargs.update(num_kvcache_blocks=64, kvcache_block_size=16)
    levels = [int(level) for level in args.levels.split(",")]
    with checkpoint_from_args(args) as model:
        release_memory()
        before, before_reserved = memory_mib(args.device)
        llm, cold_s = start(model, kwargs)
        tokens(llm)
        llm.close()
        del llm
        first_closed, _ = memory_mib(args.device)
        llm, warm_s = start(model, kwargs)
        phases = llm.startup_timings
        reference = tokens(llm)
        started, started_reserved = memory_mib(args.device)
        report.add(dict(step="fresh start", seconds=warm_s, cold_seconds=cold_s, allocated_mib=started,
                        reserved_mib=started_reserved, first_closed_delta_mib=None if before is None
                        else first_closed - before, startup_timings=phases,
                        sleep_path=llm.core.runner.sleep_path))
        for level in levels:
            begin = time.perf_counter()
            llm.sleep(level)
            sleep_s = time.perf_counter() - begin
            asleep, asleep_reserved = memory_mib(args.device)
            begin = time.perf_counter()
            llm.wake()
            wake_s = time.perf_counter() - begin
            awake, _ = memory_mib(args.device)
            report.add(dict(step=f"sleep({level}) + wake()", sleep_seconds=sleep_s, seconds=wake_s,
                            wake_speedup=warm_s / wake_s, cold_speedup=cold_s / wake_s, asleep_mib=asleep,
                            asleep_reserved_mib=asleep_reserved,
                            freed_mib=None if asleep is None else started - asleep, allocated_mib=awake,
                            same_tokens=tokens(llm) == reference))
        llm.close()
        del llm
        closed, closed_reserved = memory_mib(args.device)
        report.add(dict(step="close()", allocated_mib=closed, reserved_mib=closed_reserved,
                        closed_delta_mib=None if before is None else closed - before,
                        before_mib=before, before_reserved_mib=before_reserved))
    report.finish(f"Engine lifecycle, {args.shape} on {args.device}",
                  [("step", "step"), ("s", "seconds", "{:.3f}"), ("sleep s", "sleep_seconds", "{:.3f}"),
                   ("wake speed-up (warm start)", "wake_speedup", "{:.1f}"),
                   ("(cold start)", "cold_speedup", "{:.1f}"), ("allocated MiB", "allocated_mib", "{:.0f}"),
                   ("asleep MiB", "asleep_mib", "{:.0f}"), ("freed MiB", "freed_mib", "{:.0f}"),
                   ("after close - before, MiB", "closed_delta_mib", "{:.1f}"), ("same tokens", "same_tokens"), ("sleep path", "sleep_path")])
    return report.data


if __name__ == "__main__":
    main()
