#!/usr/bin/env bash
# One H200 (issue 16 goal 1, issue 15's cached teacher): which attention kernels are
# deterministic at long context and at what cost; the cached teacher's attention; then the real
# training step on the 1.7B length mix: default kernels vs train.deterministic vs flex.
#   bash bench/gpu_determinism.sh      (writes logs under $OUT)
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
quiet() { grep -v -E "UserWarning|warnings.warn|^  (out|return|torch)" || true; }
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | quiet | tee "$out/$name.log"; }
step determinism 240 python3 bench/checks/check_determinism.py --model 1.7b --lengths 8192,32768
step cached-attention 60 python3 bench/checks/check_cached_attention.py
step step-1.7b-mix32 300 python3 bench/bench_gpu.py --model 1.7b --cases mix:32 --no-peft \
  --variants ${VARIANTS:-liger,liger-det,liger-det-flash,liger-flex,liger-flexlong}
