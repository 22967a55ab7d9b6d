"""F.linear for decode's few rows, through the skinny-GEMM kernel on the shapes where it beats cuBLAS.

Which one is faster depends on the shape, the row count and the GPU, so it is measured: the first
eager call of each (device, dtype, rows bucket, N, K, bias) times cuBLAS and the kernel's candidate
tilings on that call's own tensors (cold L2, CUDA events, each call between two small PDL
kernels as in a decode step) and keeps the fastest for good; where PDL is on, a tie within
MIN_GAIN goes to the kernel, which keeps the step's chain of early launches that cuBLAS breaks
(_neighbour_kernel says why timing alone cannot see that).
That first call is the CUDA-graph warm-up's (an eager run before each capture), so the timing
never runs inside a capture and replays pay nothing; a shape first seen while capturing keeps cuBLAS.
Each timing's answer is looked up in the start-up cache first, and stored there (startup_cache.py:
the same shape and candidates, on the same GPU, versions and code), so a later start-up skips it.

silu_mul_linear is the MLP's down projection of silu(gate) * up. Where linear() takes the kernel
for that (rows, N, K) (decided on the unfused input, as linear() decides it), the kernel's gated
form, which computes silu(gate) * up as it loads x, saves silu_and_mul's launch and its round trip
through memory. It adds work too: every program recomputes the gate of its K range (BLOCK_M /
BLOCK_N evaluations per weight element, the dot loop's x padded to 16 rows), which outweighs the
saving at more rows and at larger shapes (the dot loop). So the gated form is timed too, once per
shape, against the unfused pair (silu_and_mul, then linear()'s choice), and taken where it is
faster, or within MIN_GAIN where PDL is on (one kernel fewer in the chain): 1-2 rows in practice.

On by default: decode at small batch streams the weights, and the kernel reads them faster than
cuBLAS's kernels for these shapes do (docs/DECISIONS.md keeps the figures).
ASYNCLLM_SKINNY_GEMM=0 in the environment turns it off (cuBLAS everywhere).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from asyncllm import settings
from asyncllm.layers.activation import SiluAndMul
from asyncllm.layers import device_wide
from asyncllm.layers.device_wide import capturing
from asyncllm.layers.fused import kernel_module
from asyncllm.layers.parallel_compiles import in_dry_run, note_put_off
from asyncllm.startup_cache import StartupDecisions

logger = logging.getLogger("asyncllm")

KERNEL_DEVICE_TYPES = ("cuda",)  # the tests add "cpu" to run the kernel through Triton's interpreter
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
MAX_CANDIDATES = 3  # tilings timed per shape: each is a compile at first start-up
TIMING_REPS = 25
GRAPH_REPEATS = 8  # timed calls per graph replay, each after its own L2 flush
NEIGHBOUR_COLUMNS = 4096  # the row of the small kernel each timed call sits between (_neighbour_kernel)

MIN_GAIN = 0.03  # timings within this fraction are a tie (choose_fastest says which form wins one)

# read once, into a global: every linear call of 1-16 rows asks it, and set_enabled switches it
_enabled = settings.SKINNY_GEMM.read()
_UNDECIDED = object()
# (device, dtype, rows rounded up to a power of two, N, K, has bias) -> the kernel's SkinnyConfig, or None for cuBLAS
_choices: dict[tuple, object] = {}
# the same keys, for silu_mul_linear where _choices has the kernel -> the gated form's SkinnyConfig, or None for
# the unfused pair
_gated_choices: dict[tuple, object] = {}
# (gated, key) of the decisions runner/decode_tuning.py settled inside the batch-1 decode step
_settled: set[tuple[bool, tuple]] = set()
_silu_and_mul = SiluAndMul()  # the unfused gate: the fused kernel on CUDA, PyTorch's on CPU
# the start-up cache a timing's answer is looked up in first and stored to (use_decisions)
_decisions = StartupDecisions(None)


def set_enabled(enabled: bool) -> None:
    """Switch the kernel on or off for this process (ASYNCLLM_SKINNY_GEMM sets the default)."""
    global _enabled
    _enabled = enabled


def is_enabled() -> bool:
    return _enabled


def choices() -> dict[tuple, object]:
    """The per-shape decisions made so far."""
    return dict(_choices)


def gated_choices() -> dict[tuple, object]:
    """silu_mul_linear's decisions made so far (None: the unfused pair)."""
    return dict(_gated_choices)


