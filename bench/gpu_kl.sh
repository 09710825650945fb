#!/usr/bin/env bash
# On one GPU: the online-KL step against the CE step (issue 15's cost goal), with the context's
# keys and values computed once (liger-kl) and recomputed for every record (liger-kl-nocache), on
# a random-weight Qwen3-shaped student and the length mix; then, with SANITY=1, the tiny example's
# whole loop on CUDA and ce vs kl vs mix at equal updates (bench/compare_objectives.py).
#   MODEL=1.7b CASES=mix:64 SANITY=1 bash bench/gpu_kl.sh
set -euo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ "${SANITY:-0}" = 1 ]; then
  bash bench/gpu_sanity.sh 2>&1 | tail -25
  python3 bench/compare_objectives.py --tiny /tmp/objectives --out "$out" 2>&1 | tail -5
fi
python3 bench/bench_gpu.py --model "${MODEL:-1.7b}" --cases ${CASES:-mix:64} \
  --variants liger,liger-kl,liger-kl-nocache --no-peft --out "$out/kl-${MODEL:-1.7b}.json" 2>&1 | tail -8
