#!/usr/bin/env bash
# One H200: eval's forward at 64k on an 8B student (issue 16 goal 4); the deterministic step's cost
# on 8B; where a CE and a KL update spend GPU time on 1.7B (issue 15, torch.profiler).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
quiet() { grep -v -E "UserWarning|warnings.warn|cutedsl|_ascend|^  (out|return|torch)" || true; }
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | quiet | tee "$out/$name.log"; }
step eval-8b 150 python3 bench/bench_eval.py --model 8b --lengths 65536,65536 --mix 16
step profile-1.7b 150 python3 bench/bench_gpu.py --model 1.7b --cases mix:16 --no-peft --profile \
  --variants liger,liger-kl-nocache
step step-8b-det 200 python3 bench/bench_gpu.py --model 8b --cases mix:16 --no-peft --variants liger,liger-det