def describe_choices() -> dict[str, str]:
    """The decisions made so far, readably: "4 rows x (N, K)[ + bias]" -> the tiling, or cuBLAS;
    "4 rows x (N, K) gated" -> silu_mul_linear's gated tiling, or unfused."""
    described = {}
    for suffix, decisions, other in (("", _choices, "cuBLAS"), (" gated", _gated_choices, "unfused")):
        for (_, _, rows, n, k, has_bias), config in sorted(decisions.items(), key=lambda item: item[0][2:]):
            label = f"{rows} rows x ({n}, {k}){' + bias' if has_bias else ''}{suffix}"
            described[label] = other if config is None else config.label()
    return described


def pin_choices(described: dict[str, str], device: torch.device, dtype: torch.dtype) -> int:
    """Take describe_choices()'s decisions (e.g. another run's, from a benchmark's JSON) for x on
    device in dtype, settled: nothing times them again and decode tuning leaves them. Returns how
    many; a label that is not describe_choices()' form is a ValueError naming it."""
    kernels = kernel_module("skinny_gemm")
    for label, choice in described.items():
        shape, gated = (label[:-len(" gated")], True) if label.endswith(" gated") else (label, False)
        shape, has_bias = (shape[:-len(" + bias")], True) if shape.endswith(" + bias") else (shape, False)
        rows, _, dims = shape.partition(" rows x ")
        try:
            n, k = (int(part) for part in dims.strip("()").split(", "))
            key = (device, dtype, int(rows), n, k, has_bias)
            config = None if choice in ("cuBLAS", "unfused") else kernels.SkinnyConfig.from_label(choice)
        except ValueError as exc:
            raise ValueError(f"skinny GEMM choice {label!r}: {choice!r}: {exc}") from None
        set_choice(gated, key, config)
        settle(gated, key)
    return len(described)


