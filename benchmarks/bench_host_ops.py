"""The host's cost of the calls a batch-1 step is made of: tensor objects, small copies, events, uploads.

    python benchmarks/bench_host_ops.py [--device cuda] [--calls 2000]

Each call runs in a hot loop (--calls times, best of three medians, us). At batch 1 the device step of a
small model is shorter than the host's work around it, and that work is a few dozen such calls: this
table says which to make fewer of. In place, in a real step, each costs more than here (colder caches):
`bench_step_phases.py --detail` times the step's parts where they run. On CPU only the calls that have
a CPU form run (no pinned memory, events or graphs).
"""
from __future__ import annotations

import time

import numpy as np
import torch
from common import Report, make_parser, median, parse_args, synchronize

from asyncllm.runner.host_upload import upload_arrays

# a batch-1 decode step's arrays, as the runner uploads them: its inputs, then temperature and noise key
STEP_ARRAYS = [np.array([5], np.int64), np.array([200], np.int64), np.array([1234], np.int64),
               np.array([0], np.int64), np.array([0, 1], np.int32), np.array([201], np.int32),
               np.arange(2, dtype=np.int32).reshape(1, 2), np.array([0.6], np.float32), np.array([12345], np.int64)]


def time_call(fn, calls: int, device: str) -> float:
    """us per call: the best of three medians of `calls` timed calls, after a warm-up."""
    for _ in range(50):
        fn()
    synchronize(device)
    medians = []
    for _ in range(3):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        medians.append(median(times) * 1e6)
        synchronize(device)
    return min(medians)


def host_ops(device: torch.device) -> list[tuple[str, object]]:
    """(name, call) of every call that this device has."""
    cuda = device.type == "cuda"
    small, source = torch.zeros(8, dtype=torch.int64, device=device), torch.ones(8, dtype=torch.int64, device=device)
    ops = [("dev[:1].copy_(src[:1]): two views and a copy", lambda: small[:1].copy_(source[:1], non_blocking=True)),
           ("dev.copy_(src): whole tensors, no view made", lambda: small.copy_(source, non_blocking=True)),
           ("a view: dev[:1]", lambda: small[:1]),
           (f"upload_arrays of a batch-1 step's {len(STEP_ARRAYS)} arrays", lambda: upload_arrays(STEP_ARRAYS, device)),
           ("np.array of 5 ints", lambda: np.array([1, 2, 3, 4, 5], dtype=np.int64))]
    if not cuda:
        return ops
    pinned = torch.empty(64, dtype=torch.int64, pin_memory=True)
    stream = torch.cuda.current_stream(device)
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(16, device=device)
    with torch.cuda.graph(graph):
        x.add_(1)
    return ops + [
        ("torch.empty(64 bytes, pin_memory=True)", lambda: torch.empty(64, dtype=torch.uint8, pin_memory=True)),
        ("pinned[:8].to(device, non_blocking=True)", lambda: pinned[:8].to(device, non_blocking=True)),
        ("a copy to the host: pinned empty + copy_", lambda: torch.empty(
            (1,), dtype=torch.int64, pin_memory=True).copy_(source[:1], non_blocking=True)),
        ("Event(enable_timing=True).record()", lambda: torch.cuda.Event(enable_timing=True).record()),
        ("Event(enable_timing=True).record(stream)", lambda: torch.cuda.Event(enable_timing=True).record(stream)),
        ("event.record(stream), an event made before", lambda: event.record(stream)),
        ("event.query(), completed", lambda: event.query()),
        ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream()),
        ("a one-kernel graph's replay()", lambda: graph.replay()),
    ]


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parse_args(parser, argv)
    report = Report("host_ops", args)
    for name, fn in host_ops(torch.device(args.device)):
        report.add({"call": name, "us": time_call(fn, args.calls, args.device)})
    report.finish(f"Host cost per call, {args.device} (hot loop)", [("call", "call"), ("us", "us", "{:.2f}")])
    return report.data


if __name__ == "__main__":
    main()
