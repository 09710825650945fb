#!/usr/bin/env bash
# Both 2-GPU measurements of issue 16 in one device call: the deterministic SIGTERM/resume of a
# 1.7B student with records up to 32k, then 1- vs 2-GPU scaling on the length mix.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
echo "===== SIGTERM and resume, 1.7B, records to 32k, train.deterministic"
SKIP_SMOKE=1 SPDS_X2_MODEL=1.7b SPDS_X2_MAX_TOKENS=32768 UPDATES=${UPDATES:-10} timeout 330 \
  bash bench/gpu_x2_sigterm.sh 2>&1 | tee "$out/x2-sigterm-1.7b-32k.log"
echo "===== scaling"
timeout 230 bash bench/gpu_x2_scaling.sh 2>&1 | tee "$out/x2-scaling.log"
