#!/usr/bin/env bash
# Issue 16, goal 5: time from `spds train` to update 1, where it goes (run.json startup_seconds,
# metrics update 1), on one GPU, for a random-weight student saved with save_pretrained: the
# README's GPU settings (Liger kernels, flash below 8k and cuDNN above), a pinned config, a first
# run on this fresh machine (cold: no Triton cache) and a second one (warm).
#   bash bench/gpu_startup.sh 1.7b [8b ...]      (PHASES=0: skip bench/startup_phases.py)
#   KERNEL=fa4: FlashAttention-4 and packed micro-batches, whose kernels FA4 compiles in each process
#   unless its disk cache is on (spds's default; FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0 turns it off)
set -euo pipefail
for model in "$@"; do
  work=$(mktemp -d)
  python3 bench/make_synthetic.py "$work" --model "$model" --records 16 --min-tokens 2048 --max-tokens 8192 | tail -1
  python3 - "$work/config.json" <<'PY'
import json, os, sys
c = json.load(open(sys.argv[1]))
c["optim"].update(updates=3, effective_batch=8)
c["train"].update(require_smoke=False, deterministic=False)
if os.environ.get("SPDS_BENCH_CPU") == "1":  # a dry run of this script on CPU: no Liger, CPU SDPA
    pass
elif os.environ.get("KERNEL") == "fa4":  # FlashAttention-4 (spds[fa4]), records packed end to end
    c["student"].update(liger_kernels=True, attention_kernel="fa4")
    c["optim"].update(micro_batch_layout="packed")
else:
    c["student"].update(liger_kernels=True, attention_kernel={"below": 8192, "short": "flash", "long": "cudnn"})
c["checkpoint"].update(every=100)
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
  python3 -m spds.cli pin "$work/config.json" > /dev/null
  python3 -m spds.cli prepare "$work/config.json" | tail -1
  echo "== $model: start-up phases measured one by one"
  [ "${SPDS_BENCH_CPU:-0}" = 1 ] || [ "${PHASES:-1}" = 0 ] || python3 bench/startup_phases.py "$work/student" 2>&1 | grep "^{"
  for pass in cold warm; do
    python3 - "$work/config.json" "$work/run-$pass" <<'PY'
import json, sys; c = json.load(open(sys.argv[1])); c["output_dir"] = sys.argv[2]; json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
    began=$(date +%s.%N)
    bash launch/single_node.sh "$work/config.json" --gpus 1 --port $((29500 + RANDOM % 1000)) > "$work/$pass.log" 2>&1 \
      || { tail -30 "$work/$pass.log"; exit 1; }
    ended=$(date +%s.%N)
    python3 - "$work/run-$pass" "$model" "$pass" "$began" "$ended" <<'PY'
import json, os, sys
from pathlib import Path
out, model, label, began, ended = Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
startup = json.load(open(out / "run.json"))["startup_seconds"]
updates = [json.loads(line) for line in open(out / "metrics.jsonl")]
first = startup["resume"] + updates[0]["elapsed_seconds"]
print(json.dumps(dict(model=model, run=label, startup_seconds=startup, update1_seconds=round(updates[0]["seconds"], 2),
                      update2_seconds=round(updates[1]["seconds"], 2), train_to_update1=round(first, 2),
                      launcher_wall=round(ended - began, 1))))
PY
  done
  rm -rf "$work"
done