def batch1_alternatives() -> list[tuple[bool, tuple, list]]:
    """The one-row decisions that took the kernel and were not settled yet (settle()), as (gated,
    key, tilings) to try inside the batch-1 decode step (runner/decode_tuning.py), largest weight
    first: the decision, then its grouped FMA form, the other candidates timed for that shape, the
    grouped form of the rule's first and a grouped tile 4x deeper and 4x narrower than the
    decision. A key whose gated form is in use is tuned as that (its plain entry is not what the
    step runs)."""
    kernels = kernel_module("skinny_gemm")
    alternatives = []
    for gated, decisions in ((True, _gated_choices), (False, _choices)):
        for key, config in decisions.items():
            if key[2] != 1 or config is None or (not gated and _gated_choices.get(key) is not None) \
                    or (gated, key) in _settled:
                continue
            candidates = kernels.candidate_configs(1, key[3], key[4], num_sms(key[0]))[:MAX_CANDIDATES]
            tilings = [config, replace(config, grouped=True)] + candidates + [replace(candidates[0], grouped=True)]
            if not config.dot and config.block_n >= 8 and config.block_k * 4 <= key[4]:
                # grouped, a thread's registers allow a 4x deeper, 4x narrower tile (the 8B's qkv took one)
                tilings.append(replace(config, block_n=config.block_n // 4, block_k=config.block_k * 4, grouped=True))
            unique = [tiling for tiling in dict.fromkeys(tilings) if not (tiling.grouped and tiling.dot)]
            alternatives.append((gated, key, unique))
    return sorted(alternatives, key=lambda item: -item[1][3] * item[1][4])


def use_decisions(decisions: StartupDecisions) -> None:
    """Look timings' answers up in this start-up cache from now on, and store new ones there (the
    runner's, at its start-up; the decisions themselves stay the process's, as before)."""
    global _decisions
    _decisions = decisions


def startup_decisions() -> StartupDecisions:
    """The start-up cache use_decisions gave (layers/fp8_linear.py keeps its route choices there too)."""
    return _decisions


def set_choice(gated: bool, key: tuple, config) -> None:
    """Replace a decision (batch1_alternatives' key) for the calls and graph captures that follow."""
    (_gated_choices if gated else _choices)[key] = config


def settle(gated: bool, key: tuple) -> None:
    """A decision tuned for good: later engines of this process keep it (as they keep every
    decision), so that two engines of one process compute alike."""
    _settled.add((gated, key))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); x with 1..16 rows on CUDA may take the skinny kernel."""
    kernels, config = _kernel_choice(x, weight, bias, gated=False)
    if config is not None:
        return kernels.skinny_gemm(x, weight, bias, config)
    return F.linear(x, weight, bias)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight, bias) for x (..., 2K) = [gate | up] and weight (N, K), with
    SiluAndMul's numbers; in one kernel where linear() takes the skinny kernel for the product and
    the gated form was timed faster than the pair."""
    kernels, config = _kernel_choice(x, weight, bias, gated=True)
    if config is not None:
        return kernels.skinny_gemm(x, weight, bias, config, gated=True)
    return linear(_silu_and_mul(x), weight, bias)


def kernel_enabled_for(x: torch.Tensor) -> bool:
    """x's device and dtype are the kernel's, and the kernel is on (layers/fp8_linear.py asks too)."""
    return _enabled and x.device.type in KERNEL_DEVICE_TYPES and x.dtype in KERNEL_DTYPES


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The unfused gate, as silu_mul_linear computes it where the gated kernel is not taken."""
    return _silu_and_mul(x)


def _kernel_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool):
    """(the kernels module, the SkinnyConfig for x's rows x weight's (N, K)), or (None, None) for
    F.linear. gated: x is [gate | up], and the config is the gated form's (None: the unfused pair)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows and kernel_enabled_for(x) and weight.dtype == x.dtype and weight.stride(-1) == 1:
        kernels = kernel_module("skinny_gemm")
        if kernels is not None and rows <= kernels.MAX_ROWS:
            key = (x.device, x.dtype, 1 << (rows - 1).bit_length(), weight.shape[0], weight.shape[1], bias is not None)
            config = _choices.get(key, _UNDECIDED)
            if gated and config is not None:
                config = _gated_choices.get(key, _UNDECIDED)
            if config is _UNDECIDED:
                if x.is_cuda and torch.cuda.is_current_stream_capturing():
                    return None, None  # no timing inside a capture; not remembered, so an eager call still decides
                if in_dry_run():  # nor in a dry run, whose kernels may not run: the real run decides
                    note_put_off()
                    return None, None
                config = _decide(key, kernels, x, weight, bias, gated)
            return kernels, config
    return None, None


def _decide(key: tuple, kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool):
    """Decides key for linear() and, where gated (x = [gate | up]), then for silu_mul_linear: the
    product's own decision first, on the unfused input, and the gated form only where that is the kernel."""
    n, k = weight.shape
    rows = x.numel() // x.shape[-1]
    candidates = kernels.candidate_configs(rows, n, k, num_sms(x.device))[:MAX_CANDIDATES]
    config = _choices.get(key, _UNDECIDED)
    if config is _UNDECIDED:
        config = _remembered(key, False, candidates, lambda: choose_fastest(
            kernels, _silu_and_mul(x) if gated else x, weight, bias, candidates)) if x.is_cuda else candidates[0]
        _choices[key] = config
        logger.debug("skinny GEMM for %d rows x (%d, %d)%s: %s", rows, n, k, " + bias" if bias is not None else "",
                     "cuBLAS" if config is None else config.label())
    if not gated or config is None:
        return config
    # the gated form of the product's own tiling first: the interpreter's runs (no timing) take that
    candidates = [config] + [candidate for candidate in candidates if candidate != config]
    gated_config = _remembered(key, True, candidates, lambda: choose_fastest(
        kernels, x, weight, bias, candidates, gated=True)) if x.is_cuda else config
    _gated_choices[key] = gated_config
    logger.debug("skinny GEMM for %d rows x (%d, %d)%s, gated: %s", rows, n, k, " + bias" if bias is not None else "",
                 "unfused" if gated_config is None else gated_config.label())
    return gated_config


def _remembered(key: tuple, gated: bool, candidates: list, measure):
    """measure()'s choice among candidates (None: cuBLAS, or where gated the unfused pair), or the
    start-up cache's answer to the same question (this shape, these candidates): an index into them."""
    _, dtype, rows, n, k, has_bias = key
    question = {"shape": [str(dtype), rows, n, k, has_bias], "gated": gated,
                "candidates": [asdict(candidate) for candidate in candidates]}

    def measured_index():
        choice = measure()
        return None if choice is None else candidates.index(choice)
    index = _decisions.remembered("skinny GEMM", question, measured_index,
                                  valid=lambda i: i is None or type(i) is int and 0 <= i < len(candidates))
    return None if index is None else candidates[index]


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter's runs: any count does
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_fastest(kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   candidates: list, gated: bool = False) -> object:
    """The fastest of cuBLAS (None) and the kernel's candidate configs on these tensors; a tie within
    MIN_GAIN goes to the kernel where PDL is on, else to cuBLAS (or the unfused pair, against the
    gated form). A candidate that fails to compile or run here (a tile past this GPU's
    shared memory, no bf16 MMA) is left out, with a warning: cuBLAS is always there to fall back
    on. gated: x is [gate | up], the candidates run the kernel's gated form, and None is the
    unfused pair (silu_and_mul, then linear(), whose decision for the product is made)."""
    usable, calls = [], []
    gated_args = dict(gated=True) if gated else {}
    for config in candidates:
        call = lambda config=config: kernels.skinny_gemm(x, weight, bias, config, **gated_args)  # noqa: E731
        try:
            call()  # the compile
        except Exception as exc:  # noqa: BLE001 - any failure only drops this tiling
            logger.warning("skinny GEMM tiling %s for (%d, %d) left out: %s: %s", config.label(), weight.shape[0],
                           weight.shape[1], type(exc).__name__, str(exc)[:200])
            continue
        usable.append(config)
        calls.append(call)
    if not usable:
        return None
    baseline = (lambda: linear(_silu_and_mul(x), weight, bias)) if gated else (lambda: F.linear(x, weight, bias))
    neighbour = _neighbour_kernel(x)
    times = time_calls([baseline] + calls, x.device, neighbour=neighbour)
    logger.debug("skinny GEMM timings for %d rows x (%d, %d)%s: %s", x.numel() // x.shape[-1], weight.shape[0],
                 weight.shape[1], " gated" if gated else "",
                 ", ".join(f"{label} {ms * 1e3:.1f} us" for label, ms in
                           zip(["unfused" if gated else "cuBLAS"] + [c.label() for c in usable], times)))
    best = min(range(1, len(times)), key=times.__getitem__)
    # a tie within noise goes to our kernel where PDL is on: against cuBLAS it keeps the decode
    # step's chain of early launches (_neighbour_kernel), and the gated form takes the SiLU kernel
    # out of that chain
    bar = 1 + MIN_GAIN if neighbour is not None else 1 - MIN_GAIN
    return usable[best - 1] if times[best] < bar * times[0] else None


def _neighbour_kernel(x: torch.Tensor):
    """The small kernel each timed call sits between, or None where PDL is off or off CUDA.

    In a decode step every projection follows a small kernel (a norm, the attention's reduce) and
    is followed by one (the q/k norm and rotary, a norm, the MLP's down projection). With PDL the
    skinny kernel's programs start and load their first weights while the kernel before it runs,
    and it lets the kernel after it launch early; cuBLAS's kernels wait for the one before to end
    and make the one after wait too. Timed alone, that difference is invisible, and between these
    stand-ins only partly: a projection where ours and cuBLAS time within MIN_GAIN of each other
    can still run the decode step measurably faster in ours, hence choose_fastest's tie rule too.
    An RMSNorm of a scratch row stands in for both neighbours."""
    fused, pdl = kernel_module("fused_ops"), kernel_module("pdl")
    if fused is None or not x.is_cuda or not pdl.enabled_for(x):
        return None
    rows = torch.randn(1, NEIGHBOUR_COLUMNS, device=x.device, dtype=x.dtype,
                       generator=torch.Generator(x.device).manual_seed(0))  # not the process's shared default
    norm_weight = torch.ones(NEIGHBOUR_COLUMNS, device=x.device, dtype=x.dtype)
    return lambda: fused.rms_norm(rows, norm_weight, 1e-6)


def time_calls(calls: list, device: torch.device, reps: int = TIMING_REPS, neighbour=None) -> list[float]:
    """Median device ms of each call, each run from a cold L2 (as decode meets its weights, the
    model being far larger than L2), the calls interleaved so that clock drift hits all alike.
    neighbour: a small kernel run before and after each call (_neighbour_kernel), its own time
    subtracted, so that what the call overlaps of its neighbours counts in its favour.

    Where a call can be captured it is timed in a CUDA graph (decode runs in graphs, and an eager
    few-microsecond kernel's timing holds the tens of microseconds of Triton's Python launch, which
    swing from call to call) of GRAPH_REPEATS (flush, neighbour, call, neighbour) runs, less a graph
    of the same without the call, so that the graph's own launch drops out as well. The flush reads
    a buffer of twice the L2's size, which leaves the L2 holding clean lines, as decode's earlier
    layers leave it: a flush that writes leaves dirty lines for the timed call to write back, a
    cost decode never pays."""
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    flush_buffer = torch.zeros(2 * l2_bytes // 4, dtype=torch.int32, device=device)
    around = neighbour if neighbour is not None else (lambda: None)

    def flush():
        torch.sum(flush_buffer)
        around()

    def framed(call):
        flush()
        call()
        around()

    for call in calls:  # compile and warm up
        call()
    graphs = [_capture(lambda call=call: framed(call), device, GRAPH_REPEATS) for call in calls]
    flushes = _capture(lambda: framed(lambda: None), device, GRAPH_REPEATS)
    if flushes is None:  # nothing to subtract: every call is timed eagerly
        graphs = [None] * len(calls)
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in range(len(calls) + 1)]
    for rep in range(reps):
        for call, graph, call_events in zip(calls + [lambda: None], graphs + [flushes], events):
            start, end = call_events[rep]
            if graph is None:  # timed eagerly, the flush outside the events
                flush()
                start.record()
                call()
            else:
                start.record()
                graph.replay()
            end.record()
    device_wide.synchronize(device)
    medians = [sorted(start.elapsed_time(end) for start, end in call_events)[reps // 2] for call_events in events]
    flush_ms = medians.pop()
    return [ms if graph is None else max(ms - flush_ms, 0.0) / GRAPH_REPEATS for ms, graph in zip(medians, graphs)]


def _capture(call, device: torch.device, repeats: int):
    """A CUDA graph of call run `repeats` times, or None where capture fails."""
    try:
        device_wide.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            for _ in range(repeats):
                call()
        graph.replay()
        return graph
    except Exception as exc:  # noqa: BLE001 - timing eagerly is still a measurement
        logger.warning("skinny GEMM timing: capture failed (%s: %s); timing eagerly", type(exc).__name__,
                       str(exc)[:200])
        return None
