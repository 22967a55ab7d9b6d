"""The GPU tests' engines and the CUDA graphs each captures, counted on the CPU (no GPU needed).

Most of the GPU suite's time is engine start-up: a memory probe, then a capture per decode graph
(per batch size, per context bound where the backend asks for one) and per mixed-step token size,
each after an eager warm-up. This lists, per test and per part of scripts/gpu_suite.sh, the engines
the test builds (with the options that decide the graphs) and the graphs they capture, from the
runner's own graph_batch_sizes / graph_token_sizes and the Triton backend's
decode_graph_context_bounds (at the H100's / H200's 132 SMs). The table of engines below mirrors
the tests' calls: change it with them.

    python scripts/gpu_test_plan.py            # per test, then per part
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # asyncllm.kernels imports on a machine without a GPU

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from asyncllm.config import Config  # noqa: E402
from asyncllm.runner.cuda_graph import graph_batch_sizes, graph_token_sizes  # noqa: E402
from asyncllm.speculative.draft_model import draft_graph_tokens  # noqa: E402
from asyncllm.engine.speculation import MAX_PAUSE_STEPS, MAX_SPECULATING_DECODES  # noqa: E402

NUM_SMS = 132  # H100 SXM and H200
NUM_KV_HEADS = 8  # tests/test_gpu.py's SHAPE (and the fp8 / MoE GPU models')
BACKENDS = ["torch", "triton", "fa4"]  # the GPU machine with FA4 staged
GRAPHED = [b for b in BACKENDS if b != "torch"]
CONFIG_DEFAULTS = {name: getattr(Config, name) for name in (
    "max_num_batched_tokens", "max_num_seqs", "max_model_len", "cuda_graph_max_tokens", "kvcache_block_size")}
CONFIG_DEFAULTS.update(enforce_eager=False, attention_backend="triton")  # "auto" is triton on CUDA


def _triton_bounds(batch_size: int, max_context: int) -> list[int]:
    backend = TritonAttentionBackend.__new__(TritonAttentionBackend)  # the bounds need no KV cache
    backend.num_kv_heads, backend.num_sms = NUM_KV_HEADS, NUM_SMS
    return backend.decode_graph_context_bounds(batch_size, max_context)


def graphs(options: dict) -> tuple[int, int]:
    """(decode graphs, mixed graphs) an engine of these options captures (ModelRunner._capture_graphs)."""
    o = {**CONFIG_DEFAULTS, **options}
    if o["enforce_eager"] or o["attention_backend"] == "torch":
        return 0, 0
    block = o["kvcache_block_size"]
    max_context = -(-o["max_model_len"] // block) * block
    sizes = graph_batch_sizes(min(o["max_num_seqs"], 512))
    if o["attention_backend"] == "triton":
        decode = sum(len(_triton_bounds(size, max_context)) for size in sizes)
        mixed = len(graph_token_sizes(min(o["cuda_graph_max_tokens"], o["max_num_batched_tokens"])))
    else:  # FlashAttention: decode graphs, one context bound
        decode, mixed = len(sizes), 0
    draft = o.get("speculative_config") or {}
    if "model" in draft:  # a draft model's runner: its own graphs (speculative/draft_model.py draft_config)
        rows = MAX_SPECULATING_DECODES
        d, m = graphs({**o, "speculative_config": None, "max_num_seqs": rows,
                       "cuda_graph_max_tokens": min(o["cuda_graph_max_tokens"], draft_graph_tokens(rows, MAX_PAUSE_STEPS + 2))})
        decode, mixed = decode + d, mixed + m
    return decode, mixed


# test_gpu.py's get_llm: these defaults under each test's options, one engine alive, reused while
# consecutive calls ask for the same options
GET_LLM = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024, cuda_graph_max_tokens=64)
LIFECYCLE = dict(dtype="float32", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024,
                 cuda_graph_max_tokens=64)
SPEC = GET_LLM


def exact(backend: str) -> str:
    return "bfloat16" if backend in ("fa4", "fa2") else "float32"


def get(backend: str, **options) -> tuple:
    return ("get", {**GET_LLM, "attention_backend": backend, **options})


def new(**options) -> tuple:
    return ("new", {"attention_backend": "triton", **options})


RELEASE = ("release", {})


def test_gpu_calls() -> list[tuple[str, list[tuple]]]:
    """(test id, its engine calls) in tests/test_gpu.py's order."""
    calls = []
    calls += [(f"logits_and_tokens_match_hf[{b}]", [get(b)]) for b in BACKENDS]
    calls += [(f"cuda_graph_decode_matches_eager[{b}]",
               [get(b, dtype=exact(b), max_num_seqs=32, max_num_batched_tokens=512, cuda_graph_max_tokens=512),
                get(b, dtype=exact(b), max_num_seqs=32, max_num_batched_tokens=512, cuda_graph_max_tokens=512,
                    enforce_eager=True)])
              for b in GRAPHED]
    calls += [(f"pdl_launches_match_plain_launches[{d}]",
               [get("triton", dtype=d, max_num_batched_tokens=512), RELEASE,
                get("triton", dtype=d, max_num_batched_tokens=512)]) for d in ("bfloat16", "float32")]
    calls += [("decode_tuning_recaptures_graphs_that_match_eager",
               [RELEASE, get("triton", max_num_seqs=1, max_num_batched_tokens=512), RELEASE,
                get("triton", max_num_seqs=1, max_num_batched_tokens=512, enforce_eager=True), RELEASE])]
    calls += [("decode_graphs_per_context_bound_match_eager",
               [get("triton", dtype="float32", max_num_seqs=2, max_model_len=4096),
                get("triton", dtype="float32", max_num_seqs=2, max_model_len=4096, enforce_eager=True)])]
    new_turn = dict(dtype="float32", max_model_len=4096, max_num_batched_tokens=4096, cuda_graph_max_tokens=256)
    calls += [("new_turn_over_a_long_cached_history_splits_kv",
               [get("torch", **new_turn), get("triton", **new_turn), get("triton", **new_turn, enforce_eager=True)])]
    calls += [(f"prefix_cache_chunking_preemption_same_tokens[{b}]",
               [get(b, dtype=exact(b), enable_prefix_caching=False), get(b, dtype=exact(b)),
                get(b, dtype=exact(b), num_kvcache_blocks=24, kvcache_block_size=64, max_num_batched_tokens=128,
                    max_num_seqs=16)]) for b in BACKENDS]
    small = dict(max_num_batched_tokens=3, max_num_seqs=4, kvcache_block_size=16, num_kvcache_blocks=64)
    calls += [(f"sampled_decode_graph_with_a_row_that_does_not_sample[{b}]",
               [get(b, dtype=exact(b), **small), get(b, dtype=exact(b), enforce_eager=True, **small)]) for b in GRAPHED]
    calls += [(f"staged_decode_steps_match_graphs_loaded_from_a_device_batch[{t}]",
               [get("triton", dtype="float32", kvcache_block_size=16)]) for t in (True, False)]
    calls += [(f"plain_sampling_replays_sampler_graphs_with_the_eager_tokens[{b}]",
               [get(b, dtype=exact(b), max_num_batched_tokens=64),
                get(b, dtype=exact(b), max_num_batched_tokens=64, enforce_eager=True)]) for b in GRAPHED]
    for b in BACKENDS:
        engines = []
        for options in (dict(), dict(num_kvcache_blocks=20, kvcache_block_size=64, max_num_batched_tokens=128)):
            engines += [get(b, dtype=exact(b), overlap_scheduling=o, **options) for o in (False, True)]
        calls += [(f"overlapped_steps_match_serial_steps[{b}]", engines)]
    stream_options = dict(dtype="float32", num_kvcache_blocks=20, kvcache_block_size=64, max_num_batched_tokens=128)
    calls += [("streams_match_serial_generate_with_overlap_and_the_launch_gate",
               [get("triton", overlap_scheduling=False, **stream_options), RELEASE,
                new(max_model_len=1024, max_num_seqs=8, cuda_graph_max_tokens=64, **stream_options)])]
    calibrated = dict(dtype="float32", max_num_seqs=64, max_num_batched_tokens=4096, cuda_graph_max_tokens=2048)
    calls += [("step_time_model_is_calibrated_at_start",
               [get("triton", target_step_ms=1.0, **calibrated), get("triton", **calibrated)])]
    calls += [(f"penalties_and_logprobs_match_hf_in_bf16[{b}]", [get(b, dtype="bfloat16")]) for b in GRAPHED]
    calls += [(f"penalties_and_logprobs_with_graphs_and_overlap_match_eager_serial[{b}]",
               [get(b, dtype=exact(b), overlap_scheduling=True),
                get(b, dtype=exact(b), overlap_scheduling=False, enforce_eager=True)]) for b in GRAPHED]
    calls += [("constrained_sampling_on_cuda[triton]",
               [get("triton", dtype="float32", overlap_scheduling=o, num_kvcache_blocks=256) for o in (False, True)])]
    calls += [("bad_words_hanging_on_the_token_in_flight_with_graphs_and_overlap[triton]",
               [get("triton", overlap_scheduling=True)])]
    calls += [("close_returns_the_device_memory", [RELEASE, new(**LIFECYCLE), new(**LIFECYCLE)])]
    calls += [("stable_tensors_keep_their_addresses...", [])]
    calls += [(f"sleep_returns_the_memory_and_wake_replays_graphs[{level}]", [RELEASE, new(**LIFECYCLE)])
              for level in (1, 2)]
    calls += [("reload_in_place_keeps_the_graphs", [RELEASE, new(**LIFECYCLE), new(**LIFECYCLE)])]
    calls += [("two_engines_of_different_models_start_and_generate_at_once_as_alone",
               [RELEASE] + [new(**LIFECYCLE)] * 4)]
    child = new(dtype="bfloat16", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024,
                cuda_graph_max_tokens=64)
    calls += [("start_up_cache_round_trip_in_fresh_processes (3 processes)", [RELEASE, child, child, child])]
    calls += [(f"speculative_decoding_greedy_identity_and_a_sampled_run[{b}]",
               [get(b, dtype=exact(b)), RELEASE,
                new(attention_backend=b, dtype=exact(b), **SPEC, speculative_config={"method": "ngram"})])
              for b in BACKENDS]
    draft = {"model": "target", "num_speculative_tokens": 4}
    calls += [("speculative_draft_steps_and_verification_replay_cuda_graphs",
               [RELEASE, new(dtype="float32", **SPEC, speculative_config=draft, enforce_eager=True),
                new(dtype="float32", **SPEC, speculative_config=draft)])]
    calls += [(f"speculative_draft_model_equal_to_the_target_on_cuda[{b}]",
               [get(b, dtype=exact(b)), RELEASE,
                new(attention_backend=b, dtype=exact(b), **SPEC, speculative_config=draft)]) for b in GRAPHED]
    return calls


