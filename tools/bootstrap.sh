#!/usr/bin/env bash
# Create or reuse the virtual environment at $1 (default .venv) with everything spds needs, at the
# tested versions: requirements/cpu.txt (what CI tests) on a machine without an NVIDIA GPU,
# requirements/gpu.txt (what bench/RESULTS.md measured) on one with it, as pip constraints.
# SPDS_UNPINNED=1 installs the newest of everything instead (the Makefile gives it its own venv).
# - A torch that the system Python already imports (a cluster's CUDA build) is kept: the venv then
#   sees the system site-packages, and the lock's torch line is left out.
# - Without one: on a machine with an NVIDIA GPU, pip's default torch; without a GPU, the CPU build
#   first (a local wheel in $SPDS_TORCH_WHEELS, else the PyTorch CPU index), because
#   `pip install deepspeed` would otherwise pull a multi-GB CUDA torch.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
gpu=false
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=true; fi
lock=requirements/cpu.txt
if [ "$gpu" = true ]; then lock=requirements/gpu.txt; fi
if [ "${SPDS_UNPINNED:-}" = 1 ]; then lock=; fi

# The venv is reused while it was made from the same pyproject.toml and lock, in the same mode.
want="$(cat pyproject.toml ${lock:+"$lock"} | sha256sum | cut -c1-16) ${lock:-unpinned}"
stamp="$venv/.spds-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

system_torch=false
if "$python" -c "import torch" 2>/dev/null; then system_torch=true; fi
if [ ! -x "$venv/bin/python" ]; then
  if [ "$system_torch" = true ]; then
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"  # nothing but the lock: no stray package of the system's
  fi
fi
py="$venv/bin/python"
pip=("$py" -m pip install -q)
constraints=()
if [ -n "$lock" ]; then
  kept="$venv/.spds-constraints.txt"
  if "$py" -c "import torch" 2>/dev/null; then
    grep -v '^torch==' "$lock" > "$kept"  # the torch that is there stays (spds warns if untested)
  else
    cp "$lock" "$kept"
  fi
  constraints=(-c "$kept")
else
  pip+=(--upgrade --upgrade-strategy eager)
fi
if ! "$py" -c "import torch" 2>/dev/null; then
  if [ "$gpu" = true ]; then
    "${pip[@]}" "${constraints[@]}" torch
  else
    wheel=$(ls "${SPDS_TORCH_WHEELS:-/opt/wheels}"/torch-*+cpu-cp$("$py" -c 'import sys;print(f"{sys.version_info[0]}{sys.version_info[1]}")')-*.whl 2>/dev/null | head -n1 || true)
    if [ -n "$wheel" ] && { [ -z "$lock" ] || grep -q "^torch==$(basename "$wheel" | cut -d- -f2 | cut -d+ -f1)\$" "$lock"; }; then
      "${pip[@]}" "$wheel"
    else
      "${pip[@]}" "${constraints[@]}" torch --index-url "${SPDS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
    fi
  fi
fi
extras=test
if [ "$gpu" = true ]; then extras=test,gpu; fi
if [ -z "$lock" ]; then
  # the newest of everything but torch, which stays the build chosen above (a CPU build here;
  # an eager upgrade would fetch the registry's default, a multi-GB CUDA build)
  kept="$venv/.spds-constraints.txt"
  "$py" -c "import torch; print('torch==' + torch.__version__)" 2>/dev/null > "$kept"
  constraints=(-c "$kept")
fi
"${pip[@]}" "${constraints[@]}" -e ".[$extras]"
if [ "$gpu" = false ]; then
  # DeepSpeed's CPU communication op is compiled the first time a process group starts, once per
  # venv (about half a minute of g++): built here, as part of set-up, not in the first command run
  DS_ACCELERATOR=cpu "$py" -c "from spds.training.engine import load_cpu_comm_op; load_cpu_comm_op()" \
    || echo "bootstrap: DeepSpeed's CPU comm op did not build now; the first run builds it" >&2
fi
echo "$want" > "$stamp"
