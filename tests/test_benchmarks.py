"""The benchmark scripts run end to end on CPU with the tiny model, so a broken script shows here and
not first on the GPU machine, whose time is scarce. Only that they run and report rows without
errors is checked: their figures mean something only on a GPU."""
from __future__ import annotations

import argparse
import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # the benchmarks import asyncllm.kernels (so Triton): the kernel tests collected after this module
    # need Triton's interpreter chosen before its first import
    os.environ.setdefault("TRITON_INTERPRET", "1")

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import bench_ablation  # noqa: E402
import bench_delivery  # noqa: E402
import bench_embed  # noqa: E402
import bench_fp8_quality  # noqa: E402
import bench_fp8_weight_study  # noqa: E402
import bench_host_ops  # noqa: E402
import bench_http  # noqa: E402
import bench_latency  # noqa: E402
import bench_lifecycle  # noqa: E402
import bench_multiturn  # noqa: E402
import bench_profile  # noqa: E402
import bench_serving  # noqa: E402
import bench_server_libs  # noqa: E402
import bench_startup  # noqa: E402
import bench_spec  # noqa: E402
import bench_step_phases  # noqa: E402
import bench_throughput  # noqa: E402
import bench_turn_breakdown  # noqa: E402
import bench_turn_host  # noqa: E402
import run_all  # noqa: E402
from common import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_checkpoint("tiny", str(tmp_path_factory.mktemp("bench-tiny")), device="cpu")


def rows_without_errors(data: dict) -> list[dict]:
    rows = data["results"]
    assert rows, "no rows"
    errors = [row for row in rows if row.get("error")]
    assert not errors, errors
    return rows


def test_bench_throughput_runs_with_every_feature(tiny_model):
    data = bench_throughput.main(["--model-dir", tiny_model, "--device", "cpu", "--num-requests", "2",
                                  "--max-input", "100", "--max-output", "100", "--warmup-requests", "1",
                                  "--mode", "sync", "--features", "penalties+logprobs+json"])
    (row,) = rows_without_errors(data)
    assert row["total_tokens"] > 0 and row["throughput_tok_s"] > 0


def test_bench_throughput_spec_modes_run_side_by_side_with_their_stats_and_ratio(tiny_model, tmp_path):
    """none, ngram and config (a draft model equal to the target: its drafts are accepted) each in its
    own process: every row says which config ran, the speculative ones report the engine's drafts
    proposed and accepted, and each its ratio to none; run_all's headline reads the n-gram ratio."""
    config = {"model": tiny_model, "num_speculative_tokens": 2}
    out = tmp_path / "throughput-tiny-ngram.json"  # the name of run_all's step
    data = bench_throughput.main(["--model-dir", tiny_model, "--device", "cpu", "--num-requests", "2",
                                  "--max-input", "32", "--max-output", "24", "--warmup-requests", "1",
                                  "--mode", "sync", "--spec-modes", "none,ngram,config",
                                  "--speculative-config", json.dumps(config), "--json", str(out)])
    rows = rows_without_errors(data)
    assert [(row["spec"], row["speculative_config"]) for row in rows] == [
        ("none", None), ("ngram", bench_throughput.NGRAM), ("config", config)]
    assert all(row["generated_tokens"] == row["total_tokens"] > 0 and row["spec_ratio"] > 0 for row in rows)
    none, ngram, draft = rows
    assert "spec_proposed" not in none and none["spec_ratio"] == 1.0
    assert 0 <= ngram["spec_accepted"] <= ngram["spec_proposed"] and 0 <= ngram["speculating_share"] <= 1
    assert draft["spec_proposed"] > 0 and draft["acceptance_rate"] >= 0.8 and draft["speculating_share"] > 0
    assert draft["spec_accepted"] == round(draft["acceptance_rate"] * draft["spec_proposed"])
    (metric,) = [row for row in run_all.headline(run_all.load_results(str(tmp_path)), "tiny", False)
                 if "n-gram speculation" in row["metric"]]
    assert metric["value"] == f"{ngram['spec_ratio']:.3f}"


