#!/usr/bin/env bash
# Issue 54: what spreading spds generate over ranks costs, measured on CPU so that N GPUs can be
# projected: the tiny example's student as its own teacher, a CONTEXT-token context, QUESTIONS
# questions in batches of BATCH, MAX_NEW new tokens each; one rank, then RANKS ranks under torchrun
# (one thread each). Prints each run's wall time and rank 0's split: decoding, writing and appending
# the batch files, waiting for the other ranks at the end; and checks the outputs are the same bytes.
#   bash bench/generate_ranks_cpu.sh [PYTHON]
set -euo pipefail
python=${1:-.venv/bin/python}
CONTEXT=${CONTEXT:-2000} QUESTIONS=${QUESTIONS:-256} BATCH=${BATCH:-16} MAX_NEW=${MAX_NEW:-96} RANKS=${RANKS:-2} TOPK=${TOPK:-20}
work=$(mktemp -d)
"$python" examples/tiny/make_tiny.py "$work" > /dev/null
"$python" - "$work" "$CONTEXT" "$QUESTIONS" "$BATCH" "$MAX_NEW" "$TOPK" <<'PY'
import json, sys
from pathlib import Path
work, context, questions, batch, new, topk = Path(sys.argv[1]), *map(int, sys.argv[2:])
line = "The archive keeps ledger {i} in drawer {d}.\n"
text = "".join(line.format(i=i, d=i % 97) for i in range(context // 30 + 1))[:context]
(work / "context.md").write_text(text)
with open(work / "questions.jsonl", "w") as stream:
    for q in range(questions):
        stream.write(json.dumps({"question_id": f"q{q}", "question": f"Which drawer holds ledger {q}?"}) + "\n")
c = json.loads((work / "config.json").read_text())
c["student"]["model_path"] = str(work / "student")
c["context"] = {"file": "context.md"}
c["generate"] = {"questions": "questions.jsonl", "output": "rows.jsonl", "batch_size": batch, "max_new_tokens": new,
                 "temperature": 1.0, "top_k_logprobs": topk}
(work / "config.json").write_text(json.dumps(c))
PY
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
for world in 1 "$RANKS"; do
  rm -f "$work/rows.jsonl"
  began=$(date +%s.%N)
  if [ "$world" = 1 ]; then
    "$python" -m spds.cli generate "$work/config.json" > "$work/log" 2>&1
  else
    "$python" -m torch.distributed.run --nproc_per_node "$world" -m spds.cli generate "$work/config.json" > "$work/log" 2>&1
  fi
  ended=$(date +%s.%N)
  echo "ranks $world: $("$python" -c "print(round($ended - $began, 1))") s wall"
  grep -E "^(start-up|wrote|[0-9.]+ s for)" "$work/log" | sed 's/^/  /'
  echo "  output $(du -m "$work/rows.jsonl" | cut -f1) MiB"
  cp "$work/rows.jsonl" "$work/rows-$world.jsonl"
done
cmp "$work/rows-1.jsonl" "$work/rows-$RANKS.jsonl" && echo "the $RANKS-rank output is the 1-rank output, byte for byte"
rm -rf "$work"
