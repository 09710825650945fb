#!/usr/bin/env bash
# nvidia-h200-x2 (issue 12): the preemption a container runtime or `kill PID` makes. SIGTERM goes
# to launch/single_node.sh's PID only (never to a rank), mid-run; the ranks must stop at an update
# boundary with a committed checkpoint, nothing may outlive the launch, and the resumed run must
# equal a straight run bit for bit (train.deterministic: true). Then the clip that DeepSpeed used
# to apply by default: grad_norm logged vs applied, checked from the checkpoints.
#   bash bench/gpu_x2_sigterm.sh        (env: SPDS_X2_MODEL, SPDS_X2_MAX_TOKENS, SPDS_X2_LONGEST (one record of
#                                        exactly that many tokens), SPDS_X2_GPUS (default 2),
#                                        SPDS_X2_STUDENT, SPDS_X2_OPTIM (JSON merged into the config's
#                                        student and optim), UPDATES, SKIP_SMOKE=1)
set -euo pipefail
out=${OUT:-/tmp/out}; work=$(mktemp -d); mkdir -p "$out"
updates=${UPDATES:-12}
python3 bench/make_synthetic.py "$work" --model "${SPDS_X2_MODEL:-0.6b}" --records 32 \
  --max-tokens "${SPDS_X2_MAX_TOKENS:-4096}" ${SPDS_X2_LONGEST:+--longest "$SPDS_X2_LONGEST"} 2>&1 | tail -1
gpus=${SPDS_X2_GPUS:-2}
cfg="$work/config.json"
python3 - "$cfg" "$updates" <<'PY'
import json, os, sys
c = json.load(open(sys.argv[1]))
c["optim"].update(updates=int(sys.argv[2]), max_grad_norm=1000.0)
c["checkpoint"].update(every=100)
for section in ("student", "optim"):  # e.g. the attention kernel or the micro-batch layout under test
    c[section].update(json.loads(os.environ.get(f"SPDS_X2_{section.upper()}", "{}")))
if os.environ.get("SKIP_SMOKE") == "1":  # the smoke gate is tested elsewhere; here only stop and resume
    c["train"]["require_smoke"] = False
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
python3 -m spds.cli prepare "$cfg" | tail -1
set_output() { python3 - "$cfg" "$1" <<'PY'
import json, sys; c = json.load(open(sys.argv[1])); c["output_dir"] = sys.argv[2]; json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
}
launch() { bash launch/single_node.sh "$cfg" --gpus "$gpus" --port $((29500 + RANDOM % 1000)) "$@"; }
quiet() { grep -E "^update|spds (smoke|train)|launch:|Error|error" | grep -v Warning || true; }
set_output straight
[ "${SKIP_SMOKE:-0}" = 1 ] || { echo "== smoke ($gpus GPUs)"; launch --verb smoke 2>&1 | quiet | tail -3; }
echo "== straight run, $updates updates"; launch 2>&1 | quiet | tail -3
set_output stopped
[ "${SKIP_SMOKE:-0}" = 1 ] || { echo "== smoke ($gpus GPUs)"; launch --verb smoke 2>&1 | quiet | tail -1; }
echo "== the same run; SIGTERM to the launch script's PID after update 4"
bash launch/single_node.sh "$cfg" --gpus "$gpus" --port $((29500 + RANDOM % 1000)) > "$work/stopped.log" 2>&1 &
script_pid=$!  # the script's own PID (a shell function here would put a subshell in between)
until [ -f "$work/stopped/metrics.jsonl" ] && [ "$(wc -l < "$work/stopped/metrics.jsonl")" -ge 4 ]; do
  kill -0 "$script_pid" 2>/dev/null || { echo "launch ended early"; tail -20 "$work/stopped.log"; exit 1; }
  sleep 0.2
done
signalled=$(date +%s.%N)
kill -TERM "$script_pid"
status=0; wait "$script_pid" || status=$?
ended=$(date +%s.%N)
echo "launch script exit status $status after $(python3 -c "print(round($ended - $signalled, 1))") s"
quiet < "$work/stopped.log" | tail -4
echo "terminal.json: $(cat "$work/stopped/terminal.json")"
echo "spds processes left: $( (pgrep -f 'spds.cli' || true) | wc -l)"
echo "== resume"; launch 2>&1 | quiet | tail -2
python3 - "$work" <<'PY'
import json, sys, torch
from pathlib import Path
work = Path(sys.argv[1])
def final(name):
    d = sorted(p for p in (work / name / "checkpoints").glob("update-*") if (p / "commit.json").exists())[-1]
    s = torch.load(d / "mp_rank_00_model_states.pt", weights_only=True)
    return d.name, s["module"]["prompt"], s["optimizer"]["state"][0]
a, b = final("stopped"), final("straight")
print("checkpoints", a[0], b[0])
print("resumed vs straight: prompt bit-identical", torch.equal(a[1], b[1]),
      "exp_avg", torch.equal(a[2]["exp_avg"], b[2]["exp_avg"]), "exp_avg_sq", torch.equal(a[2]["exp_avg_sq"], b[2]["exp_avg_sq"]),
      "max |diff|", float((a[1] - b[1]).abs().max()))
lengths = [len(json.loads(l)["input_ids"]) for l in open(work / "candidates.jsonl")]
print("longest candidate", max(lengths), "tokens; records", len(lengths))
for name in ("straight", "stopped"):
    lines = [json.loads(l) for l in open(work / name / "metrics.jsonl")]
    print(name, "updates", [m["update"] for m in lines], "longest record positions",
          [m["longest_record_positions"] for m in lines], "peak GiB", [round(m["peak_memory_bytes"] / 2**30, 1) for m in lines])
    print(name, "grad norms", [round(m["grad_norm"], 3) for m in lines[:4]],
          "median s/update", sorted(m["seconds"] for m in lines)[len(lines) // 2])
PY
cp "$work/stopped.log" "$out/x2-sigterm-stopped.log"
cp "$work/stopped/metrics.jsonl" "$out/x2-sigterm-resumed-metrics.jsonl"
cp "$work/straight/metrics.jsonl" "$out/x2-sigterm-straight-metrics.jsonl"
