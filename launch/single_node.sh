#!/usr/bin/env bash
# One node, N processes through the deepspeed launcher.
#   launch/single_node.sh CONFIG [--gpus N] [--verb train|smoke|generate|eval] [--port PORT]
# N defaults to the number of visible GPUs. The config is validated first; nothing is launched
# if it fails. SIGTERM/SIGINT to this script stop every rank at an update boundary (common.sh).
set -euo pipefail
source "$(dirname "$0")/common.sh"
[ $# -ge 1 ] || die "usage: $0 CONFIG [--gpus N] [--verb train|smoke|generate|eval] [--port PORT]"
config=$1; shift
gpus=""; verb=train; port=${MASTER_PORT:-29500}
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) gpus=$2; shift 2;;
    --verb) verb=$2; shift 2;;
    --port) port=$2; shift 2;;
    *) die "unknown option $1";;
  esac
done
[ -n "$gpus" ] || gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
[ "$gpus" -ge 1 ] 2>/dev/null || die "no GPU found: pass --gpus N (with DS_ACCELERATOR=cpu for CPU processes)"
case "$verb" in train|smoke|generate|eval) ;; *) die "--verb must be train, smoke, generate or eval";; esac
spds_check_number --port "$port"
spds_check_number --gpus "$gpus"
spds_validate "$config"
run_launcher "$verb" "$SPDS_DEEPSPEED" --num_gpus "$gpus" --master_port "$port" --module spds.cli "$verb" "$config"
