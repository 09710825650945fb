#!/usr/bin/env bash
# On a GPU machine: the tiny example end to end (prepare, smoke, train) on CUDA with Liger, the
# Liger/chunked/fp32 loss agreement, and the whole loop (generate, prepare, smoke, train, eval
# through the training builder, export). Exits non-zero on any failure.
set -euo pipefail
out=${OUT:-/tmp/out}
python3 -c 'import torch, deepspeed, liger_kernel, transformers, peft; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count(), "deepspeed", deepspeed.__version__, "transformers", transformers.__version__)'
python3 bench/checks/check_liger.py
tiny=$(mktemp -d)
python3 examples/tiny/make_tiny.py "$tiny" >/dev/null 2>&1
python3 -m spds.cli validate "$tiny/config.json"
python3 -m spds.cli prepare "$tiny/config.json"
python3 -m spds.cli smoke "$tiny/config.json" 2>&1 | grep -v "^\[" | tail -3
python3 -m spds.cli train "$tiny/config.json" 2>&1 | grep -E "update (1|10|20|30)/|complete|Error|error" | tail -6
python3 -c "import json,sys; r=json.load(open('$tiny/run/run.json')); print('loss kernel', r['loss_kernel'], 'world', r['world_size'])"
cp "$tiny/run/metrics.jsonl" "$out/tiny-metrics.jsonl" 2>/dev/null || true
loop="$tiny/loop.json"
python3 -m spds.cli generate "$loop" 2>&1 | tail -1
python3 -m spds.cli pin "$loop" >/dev/null
python3 -m spds.cli prepare "$loop" | tail -1
python3 -m spds.cli smoke "$loop" 2>&1 | grep -E "spds smoke" || true
python3 -m spds.cli train "$loop" 2>&1 | grep -E "spds train|Error" | tail -2
python3 -m spds.cli eval "$loop" 2>&1 | grep -E "NLL|held-out|Error" | tail -3
python3 -m spds.cli export "$loop" | tail -1
