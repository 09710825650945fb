#!/usr/bin/env bash
# The main job on the tiny example: build it, validate, pin, prepare, smoke, train.
set -euo pipefail
venv=${1:-.venv}; tiny=${2:-examples/tiny/build}
spds="$venv/bin/spds"
rm -rf "$tiny"
echo "== building the tiny example in $tiny (random 2-layer Qwen3 student, byte-level ChatML tokenizer)"
"$venv/bin/python" examples/tiny/make_tiny.py "$tiny" >/dev/null
config="$tiny/config.json"
echo "== spds validate"; "$spds" validate "$config"
echo "== spds pin";      "$spds" pin "$config"
echo "== spds prepare";  "$spds" prepare "$config"
if "$spds" --help | grep -q smoke && [ -f spds/train.py ]; then
  echo "== spds smoke";  "$spds" smoke "$config"
  echo "== spds train";  "$spds" train "$config"
fi
echo "== outputs"
find "$tiny" -maxdepth 2 -not -path '*/student/*' | sort
