#!/usr/bin/env bash
# Many nodes from a hostfile ("hostname slots=N" per line, see hostfile.example).
#   launch/multi_node.sh CONFIG HOSTFILE [--verb train|smoke|generate|eval] [--master-addr ADDR] [--port PORT]
#       ssh/pdsh (the deepspeed default): run once, on the first host; it starts every node.
#   launch/multi_node.sh CONFIG HOSTFILE --no-ssh --node-rank R --master-addr ADDR [--port PORT]
#       clusters without ssh: run once on every node, R = that node's line in the hostfile (0-based).
# Environment for the other nodes goes through a .deepspeed_env file written next to the config.
# SIGTERM/SIGINT to this script (on the first node, or on any node with --no-ssh) stop every rank
# of every node at the same update boundary (common.sh).
set -euo pipefail
source "$(dirname "$0")/common.sh"
[ $# -ge 2 ] || die "usage: $0 CONFIG HOSTFILE [--no-ssh --node-rank R] [--master-addr ADDR] [--port PORT] [--verb train|smoke|generate|eval]"
config=$1; hostfile=$2; shift 2
verb=train; port=${MASTER_PORT:-29500}; addr=${MASTER_ADDR:-}; no_ssh=0; node_rank=""
while [ $# -gt 0 ]; do
  case "$1" in
    --verb) verb=$2; shift 2;;
    --port) port=$2; shift 2;;
    --master-addr) addr=$2; shift 2;;
    --no-ssh) no_ssh=1; shift;;
    --node-rank) node_rank=$2; shift 2;;
    *) die "unknown option $1";;
  esac
done
case "$verb" in train|smoke|generate|eval) ;; *) die "--verb must be train, smoke, generate or eval";; esac
spds_check_number --port "$port"
[ -z "$addr" ] || spds_check_host --master-addr "$addr"
[ -z "$node_rank" ] || spds_check_number --node-rank "$node_rank"
spds_check_hostfile "$hostfile"
[ "$no_ssh" = 1 ] || spds_check_launcher_exports
spds_validate "$config"
write_deepspeed_env "$(cd "$(dirname "$config")" && pwd)/.deepspeed_env" "$([ "$no_ssh" = 1 ] || echo --remote)"
args=(--hostfile "$hostfile" --master_port "$port")
[ -n "$addr" ] && args+=(--master_addr "$addr")
if [ "$no_ssh" = 1 ]; then
  [ -n "$node_rank" ] || die "--no-ssh needs --node-rank"
  [ -n "$addr" ] || die "--no-ssh needs --master-addr (the address of the hostfile's first node)"
  args+=(--no_ssh --node_rank "$node_rank")
fi
run_launcher "$verb" env "${spds_launcher_unset[@]}" "$SPDS_DEEPSPEED" "${args[@]}" --module spds.cli "$verb" "$config"
