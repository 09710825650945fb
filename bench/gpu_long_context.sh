#!/usr/bin/env bash
# Issue 54: the main job at the users' shape on one GPU. A random-weight Qwen3 shape
# (bench/make_synthetic.py; its window 131,072) as student and teacher, the byte-level tokenizer
# (259 ids against the model's 151,936 output rows: the decoder's mask of the padded rows), and a
# fact-sheet-like context of CONTEXTS tokens (lines of ~80 tokens).
#   bash bench/gpu_long_context.sh MODEL OUT [decode] [generate] [pipeline]
#   decode:   the decode step of ROWS rows after each context (bench/profile_decode.py: the shared
#             part in one run of keys, then split), against bench/decode_bound.py's roofline
#   generate: spds generate's self-study with the default kinds (every kind), CONVERSATIONS
#             conversations, chunk_tokens 512, max_new_tokens 256, batch 256, top-20, per context
#   pipeline: generate -> prepare -> smoke -> train (UPDATES updates of 128, the GPU recipe) ->
#             eval with QUESTIONS questions training never asked, each phase's seconds and peak
#             GPU memory, at the first context
# Writes OUT/*.log and OUT/summary.jsonl as each step ends.
set -uo pipefail
model=$1; out=$2; shift 2
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(decode generate)
CONTEXTS=${CONTEXTS:-32600 65200} ROWS=${ROWS:-256} CONVERSATIONS=${CONVERSATIONS:-256}
UPDATES=${UPDATES:-8} QUESTIONS=${QUESTIONS:-200} STEPS=${STEPS:-160}
DECODE_CONTEXTS=${DECODE_CONTEXTS:-$CONTEXTS}
mkdir -p "$out"
work=/tmp/spds-long; mkdir -p "$work"
if [ ! -f "$work/$model/student/config.json" ]; then
  python3 bench/make_synthetic.py "$work/$model" --model "$model" --records 4 --min-tokens 256 --max-tokens 512 | tail -1
fi
dir="$work/$model"
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -qi h100 && echo h100 || echo h200)
say() { echo "$*" | tee -a "$out/summary.jsonl"; }

for context in $CONTEXTS; do
  python3 - "$dir" "$context" "$CONVERSATIONS" "$QUESTIONS" <<'PY'
import json, sys
from pathlib import Path
directory, tokens, conversations, questions = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
subjects = ["harbor", "orchard", "glacier", "library", "meadow", "comet", "violin", "lantern", "river", "mountain"]
lines, i = [], 0
while sum(map(len, lines)) < tokens:  # byte-level: a character is a token
    lines.append(f"{i}. The {subjects[i % 10]} of wing {i} keeps ledger {7 * i} in drawer {i % 97}, catalogued {1900 + i % 120}.\n")
    i += 1
(directory / f"context-{tokens}.md").write_text("".join(lines)[:tokens])
with open(directory / f"questions-{tokens}.jsonl", "w") as stream:
    for q in range(questions):
        stream.write(json.dumps({"question_id": f"q{q}", "question": f"Which drawer holds ledger {7 * q}?", "keyword": str(q % 97)}) + "\n")
config = json.loads((directory / "config.json").read_text())
config["student"].update(liger_kernels=True, dtype="bfloat16")
config["context"] = {"file": f"context-{tokens}.md"}
config["soft_prompt"] = {"length": 128, "placement": "system", "init": {"method": "context"}}
config["generate"] = {"self_study": {"conversations": conversations, "chunk_tokens": 512}, "output": f"rows-{tokens}.jsonl",
                      "max_new_tokens": 256, "batch_size": 256, "top_k_logprobs": 20}
config["data"] = {"candidates": [{"path": f"rows-{tokens}.jsonl"}], "packed_dir": f"packed-{tokens}", "eval_fraction": 0.1}
config["loss"] = {"objective": "mix", "teacher": "top_k"}
config["optim"] = {"updates": 128, "effective_batch": 128, "micro_batch": 32, "learning_rate": 0.1, "warmup_updates": 8,
                   "schedule": "cosine", "seed": 0}
config["checkpoint"] = {"every": 1000, "keep_last": 1}
config["eval"] = {"questions": f"questions-{tokens}.jsonl", "question_samples": 1, "max_new_tokens": 32, "samples": 0,
                  "max_records": 16}
config["output_dir"] = f"run-{tokens}"
(directory / f"config-{tokens}.json").write_text(json.dumps(config, indent=2))
PY
done

for step in "${steps[@]}"; do
  case "$step" in
    decode)
      for context in $DECODE_CONTEXTS; do
        CONTEXT=$context python3 bench/profile_decode.py "$dir/student" "$ROWS" "$STEPS" liger,split \
          > "$out/decode-$model-$context.log" 2>&1
        grep -E "ms a step|same tokens" "$out/decode-$model-$context.log"
        python3 bench/decode_bound.py "$dir/student/config.json" --batch "$ROWS" --context "$((context + 40))" --own 100 --device "$device" \
          | tee -a "$out/decode-$model-$context.log" | tail -3
      done
      ;;
    generate)
      for context in $CONTEXTS; do
        rm -f "$dir/rows-$context.jsonl"; rm -rf "$dir/.rows-$context.jsonl.batches"
        began=$(date +%s.%N)
        python3 -m spds.cli generate "$dir/config-$context.json" > "$out/generate-$model-$context.log" 2>&1
        status=$?
        ended=$(date +%s.%N)
        grep -E "^(start-up|wrote|[0-9.]+ s for|chunks)" "$out/generate-$model-$context.log"
        tail -3 "$out/generate-$model-$context.log" | grep -i error
        say "{\"step\": \"generate\", \"model\": \"$model\", \"context\": $context, \"exit\": $status, \"seconds\": $(python3 -c "print(round($ended - $began, 1))")}"
      done
      ;;
    pipeline)
      context=${CONTEXTS%% *}
      config="$dir/config-$context.json"
      python3 - "$config" "$UPDATES" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["optim"]["updates"] = int(sys.argv[2]); c["optim"]["warmup_updates"] = 1
c["train"] = {"require_smoke": True}
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
      for verb in generate prepare smoke train eval; do
        began=$(date +%s.%N)
        python3 bench/peak.py python3 -m spds.cli "$verb" "$config" > "$out/pipeline-$model-$verb.log" 2>&1
        status=$?
        ended=$(date +%s.%N)
        peak=$(grep -oE "peak GPU memory [0-9.]+ GiB" "$out/pipeline-$model-$verb.log" | tail -1)
        say "{\"step\": \"$verb\", \"model\": \"$model\", \"context\": $context, \"exit\": $status, \"seconds\": $(python3 -c "print(round($ended - $began, 1))"), \"peak\": \"$peak\"}"
        grep -E "^(wrote|NLL|eval.questions|greedy|held-out|\{)" "$out/pipeline-$model-$verb.log" | head -8
        [ "$status" = 0 ] || { tail -20 "$out/pipeline-$model-$verb.log"; break; }
      done
      ;;
  esac
done