def other_file_calls() -> list[tuple[str, list[tuple]]]:
    """Engines in the other GPU files (their CPU tests with device="cpu" capture nothing)."""
    fp8_loading = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=128, max_num_seqs=8,
                       max_num_batched_tokens=256, cuda_graph_max_tokens=64)
    # test_fp8_loading.py's other engines run on the CPU (device="cpu"); gpu_suite.sh's tests3 takes
    # only its CUDA test
    calls = [("test_fp8_loading.py::test_fp8_weights_on_cuda_match_the_dequantized_copy (3 cases)",
              [new(**fp8_loading)] * 6),
             ("test_fp8_loading.py::test_reload_of_another_fp8_format_requantizes_into_the_engines_layout[cuda]",
              [new(enforce_eager=True, **fp8_loading)] * 2)]
    calls += [("test_fp8_kv.py::test_gpu_bf16_fp8_cache_with_cuda_graphs",
               [new(dtype="bfloat16", max_model_len=1024, max_num_seqs=16, kvcache_block_size=16, kv_cache_dtype=kv)
                for kv in ("auto", "fp8")])]
    calls += [("test_fused_moe.py::test_engine_with_fused_experts_matches_hf_in_bf16",
               [new(max_model_len=1024, max_num_seqs=8, cuda_graph_max_tokens=64)])]
    return calls


