#!/usr/bin/env bash
# nvidia-h200-x2 (issue 16 goal 2): the same run on 1 and 2 GPUs through launch/single_node.sh,
# a Qwen3-1.7B-shaped student on the length mix (log-uniform 512-32k), effective batch 32, the
# README's GPU settings (Liger, flash below 8k / cuDNN above, packed micro-batches). Scaling =
# 2-GPU tokens/s over twice the 1-GPU figure; each update's balance = mean / max of the ranks'
# busy seconds (rank_busy_seconds in metrics.jsonl).
#   bash bench/gpu_x2_scaling.sh     (env: UPDATES, RECORDS)
set -euo pipefail
out=${OUT:-/tmp/out}; work=$(mktemp -d); mkdir -p "$out"
python3 bench/make_synthetic.py "$work" --model 1.7b --records "${RECORDS:-96}" --min-tokens 512 \
  --max-tokens 32768 2>&1 | tail -1
cfg="$work/config.json"
python3 - "$cfg" "${UPDATES:-5}" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["optim"].update(updates=int(sys.argv[2]), effective_batch=32, micro_batch=16, micro_batch_tokens=16384,
                  max_grad_norm=1000.0)
c["student"].update(liger_kernels=True, attention_kernel={"below": 8192, "short": "flash", "long": "cudnn"})
c["train"].update(deterministic=False, require_smoke=False)
c["checkpoint"].update(every=1000)
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
python3 -m spds.cli prepare "$cfg" | tail -1
for gpus in 1 2; do
  python3 - "$cfg" "$work/run$gpus" <<'PY'
import json, sys; c = json.load(open(sys.argv[1])); c["output_dir"] = sys.argv[2]; json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
  echo "== $gpus GPU(s)"
  bash launch/single_node.sh "$cfg" --gpus "$gpus" --port $((29500 + RANDOM % 1000)) 2>&1 \
    | grep -E "^update|Error|error" | grep -v Warning | tail -3 || true
  cp "$work/run$gpus/metrics.jsonl" "$out/x2-scaling-${gpus}gpu-metrics.jsonl"
done
python3 - "$work" <<'PY'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
runs = {g: [json.loads(l) for l in open(work / f"run{g}" / "metrics.jsonl")] for g in (1, 2)}
timed = {g: [m for m in runs[g] if m["update"] > 1] for g in runs}  # update 1 compiles and warms up
for g, lines in timed.items():
    rate = sum(m["tokens"] for m in lines) / sum(m["seconds"] for m in lines)
    balance = [round(sum(m["rank_busy_seconds"]) / len(m["rank_busy_seconds"]) / max(m["rank_busy_seconds"]), 3)
               for m in lines]
    print(f"{g} GPU(s): {rate:,.0f} tok/s over updates {[m['update'] for m in lines]}; balance per update {balance}")
rate = {g: sum(m["tokens"] for m in timed[g]) / sum(m["seconds"] for m in timed[g]) for g in timed}
print(f"scaling 2 vs 1: {rate[2] / (2 * rate[1]):.3f}; per update "
      f"{[round(a['seconds'] / (2 * b['seconds']), 3) for a, b in zip(timed[1], timed[2])]}")
for m in timed[2]:
    busy = m["rank_busy_seconds"]
    print(f"  2 GPUs update {m['update']}: {m['seconds']:.2f} s, ranks busy {busy}, "
          f"after the slowest rank {m['seconds'] - max(busy):.2f} s")
PY
