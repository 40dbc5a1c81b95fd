#!/usr/bin/env bash
# Set up ulysses-sp in a virtual environment at .venv: torch is kept if .venv already has one,
# otherwise the pinned torch==2.13.0 is installed; then the package with its Hugging Face, TRL and
# test extras (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
PY=.venv/bin/python
"$PY" -m pip install -q --upgrade pip
if ! "$PY" -c "import torch" 2>/dev/null; then
  # pinned: a looser request may pull a multi-GB CUDA build
  "$PY" -m pip install -q "torch==2.13.0"
fi
# DeepSpeed is optional for users; the tests cover ZeRO with it. No CUDA ops are compiled.
DS_BUILD_OPS=0 "$PY" -m pip install -q -e ".[hf,trl,test,deepspeed]"
"$PY" -c "import torch, transformers, ulysses_sp; print('ulysses-sp', ulysses_sp.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