def count(calls: list[tuple]) -> tuple[int, int, list[str]]:
    """(engines built, graphs captured, one line per engine), get_llm's cache simulated across calls."""
    global _held
    engines = graphs_total = 0
    lines = []
    for kind, options in calls:
        if kind == "release":
            _held = None
            continue
        key = tuple(sorted(options.items(), key=lambda kv: kv[0]), ) if kind == "get" else None
        if kind == "get" and key == _held:
            lines.append("    (reused) " + describe(options))
            continue
        _held = key if kind == "get" else None
        d, m = graphs(options)
        engines, graphs_total = engines + 1, graphs_total + d + m
        lines.append(f"    {d:3d} decode + {m:2d} mixed  {describe(options)}")
    return engines, graphs_total, lines


def describe(options: dict) -> str:
    shown = ("attention_backend", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "cuda_graph_max_tokens",
             "enforce_eager", "target_step_ms", "speculative_config")
    return " ".join(f"{k}={options[k]}" for k in shown if k in options and options[k] is not None)


_held = None

# scripts/gpu_suite.sh's parts (keep the two alike): test_gpu.py's tests whose names hold a word of
# GPU_PART1 run in tests1, its n-gram speculative ones in tests3 beside the other files' engine tests,
# the rest of it in tests2; the kernel files in tests4 (attention, sampling), tests5 (MoE), tests6 (FP8)
GPU_PART1 = ("match_hf", "cuda_graph_decode", "pdl", "decode_tuning", "per_context_bound", "prefix_cache_chunking",
             "sampled_decode_graph", "staged_decode", "plain_sampling", "penalties")