@pytest.mark.parametrize("argv, says", [
    (["--speculative-config", "{method: ngram}"], "argument --speculative-config: expected a JSON object"),
    (["--speculative-config", "[1]"], "argument --speculative-config: expected a JSON object"),
    (["--speculative-config", '{"method": "nope", "num_speculative_tokens": 4}'], "speculative_config.method"),
    (["--spec-modes", "config"], "--spec-modes"),
    (["--spec-modes", "none,eagle"], "--spec-modes")])
def test_bench_throughput_refuses_a_bad_speculative_option_naming_it(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_throughput.main(["--device", "cpu", *argv])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_run_all_measures_the_offline_workload_with_ngram_speculation_beside_none(tmp_path):
    args = argparse.Namespace(device="cpu", quick=True, small="tiny", out=str(tmp_path), big=False,
                              tensor_parallel=1, skip_hf=True, skip_kernels=True)
    steps = {step.name: step for step in run_all.plan(args, {"tiny": str(tmp_path / "tiny")})}
    argv = steps["throughput-tiny-ngram"].argv
    assert argv[0].endswith("bench_throughput.py") and steps["throughput-tiny-ngram"].needs == "build-tiny"
    assert argv[argv.index("--spec-modes") + 1] == "none,ngram" and argv[argv.index("--mode") + 1] == "sync"


def test_run_all_measures_the_oracle_ceiling_in_its_speculative_step(tmp_path):
    """The spec step runs every bench_spec mode (no --modes: the oracle too), and the headline reads the
    oracle's batch-1 speedup with its acceptance and text check."""
    args = argparse.Namespace(device="cuda", quick=False, small="0.6b", out=str(tmp_path), big=False,
                              tensor_parallel=1, skip_hf=True, skip_kernels=True)
    steps = {step.name: step for step in run_all.plan(args, {"0.6b": str(tmp_path / "0.6b")})}
    assert "--modes" not in steps["spec-smollm2"].argv and "oracle" in bench_spec.MODES
    rows = [dict(mode="plain", batch=1, tok_s=100.0), dict(mode="oracle", batch=1, tok_s=350.0, speedup=3.5,
                                                            acceptance_rate=1.0, same_text=True)]
    (tmp_path / "spec-smollm2.json").write_text(json.dumps({"results": rows}))
    (metric,) = [row for row in run_all.headline(run_all.load_results(str(tmp_path)), "0.6b", False)
                 if "oracle" in row["metric"]]
    assert (metric["value"], metric["check"], metric["note"]) == ("3.50x", "PASS", "acceptance 1.00, same text: True")


def test_bench_fp8_quality_compares_every_configuration_with_bf16(tiny_model):
    data = bench_fp8_quality.main(["--model-dir", tiny_model, "--device", "cpu", "--max-tokens", "40"])
    rows = {row["config"]: row for row in rows_without_errors(data)}
    assert list(rows) == [name for name, _ in bench_fp8_quality.CONFIGS]
    assert all(row["tokens"] == 40 for row in rows.values())
    assert rows["bf16"]["mean_kl"] == 0.0 and rows["bf16"]["top1_agreement"] == 1.0
    # each FP8 configuration changes the distributions (its KL is no rounding-free zero), and bounds them
    for name in ("weights FP8", "weights FP8 weight-only", "KV FP8 unrotated", "KV FP8", "weights + KV FP8"):
        assert 0.0 < rows[name]["mean_kl"] < 1.0 and rows[name]["perplexity"] > 1.0, rows[name]
        assert 0.0 <= rows[name]["top1_settled"] <= 1.0, rows[name]  # over the positions bf16 and float32 agree on
    assert rows["float32"]["top1_settled"] == 1.0 and rows["bf16"]["top1_settled"] is None


def test_bench_fp8_weight_study_reports_every_variant(tiny_model):
    """Each variant rounds something (KL above zero) and is undone before the next: the W8A8 row costs
    more than its weight-only row, the KV rows start from a cache that is not rounded."""
    data = bench_fp8_weight_study.main(["--model-dir", tiny_model, "--device", "cpu", "--max-tokens", "40"])
    rows = {row["variant"]: row for row in rows_without_errors(data)}
    assert list(rows) == [label for label, *_ in bench_fp8_weight_study.VARIANTS]
    assert all(0.0 < row["mean_kl"] < 1.0 and row["tokens"] == 40 for row in rows.values()), rows
    weight_only, w8a8 = bench_fp8_weight_study.VARIANTS[0][0], bench_fp8_weight_study.VARIANTS[9][0]
    assert rows[w8a8]["mean_kl"] > rows[weight_only]["mean_kl"]
    kv = bench_fp8_weight_study.main(["--model-dir", tiny_model, "--device", "cpu", "--max-tokens", "40",
                                      "--kv-scales"])["results"]
    assert [row["variant"] for row in kv] == [label for label, *_ in bench_fp8_weight_study.KV_VARIANTS]
    assert kv[0]["mean_kl"] < kv[1]["mean_kl"]  # the rotation alone moves only bf16's rounding


def test_bench_embed_reports_every_row_of_each_pooling(tiny_model):
    data = bench_embed.main(["--model-dir", tiny_model, "--device", "cpu", "--num-texts", "6", "--text-len", "40",
                             "--streams", "2", "--stream-tokens", "8", "--pooling", "last,mean"])
    rows = rows_without_errors(data)
    assert [(r["pooling"], r["row"]) for r in rows] == [
        (pooling, row) for pooling in ("last", "mean") for row in ("sync", "async", "streams", "async+streams")]
    assert all(r["embed_tokens_s"] > 0 for r in rows if r["row"] != "streams")
    assert all(r["itl_median_ms"] is not None for r in rows if r["row"] == "streams")


def test_bench_throughput_stream_mode_reports_the_host_figures(tiny_model):
    data = bench_throughput.main(["--model-dir", tiny_model, "--device", "cpu", "--num-requests", "3",
                                  "--max-input", "100", "--max-output", "100", "--warmup-requests", "1",
                                  "--mode", "stream", "--overlap", "on"])
    (row,) = rows_without_errors(data)
    assert row["total_tokens"] == row["generated_tokens"] > 0
    assert 0 < row["device_busy"] <= 1.01 and row["host_waits_s"] >= 0 and row["loop_cpu_s"] > 0


def test_bench_ablation_takes_out_each_part_and_frees_every_block(tiny_model):
    """Every variant runs (on CPU: eagerly); each patch takes effect (the greedy tokens change) and
    comes off again (the full step's tokens after all variants are those before them)."""
    from asyncllm import LLM, SamplingParams
    data = bench_ablation.main(["--model-dir", tiny_model, "--device", "cpu", "--tokens", "2"])
    rows = rows_without_errors(data)
    llm = LLM(tiny_model, device="cpu")
    runner = llm.core.runner
    variants = bench_ablation.variants(runner.model, runner.attn_backend)
    assert [row["variant"] for row in rows] == list(variants)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    before = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    for name, patches in variants.items():
        with bench_ablation._patched(patches):
            tokens = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
        assert (tokens != before) == bool(patches), name
    assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == before
    assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_total_blocks


def test_bench_delivery_counts_every_token():
    data = bench_delivery.main(["--device", "cpu", "--streams", "1,8", "--steps", "5", "--step-ms", "1"])
    rows = rows_without_errors(data)
    assert [(row["streams"], row["tokens"]) for row in rows] == [(1, 5), (8, 40)]
    assert all(row["us_per_token"] > 0 for row in rows)


@pytest.mark.parametrize("extra", [[], ["--quantization", "fp8"]])
def test_bench_latency_runs_greedy_and_sampled(tiny_model, extra, monkeypatch):
    built, real_llm = [], bench_latency.LLM
    monkeypatch.setattr(bench_latency, "LLM", lambda *args, **kwargs: built.append(kwargs) or real_llm(*args, **kwargs))
    data = bench_latency.main(["--model-dir", tiny_model, "--device", "cpu", "--ttft-prompt-lens", "16", "--reps",
                               "1", "--tpot-tokens", "2", "--tpot-prompt-len", "16", "--tpot-reps", "1", *extra])
    assert built and all(kwargs["quantization"] == (extra[1] if extra else None) for kwargs in built)
    rows = rows_without_errors(data)
    assert {(row["metric"], row.get("temperature")) for row in rows} >= {
        ("TPOT", 0.0), ("TPOT", 0.6), ("TPOT (stream)", 0.0), ("TPOT (stream)", 0.6)}


def test_bench_profile_runs_with_its_workload(tiny_model):
    data = bench_profile.main(["--model-dir", tiny_model, "--device", "cpu", "--reps", "1", "--batch", "2",
                               "--context", "16", "--prefill-len", "16", "--workload", "2",
                               "--workload-features", "plain,logprobs"])
    rows_without_errors(data)
    assert [row["features"] for row in data["workload"] if row["kind"].startswith("all")] == ["plain", "logprobs"]


def test_bench_step_phases_times_every_phase_of_both_paths(tiny_model):
    from asyncllm.runner import model_runner
    from asyncllm.runner.launched_step import LaunchedStep
    originals = LaunchedStep._queued, model_runner.upload_arrays
    data = bench_step_phases.main(["--model-dir", tiny_model, "--device", "cpu", "--overlap", "on", "--tokens", "12",
                                   "--prompt-len", "8", "--reps", "1", "--detail", "--greedy-graph", "both"])
    # the wrappers of class and module attributes are gone again (the originals back, not deleted)
    assert (LaunchedStep._queued, model_runner.upload_arrays) == originals
    rows = rows_without_errors(data)
    # the parts of launch (--detail), in both paths: the scheduler, the upload, the copy to the host
    assert all(row["schedule_us"] > 0 and row["upload_us"] > 0 and row["queue_copy_us"] > 0 for row in rows)
    # --greedy-graph both: greedy rows both ways, sampled rows once
    assert [(row["path"], row["temperature"], row["greedy_graph"]) for row in rows] == [
        (path, t, graph) for path in ("LLM.generate", "stream()") for t, graph in ((0.0, "on"), (0.0, "off"), (0.6, "on"))]
    for row in rows:
        assert row["period_us"] > 0 and row["launch_us"] > 0 and row["forward_us"] > 0 and row["sampler_us"] > 0
    # the engine thread waits for the step in flight (wait_step), delivers, and the event loop works
    assert all("wait_us" in row and row["deliver_us"] > 0 and row["loop_cpu_us"] > 0
               for row in rows if row["path"] == "stream()")


def test_bench_host_ops_times_the_calls_that_the_cpu_has():
    data = bench_host_ops.main(["--device", "cpu", "--calls", "20"])
    rows = rows_without_errors(data)
    assert any(row["call"].startswith("upload_arrays") for row in rows)
    assert all(row["us"] > 0 for row in rows)


def test_bench_multiturn_serves_each_turns_history_from_the_prefix_cache(tiny_model):
    data = bench_multiturn.main([
        "--model-dir", tiny_model, "--device", "cpu", "--users", "1,2", "--turns", "3", "--user-tokens", "260,300",
        "--answer-tokens", "2,3", "--max-context", "2048", "--rag-doc-tokens", "300", "--rag-questions", "3",
        "--rag-answer-tokens", "2", "--rag-concurrency", "2", "--cached-tokens", "256", "--new-tokens", "8",
        "--decode-tokens", "3", "--reps", "2", "--warmup-requests", "1"])
    rows = rows_without_errors(data)
    chat = [row for row in rows if row["case"] == "chat"]
    assert [(row["users"], row["requests"], row["turns_done"]) for row in chat] == [(1, 3, 3), (2, 6, 6)]
    for row in chat:
        assert 2 * row["requests"] <= row["output_tokens"] <= 3 * row["requests"]
        assert 0 < row["prefix_hit_rate"] < 1 and row["preemptions"] == 0
    # per turn: every conversation reached it; the first turn has no history, the later ones find theirs cached
    turns = data["turns"]
    assert [(row["users"], row["turn"], row["conversations"]) for row in turns] == [
        (users, turn, users) for users in (1, 2) for turn in range(3)]
    assert all((row["prefix_hit_rate"] > 0) == (row["turn"] > 0) for row in turns)
    assert all(row["ttft_p50_ms"] is not None and row["itl_p50_ms"] is not None for row in turns)
    first, rest, prefill, cached = [row for row in rows if row["case"] != "chat"]
    assert first["prefix_hit_rate"] == 0 and first["requests"] == 1
    assert rest["requests"] == 2 and rest["prefix_hit_rate"] > 0 and rest["output_tokens"] == 4
    assert prefill["prompt_tokens_max"] == 256 and prefill["prefix_hit_rate"] == 0
    # the whole 256-token context (one KV block) served from the cache, the 8 new tokens computed
    assert cached["requests"] == 2 and cached["prefix_hit_rate"] == 256 / 264 and cached["output_tokens"] == 6


def test_bench_http_runs_every_workload_through_every_path(tiny_model):
    """The server and the in-process twin each in a process of their own, clients in two processes:
    every request of every row comes back whole (the usage chunk's token counts add up)."""
    data = bench_http.main([
        "--model-dir", tiny_model, "--device", "cpu", "--num-requests", "3", "--max-input", "100",
        "--max-output", "3", "--concurrency", "3", "--input-len", "32", "--output-len", "2", "--rate", "50",
        "--requests-per-rate", "3", "--client-processes", "2", "--warmup-requests", "1"])
    rows = rows_without_errors(data)
    workloads = ("burst", "3", "Poisson")  # the twin's rows first, from its own process; then the server's
    assert [(row["path"], row["workload"].split()[0]) for row in rows] == [
        *(("in-process", workload) for workload in workloads),
        *((path, workload) for workload in workloads for path in ("httpx", "openai"))]
    for row in rows:
        expected = (16, 32) if row["workload"].startswith("3 closed") else (3, 9 if row["workload"].startswith("burst")
                                                                             else 6)
        assert (row["num_requests"], row["output_tokens"]) == expected, row
        assert row["errors"] == 0 and row["processes"] == (1 if row["path"] == "in-process" else 2)
        assert row["tok_s_vs_in_process"] > 0 and row["ttft_p50_ms"] is not None


def test_bench_http_splits_a_workload_over_the_client_processes():
    requests = list(range(7))
    closed = bench_http.shares(requests, None, 3, 2)
    assert [(share["requests"], share["concurrency"]) for share in closed] == [([0, 2, 4, 6], 2), ([1, 3, 5], 1)]
    # fewer clients than processes: only processes with a client get requests
    assert [share["requests"] for share in bench_http.shares(requests, None, 1, 4)] == [requests]
    offsets = [0.1 * i for i in range(7)]
    opened = bench_http.shares(requests, offsets, 0, 3)
    assert sorted(r for share in opened for r in share["requests"]) == requests
    assert all(share["offsets"] == [offsets[r] for r in share["requests"]] for share in opened)


def test_bench_startup_times_each_api_cold_and_warm_by_phase(tiny_model, tmp_path):
    os.symlink(tiny_model, tmp_path / "tiny")  # --checkpoints DIR: DIR/<shape>, reused
    data = bench_startup.main(["--device", "cpu", "--shapes", "tiny", "--checkpoints", str(tmp_path)])
    rows = rows_without_errors(data)
    assert [(row["api"], row["caches"]) for row in rows] == [
        (api, caches) for api in ("llm", "async", "serve") for caches in ("cold", "warm")]
    for row in rows:
        # the engine's own start-up timings (also from the server's process): the phases that run
        # on CPU, none of the CUDA-only ones
        assert all(row[phase] is not None for phase in ("config", "tokenizer", "build model", "load weights",
                                                        "memory probe", "KV cache", "request intake"))
        assert row["CUDA graphs"] is None and row["decode tuning"] is None and row["step-model calibration"] is None
        assert 0 < row["imports_s"] < row["ready_s"] < row["total_s"]
        assert sum(row[phase] or 0 for phase in bench_startup.PHASE_NAMES) < row["ready_s"] - row["imports_s"]
        assert any(message.startswith("KV cache:") for _, _, message in row["logs"])
        # what each slow phase does, as it starts and ends, and the engine's ready line (INFO)
        said = [m for _, level, m in row["logs"] if m.startswith("start-up: waiting for the tokenizer") and level == "INFO"]
        assert len(said) == 2 and said[0] == "start-up: waiting for the tokenizer..." and said[1].endswith(" s"), said
        assert any(message.startswith("start-up: ready after ") for _, _, message in row["logs"])
        assert (row["api"] == "serve") == any(message.startswith("asyncllm serve: ready ")
                                              for _, _, message in row["logs"])
        # the start-up cache: nothing measured on CPU, so nothing stored or read, and Triton's cache not placed
        assert (row["decisions_read"], row["decisions_measured"], row["triton_files"], row["startup_files"]) \
            == (0, 0, 0, 0)


def test_bench_startup_warm_variants_alternate_after_one_cold_run(tiny_model, tmp_path, monkeypatch):
    """--warm-env: one cold run fills the caches, then each variant's warm start-ups, alternated, each child
    given its variables; a variant that is not NAME=VALUE is refused by name."""
    os.symlink(tiny_model, tmp_path / "tiny")
    spawned = []

    def spawn_child(args, model_dir, api, caches, log_path, variant=None):
        spawned.append(variant)
        raise RuntimeError("not started")  # each start-up's row: its error, under its labels
    monkeypatch.setattr(bench_startup, "spawn_child", spawn_child)
    data = bench_startup.main(["--device", "cpu", "--shapes", "tiny", "--apis", "llm", "--checkpoints", str(tmp_path),
                               "--warm-env", "default,ASYNCLLM_STAGED_LOADING=1;ASYNCLLM_PDL=0", "--warm-reps", "2"])
    staged = {"ASYNCLLM_STAGED_LOADING": "1", "ASYNCLLM_PDL": "0"}
    assert spawned == [None, {}, staged, {}, staged]
    named = "ASYNCLLM_STAGED_LOADING=1;ASYNCLLM_PDL=0"
    assert [(row["caches"], row["variant"]) for row in data["results"]] == [
        ("cold", "default"), ("warm", "default"), ("warm", named), ("warm", "default"), ("warm", named)]
    assert all(row["error"] == "RuntimeError: not started" for row in data["results"])
    with pytest.raises(SystemExit):
        bench_startup.main(["--device", "cpu", "--shapes", "tiny", "--warm-env", "STAGED"])


def test_bench_serving_times_every_request_of_each_level(tiny_model):
    data = bench_serving.main(["--model-dir", tiny_model, "--device", "cpu", "--concurrency", "2", "--rates", "4",
                               "--requests-per-rate", "3", "--input-len", "8", "--output-len", "3"])
    rows = rows_without_errors(data)
    assert len(rows) == 2  # the closed-loop level and the Poisson rate
    for row in rows:
        assert row["output_tok_s"] > 0, row


def test_bench_server_libs_runs_with_or_without_the_libraries():
    data = bench_server_libs.main(["--repeat", "20", "--events", "50", "--responses", "20"])
    assert data["validation_us_per_request"]["protocol.py"] > 0
    assert all(row["json_scan"] > 0 for row in data["tool_call_us_per_piece"])
    assert data["sse_us_per_event"]["sse.py"] > 0
    assert data["sse_us_per_response"] == {"responses": 20, "sse.py": data["sse_us_per_response"]["sse.py"]}
    assert data["sse_us_per_response"]["sse.py"] > 0


def test_bench_lifecycle_times_sleep_and_wake_against_a_fresh_start(tiny_model):
    data = bench_lifecycle.main(["--model-dir", tiny_model, "--device", "cpu"])
    rows = rows_without_errors(data)
    assert [row["step"] for row in rows] == ["fresh start", "sleep(1) + wake()", "sleep(2) + wake()", "close()"]
    assert rows[0]["seconds"] > 0 and rows[0]["startup_timings"]["load weights"] > 0
    assert rows[0]["sleep_path"].startswith("recapture (device cpu")  # the GPU's: "stable memory ..."
    assert all(row["same_tokens"] and row["wake_speedup"] > 0 for row in rows[1:3])
    assert rows[3]["closed_delta_mib"] is None  # memory figures are the GPU's


def test_bench_spec_runs_every_mode_in_its_process_with_the_same_text(tiny_model):
    data = bench_spec.main(["--model-dir", tiny_model, "--device", "cpu", "--batches", "1,2", "--output-len", "12",
                            "--reps", "1"])
    rows = rows_without_errors(data)
    assert [(row["mode"], row["batch"]) for row in rows] == [
        (mode, batch) for mode in ("plain", "ngram", "draft", "random-draft", "oracle") for batch in (1, 2)]
    assert all(row["tok_s"] > 0 and row["speedup"] > 0 for row in rows)
    assert all(row["same_text"] for row in rows if row["mode"] != "plain")
    by_mode = {(row["mode"], row["batch"]): row for row in rows}
    # the draft is the target: every proposal accepted; random weights: (almost) none
    assert by_mode[("draft", 1)]["acceptance_rate"] >= 0.9
    # a draft model's rows time its proposals and count its forwards (on CPU all eager); the others have none
    draft, random_draft = by_mode[("draft", 1)], by_mode[("random-draft", 1)]
    assert draft["draft_proposals_per_rep"] >= 1 and draft["draft_ms_per_proposal"] > 0
    # the random draft's failed probes in the warm-up set the engine's backoff (engine/speculation.py), which
    # the timed rep's new requests wait out first: within 12 tokens they propose little or nothing
    assert random_draft["draft_proposals_per_rep"] <= draft["draft_proposals_per_rep"]
    if random_draft["draft_proposals_per_rep"]:
        assert random_draft["acceptance_rate"] <= 0.3
    for row in (draft, random_draft):
        assert row["draft_eager_forwards_per_rep"] >= row["draft_proposals_per_rep"] and row["draft_replays_per_rep"] == 0
    assert all("draft_ms_per_proposal" not in row for row in rows if row["mode"] in ("plain", "ngram", "oracle"))
    assert all(row["jit_compiles"] == "0" for row in rows)  # CPU: nothing compiled
    # the oracle drafts the plain greedy output (the tiny model's never repeats, so n-gram lookup
    # proposes ~nothing there): every row speculates, several tokens a step
    for batch in (1, 2):
        oracle = by_mode[("oracle", batch)]
        assert oracle["acceptance_rate"] >= 0.95 and oracle["spec_proposed"] >= batch * 8
        assert oracle["mean_accepted_length"] > 2 and oracle["speculating_share"] > 0.5


def test_bench_spec_refuses_the_oracle_when_sampling(capsys):
    with pytest.raises(SystemExit):
        bench_spec.main(["--modes", "plain,oracle", "--temperature", "1.0", "--device", "cpu"])
    assert "--modes: oracle proposes greedy output" in capsys.readouterr().err


def test_bench_spec_sampled_draft_accepts_nearly_every_draft(tiny_model):
    """--temperature 1: the draft (the target itself) draws seeded drafts with the target's noise keys,
    so nearly every draft is accepted (point proposals would get p(argmax), ~0 on the tiny model), and
    the exact-match verification keeps the plain engine's seeded text."""
    data = bench_spec.main(["--model-dir", tiny_model, "--device", "cpu", "--batches", "1", "--output-len", "12",
                            "--reps", "1", "--modes", "plain,draft", "--temperature", "1.0"])
    rows = rows_without_errors(data)
    assert [row["mode"] for row in rows] == ["plain", "draft"]
    assert rows[1]["acceptance_rate"] >= 0.9 and rows[1]["same_text"]


def test_bench_turn_host_times_every_stage_of_a_cached_turn():
    # it raises unless the prefix cache served each turn's context (its full blocks)
    results = bench_turn_host.main(["--contexts", "300,600", "--new-tokens", "16", "--reps", "2", "--async-path"])
    assert list(results) == [300, 600]
    for stages in results.values():
        assert list(stages) == [*bench_turn_host.STAGES, "async_host"] and stages["async_host"] > 0
        assert all(stages[name] > 0 for name in ("intake", "schedule", "match_prefix", "inputs", "model", "host"))
        assert stages["match_prefix"] <= stages["schedule"] and stages["host"] <= stages["total"]


def test_bench_turn_host_without_forwards_and_with_a_text_turn():
    results = bench_turn_host.main(["--contexts", "300,600", "--new-tokens", "16", "--reps", "2", "--no-forward",
                                    "--text"])
    for context, stages in results.items():
        assert all(stages[name] > 0 for name in ("intake", "schedule", "match_prefix", "inputs", "host", "chat_text"))
        assert stages["model"] < stages["host"]  # zero logits, not the model
        assert context <= stages["chat_tokens"] < context + 1000  # the conversation: about the context's tokens


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_bench_turn_breakdown_accounts_for_each_cached_turns_ttft(tiny_model, overlap):
    # it raises unless the prefix cache served each turn's context (its one full 256-token block)
    data = bench_turn_breakdown.main(["--model-dir", tiny_model, "--device", "cpu", "--cached-tokens", "300",
                                      "--new-tokens", "16", "--reps", "2", "--overlap", overlap])
    rows = {row["path"]: row for row in rows_without_errors(data)}
    assert list(rows) == ["async", "sync"]
    for path, row in rows.items():
        # the turn's step: eager on CPU, the 60 tokens past the cached block over the 316-token context
        assert (row["step path"], row["tokens"], row["seqs"], row["max_seq_len"]) == ("eager", 60, 1, 316), row
        assert all(row[name] > 0 for name in ("intake", "add", "launch", "schedule", "match_prefix", "inputs",
                                              "forward host", "resolve", "ttft")), row
        assert row["match_prefix"] <= row["schedule"] and row["forward host"] < row["launch"] < row["ttft"]
        # the stages cover the TTFT: what no stage holds is small beside the step's own work
        assert abs(row["gaps"]) < row["forward host"], row
        assert row["forward gpu"] is None  # CUDA events only
    assert rows["async"]["to engine"] >= 0 and rows["async"]["deliver"] >= 0 and rows["async"]["to consumer"] > 0
    assert rows["sync"]["to engine"] is None and rows["sync"]["deliver"] is None
    timelines = data["timelines"]
    assert {name for _, name, _, _ in timelines["async"]} >= {"post", "add", "launch", "resolve", "deliver", "wake"}
    assert {thread for _, _, _, thread in timelines["sync"]} == {"MainThread"}
