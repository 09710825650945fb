#!/usr/bin/env bash
# Create or reuse the virtual environment at $1 (default .venv) with everything spds needs.
# - A torch that Python can already import (system or venv) is kept: the venv sees system
#   site-packages, so a cluster's CUDA torch is used as it is.
# - Without one: on a machine with an NVIDIA GPU, pip's default torch; without a GPU, a CPU
#   build first (a local wheel in $SPDS_TORCH_WHEELS, else the PyTorch CPU index), because
#   `pip install deepspeed` would otherwise pull a multi-GB CUDA torch.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
stamp="$venv/.spds-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
[ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv"
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    wheel=$(ls "${SPDS_TORCH_WHEELS:-/opt/wheels}"/torch-*+cpu-cp$("$py" -c 'import sys;print(f"{sys.version_info[0]}{sys.version_info[1]}")')-*.whl 2>/dev/null | head -n1 || true)
    if [ -n "$wheel" ]; then
      "$py" -m pip install -q "$wheel"
    else
      "$py" -m pip install -q torch --index-url "${SPDS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
    fi
  fi
fi
"$py" -m pip install -q -e ".[test]"
touch "$stamp"