# the files without engines: seconds from earlier GPU runs (docs/BENCHMARKS_ARCHIVE.md: test_kernels.py with
# test_sampling_filters.py 366 s on an H100; run AH: the FP8 kernel files with the MoE router's 242 s, a process
# beside two others; the rest not timed apart: guesses), per part
FIXED_S = {"tests3": {"test_decode_staging.py, test_fp8_kv.py on CPU (guess)": 15},
           "tests4": {"test_kernels.py with test_sampling_filters.py": 366},
           "tests5": {"test_fused_moe.py (guess)": 150, "test_moe_router.py (guess)": 10},
           "tests6": {"test_fp8_kv_kernels.py, test_fp8_weight_kernels.py (run AH)": 230,
                      "test_fp8_route.py (guess)": 20}}
# an engine's start-up besides its graphs (load, probe, sampler graphs, tuning), each graph's warm-up and
# capture (kernels compiled on a cold cache among them), a test's own work: fitted so that run N's first
# 27 tests of test_gpu.py (55 engines, 615 graphs) come to its 560 s on an H100, with the process's
# first Triton compile (~35 s, once a machine: the cache stays on its disk for the next call)
ENGINE_S, GRAPH_S, TEST_S, COLD_COMPILE_S = 4.0, 0.4, 2.0, 35.0


def part_of(test: str) -> str:
    if test.startswith("test_") or "speculative_decoding" in test:
        return "tests3"
    return "tests1" if any(word in test for word in GPU_PART1) else "tests2"


def estimate_s(engines: int, captured: int) -> float:
    return engines * ENGINE_S + captured * GRAPH_S + TEST_S


def main() -> None:
    totals: dict[str, list[float]] = {}
    for test, calls in test_gpu_calls() + other_file_calls():
        engines, captured, lines = count(calls)
        part = part_of(test)
        seconds = estimate_s(engines, captured)
        total = totals.setdefault(part, [0, 0, 0, 0.0])
        totals[part] = [total[0] + 1, total[1] + engines, total[2] + captured, total[3] + seconds]
        print(f"[{part}] {test}: {engines} engines, {captured} graphs, ~{seconds:.0f} s")
        print("\n".join(lines))
    for part, files in FIXED_S.items():
        for name, seconds in files.items():
            print(f"[{part}] {name}: ~{seconds} s")
            total = totals.setdefault(part, [0, 0, 0, 0.0])
            total[3] += seconds
    print(f"\npart     tests  engines  graphs  estimate (a part run first on a machine: + {COLD_COMPILE_S:.0f} s)")
    for part, (tests, engines, captured, seconds) in sorted(totals.items()):
        print(f"{part:8s} {tests:5d} {engines:8d} {captured:7d}  {seconds / 60:.1f} min")
    all_totals = [sum(t[i] for t in totals.values()) for i in range(4)]
    print(f"{'all':8s} {all_totals[0]:5d} {all_totals[1]:8d} {all_totals[2]:7d}  {all_totals[3] / 60:.1f} min")


if __name__ == "__main__":
    main()
