#!/usr/bin/env bash
# Issue 55 on the real example, on CPU: the two forms of the soft prompt (soft_prompt.form
# embeddings, kv) at several lengths, trained on one set of self-study rows with the CPU recipe
# (examples/real/run.json: 256 conversations, kl to the top-20, 64 updates of 8), each measured on
# the 20 fact questions training never asks (spds eval: gap recovered, greedy answers holding the
# fact's keyword).
#   bash bench/kv_forms_cpu.sh MODEL_DIR OUT [NAME=form:length:learning_rate ...]
# MODEL_DIR: examples/real/make_model.py's output. Writes OUT/summary.jsonl (a line per variant)
# and each variant's eval.json and samples.md.
set -euo pipefail
model=$(realpath "$1"); out=$(realpath -m "$2"); shift 2
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(emb128=embeddings:128:0.01 kv16=kv:16:0.01 kv16-lr03=kv:16:0.03 emb16=embeddings:16:0.01)
python=${PYTHON:-.venv/bin/python}
work=${WORK:-}; made=""; [ -n "$work" ] || { work=$(mktemp -d); made=1; }  # WORK: a directory to go on in (kept)
mkdir -p "$out" "$work"
[ -e "$work/model" ] || { cp examples/real/context.md examples/real/questions.jsonl examples/real/run.json "$work/"; ln -s "$model" "$work/model"; }
export TOKENIZERS_PARALLELISM=false
"$python" -m spds.cli generate "$work/run.json" > "$out/generate.log" 2>&1  # rows already there are kept
tail -3 "$out/generate.log"
questions=$(ls -d "$work"/run-*/eval-questions 2>/dev/null | head -1)
for variant in "${variants[@]}"; do
  name=${variant%%=*}; IFS=: read -r form length rate <<< "${variant#*=}"
  "$python" - "$work" "$name" "$form" "$length" "$rate" <<'PY'
import json, sys
work, name, form, length, rate = sys.argv[1:]
config = json.load(open(f"{work}/run.json"))
config["soft_prompt"].update(form=form, length=int(length))
config["optim"]["learning_rate"] = float(rate)
config["data"]["packed_dir"] = f"packed-{length}"  # the store is packed for a prompt length
config["output_dir"] = f"run-{name}"
json.dump(config, open(f"{work}/{name}.json", "w"), indent=2)
PY
  began=$(date +%s)
  "$python" -m spds.cli prepare "$work/$name.json" > "$out/$name.log" 2>&1
  "$python" -m spds.cli train "$work/$name.json" >> "$out/$name.log" 2>&1  # a complete run is left as it is
  trained=$(date +%s)
  mkdir -p "$work/run-$name/eval-questions"
  if [ -n "$questions" ] && [ "$questions" != "$work/run-$name/eval-questions" ]; then
    for answers in "$questions"/*/teacher.jsonl; do  # the teacher's answers, once; each store packs its own
      digest=$(basename "$(dirname "$answers")"); mkdir -p "$work/run-$name/eval-questions/$digest"
      cp "$answers" "$work/run-$name/eval-questions/$digest/"
    done
  fi
  "$python" -m spds.cli eval "$work/$name.json" >> "$out/$name.log" 2>&1
  ended=$(date +%s)
  questions="$work/run-$name/eval-questions"
  cp "$work/run-$name/eval.json" "$out/$name-eval.json"; cp "$work/run-$name/samples.md" "$out/$name-samples.md"
  "$python" - "$work/run-$name/eval.json" "$name" "$form" "$length" "$rate" "$((trained - began))" "$((ended - trained))" \
    >> "$out/summary.jsonl" <<'PY'
import json, sys
path, name, form, length, rate, train_s, eval_s = sys.argv[1:]
report = json.load(open(path))
asked = report["questions"]
print(json.dumps(dict(
    name=name, form=form, length=int(length), learning_rate=float(rate),
    held_out_gap=report["gap_recovered"], questions_gap=asked["gap_recovered"],
    keyword_share=asked.get("keyword_share"), rouge_l_soft_vs_context=asked.get("rouge_l_soft_vs_context"),
    train_seconds=int(train_s), eval_seconds=int(eval_s),
)))
PY
  tail -1 "$out/summary.jsonl"
done
[ -z "$made" ] || rm -rf "$work"
