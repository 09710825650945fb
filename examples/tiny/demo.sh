#!/usr/bin/env bash
# The main job on the tiny example, on CPU: build it, then the whole distillation loop
#   validate -> generate (teacher answers with the context) -> pin -> prepare -> smoke -> train
#   -> eval (floor / ceiling / soft NLL on held-out questions) -> export
set -euo pipefail
venv=${1:-.venv}; tiny=${2:-examples/tiny/build}
spds="$venv/bin/spds"
export TOKENIZERS_PARALLELISM=false
rm -rf "$tiny"
echo "== building the tiny example in $tiny (random 2-layer Qwen3 student, byte-level ChatML tokenizer)"
"$venv/bin/python" examples/tiny/make_tiny.py "$tiny" >/dev/null 2>&1
config="$tiny/loop.json"
# stderr filtered in the same pipeline, not a process substitution: every line is shown before
# the next step starts (a substitution's lines came after the next step's header)
quiet() { { "$@" 2>&1 1>&3 3>&- | { grep --line-buffered -vE "Loading weights|Writing model|warn|Warn|^\s*$" || true; } >&2; } 3>&1; }
echo "== spds generate  (the teacher, here the student itself, answers 32 questions x 2 samples with the context)"
quiet "$spds" generate "$config"
echo "== spds pin";      quiet "$spds" pin "$config"
echo "== spds validate"; quiet "$spds" validate "$config"
echo "== spds prepare";  quiet "$spds" prepare "$config"
echo "== spds smoke";    quiet "$spds" smoke "$config" | tail -2
echo "== spds train";    quiet "$spds" train "$config" | grep -E "^update (1|5|10|15|20|25|30)/|spds train"
echo "== spds eval (the student has random weights: read the NLL line; its sample answers are noise)"
quiet "$spds" eval "$config"
echo "== spds export";   quiet "$spds" export "$config"
echo "== outputs"
find "$tiny/loop-run" -maxdepth 2 -not -path '*/checkpoints/*' -not -path '*/smoke/*' | sort
