#!/usr/bin/env bash
# nvidia-h200-x2: a Qwen3-14B-shaped random student (27.5 GiB of bf16 weights) on GPUs capped at
# CAP GiB each (bench/capped.py): ZeRO-0 cannot hold it; ZeRO-3 and FSDP2 shard it and train.
# ZeRO-0 uncapped is the reference on the same model. Prints tokens/s per GPU and peak GiB per GPU.
set -uo pipefail
out=${OUT:-/tmp/out}; work=${SPDS_WORK:-$(mktemp -d)}; cap=${CAP:-30}; model=${SPDS_SHARDED_MODEL:-14b}
[ -f "$work/config.json" ] || python3 bench/make_synthetic.py "$work" --model "$model" --records 32 --max-tokens 8192 2>&1 | tail -1
python3 - "$work/config.json" <<PY
import json, sys
c = json.load(open(sys.argv[1]))
c["optim"].update(updates=${UPDATES:-6}, effective_batch=8)
c["train"] = {"require_smoke": False, "deterministic": False}
c["checkpoint"] = {"every": 3, "keep_last": 2}
c["student"]["activation_memory_gib"] = 4  # the cap hides from free-memory probing: say the budget
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
python3 -m spds.cli prepare "$work/config.json" | tail -1
run() { local name=$1 gib=$2; shift 2
  python3 - "$work/config.json" "$work/$name" "$@" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["output_dir"] = sys.argv[2]
c["sharding"], c["deepspeed_config"] = sys.argv[3], sys.argv[4]
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
  echo "== $name (cap ${gib} GiB per GPU)"; local began=$SECONDS
  torchrun --nproc_per_node 2 --master_port $((29500 + RANDOM % 1000)) bench/capped.py "$gib" train "$work/config.json" \
    > "$work/$name.log" 2>&1; echo "exit $? after $((SECONDS - began)) s"
  grep -E "^spds|Error|error:|File .*/spds/" "$work/$name.log" | grep -v Warning | tail -12
}
case " ${BACKENDS-zero3 fsdp} " in *" zero3 "*) run zero3 "$cap" deepspeed ds_configs/zero3.json;; esac
case " ${BACKENDS-zero3 fsdp} " in *" fsdp "*) run fsdp "$cap" fsdp ds_configs/zero0.json;; esac
if [ -z "${SKIP_ZERO0:-}" ]; then
  run zero0-capped "$cap" deepspeed ds_configs/zero0.json
  run zero0 139 deepspeed ds_configs/zero0.json
fi
python3 - "$work" <<'PY'
import json, sys, torch
from pathlib import Path
work = Path(sys.argv[1])
prompts = {}
for name in ("zero0", "zero3", "fsdp", "zero0-capped"):
    metrics = work / name / "metrics.jsonl"
    if not metrics.exists():
        print(f"{name}: no metrics (did not train)"); continue
    lines = [json.loads(l) for l in open(metrics)]
    steady = lines[1:] or lines  # the first update builds kernels and plans
    d = sorted(p for p in (work / name / "checkpoints").glob("update-*") if (p / "commit.json").exists())[-1]
    prompts[name] = torch.load(d / "mp_rank_00_model_states.pt", weights_only=True)["module"]["prompt"].float()
    print(f"{name}: updates {len(lines)}  tokens/s per GPU (updates 2.., global tokens / time / 2) "
          f"{sum(m['tokens'] for m in steady) / sum(m['seconds'] for m in steady) / 2:,.0f}  "
          f"peak GiB (rank 0) {max(m['peak_memory_bytes'] for m in lines) / 2**30:.1f}  last loss {lines[-1]['loss']:.5f}")
for name in ("zero3", "fsdp"):
    if name in prompts and "zero0" in prompts:
        diff = prompts[name] - prompts["zero0"]
        print(f"{name} vs zero0 after {len(lines)} updates: prompt max |diff| {float(diff.abs().max()):.3g}, "
              f"relative {float(diff.norm() / prompts['zero0'].norm()):.3g}, bit-identical {torch.equal(prompts[name], prompts['zero0'])}")
PY
for name in zero0 zero3 fsdp; do [ -f "$work/$name/metrics.jsonl" ] && cp "$work/$name/metrics.jsonl" "$out/sharded-$name-metrics.jsonl"; done
[ -f "$work/zero0-capped.log" ] && tail -c 3000 "$work/zero0-capped.log" > "$out/sharded-zero0-capped.log"
