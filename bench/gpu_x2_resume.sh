#!/usr/bin/env bash
# nvidia-h200-x2: smoke, then train 10 updates on 2 GPUs with a SIGTERM (to rank 1) before update
# 6, resume to the end; a straight 2-GPU run and a 1-GPU run of the same updates; compare prompts.
set -euo pipefail
out=${OUT:-/tmp/out}; work=$(mktemp -d)
python3 bench/make_synthetic.py "$work" --model ${SPDS_X2_MODEL:-0.6b} --records 32 --max-tokens ${SPDS_X2_MAX_TOKENS:-8192} 2>&1 | tail -1
cfg="$work/config.json"
python3 -m spds.cli prepare "$cfg"
run() { local dir=$1 gpus=$2; shift 2
  python3 - "$cfg" "$dir" <<'PY'
import json, sys; c = json.load(open(sys.argv[1])); c["output_dir"] = sys.argv[2]; json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
  env "$@" bash launch/single_node.sh "$cfg" --gpus "$gpus" --port $((29500 + RANDOM % 1000)) ${VERB:+--verb $VERB} 2>&1 \
    | grep -E "^update|spds (smoke|train)|Error|error" | grep -v Warning | tail -14 || true
}
echo "== smoke (2 GPUs)"; VERB=smoke run run-a 2 X=1
echo "== train, SIGTERM to rank 1 before update 6"; run run-a 2 SPDS_FAULT=sigterm-before-update-rank1:6
cat "$work/run-a/terminal.json"
echo "== resume"; run run-a 2 X=1
echo "== straight 2-GPU run"; VERB=smoke run run-b 2 X=1; run run-b 2 X=1
if [ -z "${SKIP_ONE_GPU:-}" ]; then echo "== 1-GPU run"; VERB=smoke run run-c 1 X=1; run run-c 1 X=1; else cp -r "$work/run-b" "$work/run-c"; fi
python3 - "$work" <<'PY'
import json, sys, torch
from pathlib import Path
work = Path(sys.argv[1])
def state(name):
    d = sorted(p for p in (work / name / "checkpoints").glob("update-*") if (p / "commit.json").exists())[-1]
    s = torch.load(d / "mp_rank_00_model_states.pt", weights_only=True)
    return d.name, s["module"]["prompt"].float(), s["optimizer"]["state"][0]["exp_avg"]
a, b, c = state("run-a"), state("run-b"), state("run-c")
print("checkpoints", a[0], b[0], c[0])
print("resumed vs straight (2 GPUs): prompt bit-identical", torch.equal(a[1], b[1]), "exp_avg bit-identical", torch.equal(a[2], b[2]),
      "max |diff|", float((a[1] - b[1]).abs().max()))
print("2 GPUs vs 1 GPU: max |diff| prompt", float((b[1] - c[1]).abs().max()), "relative", float((b[1] - c[1]).norm() / c[1].norm()))
for name in ("run-a", "run-b", "run-c"):
    lines = [json.loads(l) for l in open(work / name / "metrics.jsonl")]
    run = json.load(open(work / name / "run.json"))
    print(name, "world", run["world_size"], "start", run["start_update"], "updates", [m["update"] for m in lines][-3:],
          "tokens/s (all ranks, median)", sorted(m["tokens_per_second"] for m in lines)[len(lines) // 2],
          "peak GiB", round(max(m["peak_memory_bytes"] for m in lines) / 2**30, 1), "last loss", round(lines[-1]["loss"], 5))
PY
cp -r "$work"/run-a/metrics.jsonl "$out/x2-resumed-metrics.jsonl"; cp "$work"/run-b/metrics.jsonl "$out/x2-straight-metrics.jsonl"; cp "$work"/run-c/metrics.jsonl "$out/x1-metrics.jsonl"
