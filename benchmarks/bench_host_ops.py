"""The host's cost of the calls a batch-1 step is made of: tensor objects, small copies, events, uploads.

    python benchmarks/bench_host_ops.py [--device cuda] [--calls 2000]

Each call runs in a hot loop (--calls times, best of three medians, us). At batch 1 the device step of a
small model is shorter than the host's work around it, and that work is a few dozen such calls: this
table says which to make fewer of. In place, in a real step, each costs more than here (colder caches):
`bench_step_phases.py --detail` times the step's parts where they run. On CPU only the calls that have
a CPU form run (no pinned memory, events or graphs).

The last rows time the runner's per-step sampling work over its request table (issue 49) at 1, 64
and 256 rows: SamplingInputs.plan (the step's sampling arrays gathered from the table) and the
table's launched + recorded (tokens in flight, results appended), for plain rows (temperature
only) and a mix (greedy and sampled rows, top-k, seeds, presence penalties, logprobs).
"""
from __future__ import annotations

import time

import numpy as np
import torch
from common import Report, make_parser, median, parse_args, synchronize

from asyncllm.engine.sequence import Sequence
from asyncllm.engine.step_planner import request_sampling
from asyncllm.runner.host_upload import upload_arrays
from asyncllm.runner.sampling_inputs import SamplingInputs
from asyncllm.sampling_params import SamplingParams
from asyncllm.step_plan import StepPlan

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


def _params(kind: str, i: int) -> SamplingParams:
    if kind == "plain":
        return SamplingParams(temperature=0.7, max_tokens=100)
    return SamplingParams(temperature=0.7 if i % 2 else 0.0, max_tokens=100, top_k=20 if i % 3 == 0 else -1,
                          seed=i if i % 4 == 0 else None, presence_penalty=0.5 if i % 5 == 0 else 0.0,
                          logprobs=2 if i % 7 == 0 else None)


def sampling_plan_ops(device: torch.device, vocab_size: int = 151936) -> list[tuple[str, object]]:
    """(name, call): a step's sampling plan and the table's bookkeeping, at 1, 64 and 256 rows."""
    ops = []
    for num_rows in (1, 64, 256):
        for kind in ("plain", "mixed"):
            seqs = [Sequence(f"r{i}", list(range(1, 200)), _params(kind, i), 16) for i in range(num_rows)]
            inputs = SamplingInputs(vocab_size, device)
            plan = StepPlan([], [], [], [], [], [], [seq.uid for seq in seqs])
            for seq in seqs:
                inputs.table.add(request_sampling(seq))
            out, tokens = inputs.plan(plan), [5] * num_rows

            def bookkeeping(inputs=inputs, plan=plan, out=out, tokens=tokens):
                launched = inputs.table.launched(plan, out.rows, out.flags, out.any_flags)
                inputs.table.recorded(launched, plan, tokens, None)
            ops += [(f"SamplingInputs.plan, {num_rows} {kind} rows", lambda inputs=inputs, plan=plan: inputs.plan(plan)),
                    (f"request table launched + recorded, {num_rows} {kind} rows", bookkeeping)]
    return ops


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parse_args(parser, argv)
    report = Report("host_ops", args)
    for name, fn in host_ops(torch.device(args.device)) + sampling_plan_ops(torch.device(args.device)):
        report.add({"call": name, "us": time_call(fn, args.calls, args.device)})
    report.finish(f"Host cost per call, {args.device} (hot loop)", [("call", "call"), ("us", "us", "{:.2f}")])
    return report.data


if __name__ == "__main__":
    main()
