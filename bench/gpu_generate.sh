#!/usr/bin/env bash
# Issue 32, goal 1: how fast `spds generate` writes the teacher's rows today, against the memory
# bandwidth bound of decoding at that batch. A random-weight Qwen3-shaped student saved with
# save_pretrained (bench/make_synthetic.py) is the teacher; a context of CONTEXT_TOKENS tokens;
# QUESTIONS questions x SAMPLES samples, MAX_NEW tokens each, sampling at temperature 1 (random
# weights rarely sample the end token, so every response runs to MAX_NEW).
#   bash bench/gpu_generate.sh 1.7b [8b ...]
#   QUESTIONS=32 SAMPLES=4 MAX_NEW=512 BATCH=16 CONTEXT_TOKENS=4096 LIGER=0 TOPK=0 (the defaults;
#   LIGER=1: student.liger_kernels true, the teacher decoding on Liger's kernels; TOPK=20: every row
#   also carries the teacher's top-20 log-probabilities, generate.top_k_logprobs)
set -euo pipefail
QUESTIONS=${QUESTIONS:-32} SAMPLES=${SAMPLES:-4} MAX_NEW=${MAX_NEW:-512} BATCH=${BATCH:-16}
CONTEXT_TOKENS=${CONTEXT_TOKENS:-4096} LIGER=${LIGER:-0} TOPK=${TOPK:-0}
export QUESTIONS SAMPLES MAX_NEW BATCH CONTEXT_TOKENS LIGER TOPK
for model in "$@"; do
  work=$(mktemp -d)
  python3 bench/make_synthetic.py "$work" --model "$model" --records 2 --min-tokens 256 --max-tokens 512 | tail -1
  python3 - "$work" <<'PY'
import json, os, sys
from pathlib import Path
work = Path(sys.argv[1])
c = json.loads((work / "config.json").read_text())
words = "the archive keeps every record in the order it was written and names its source "
c["context"] = {"text": (words * (int(os.environ["CONTEXT_TOKENS"]) // len(words) + 1))[:int(os.environ["CONTEXT_TOKENS"])]}
with open(work / "questions.jsonl", "w") as stream:
    for i in range(int(os.environ["QUESTIONS"])):
        stream.write(json.dumps(dict(question_id=f"q{i}", question=f"What does entry {i} of the archive say?")) + "\n")
c["generate"] = dict(questions="questions.jsonl", output="generated.jsonl", samples_per_question=int(os.environ["SAMPLES"]),
                     temperature=1.0, top_p=1.0, max_new_tokens=int(os.environ["MAX_NEW"]),
                     batch_size=int(os.environ["BATCH"]), seed=0, top_k_logprobs=int(os.environ["TOPK"]))
c["student"]["liger_kernels"] = os.environ["LIGER"] == "1"
(work / "config.json").write_text(json.dumps(c, indent=2))
PY
  began=$(date +%s.%N)
  python3 -m spds.cli generate "$work/config.json" 2>&1 | grep -E "^(start-up|wrote|[0-9.]+ s for)"
  ended=$(date +%s.%N)
  python3 - "$work" "$model" "$began" "$ended" <<'PY'
import json, os, sys
from pathlib import Path
work, model, began, ended = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
rows = [json.loads(line) for line in open(work / "generated.jsonl")]
new = sum(row["supervised_tokens"] for row in rows)
sys.path.insert(0, "bench")
from decode_bound import shape_of, step_bounds
batch, context = int(os.environ["BATCH"]), int(os.environ["CONTEXT_TOKENS"]) + 40  # + the template and the question
own = 40 + int(os.environ["MAX_NEW"]) / 2  # a row's own positions each decode step reads, on average (question, answer)
# bench/decode_bound.py: the bytes a step must read (the weights, the shared context's keys and
# values once, each row's own) over the bandwidth; and the roofline, each part at the slower of bytes and FLOPs
bounds = step_bounds(shape_of(str(work / "student" / "config.json")), batch, context, own)
bound, roofline = batch / bounds["bandwidth"], batch / bounds["roofline"]
seconds = ended - began
print(json.dumps(dict(model=model, rows=len(rows), new_tokens=new, seconds=round(seconds, 1),
                      rows_per_second=round(len(rows) / seconds, 3), new_tokens_per_second=round(new / seconds, 1),
                      batch=batch, context_tokens=context, bandwidth_bound_tokens_per_second=round(bound),
                      fraction_of_bound=round(new / seconds / bound, 3), roofline_tokens_per_second=round(roofline),
                      fraction_of_roofline=round(new / seconds / roofline, 3))))
PY
  rm -rf "$work"
done
