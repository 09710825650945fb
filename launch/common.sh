# Shared by the launch scripts (sourced, not run).
#
# Stopping. A launch script runs the launcher as a child, in a process group of its own, and
# turns SIGTERM or SIGINT to itself (a container runtime's stop, `kill PID`, Ctrl-C, SLURM's
# --signal=B:TERM) into a stop request: `spds stop CONFIG` writes <output_dir>/stop-request.json,
# rank 0 reads it at the next update boundary, every rank (on every node) stops after the same
# update with a committed checkpoint, the launchers exit 0, and so does this script. Nothing
# signals the launchers themselves: the deepspeed launcher on one node has no SIGTERM handler
# (its ranks would run on, orphaned), and DeepSpeed's launch.py and torchrun kill ranks that
# have not exited 30 s after they forwarded a signal, whatever the update in flight.
# The grace time a preemption must allow: one update plus one checkpoint save (metrics.jsonl
# shows `seconds` per update). A second signal forwards SIGTERM to the launcher's whole process
# group at once (the launchers then kill the ranks 30 s later).
# SPDS_PYTHON: the interpreter with spds installed (default: .venv/bin/python of this checkout,
# else python3). The deepspeed launcher used is the one installed next to it.
spds_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SPDS_PYTHON=${SPDS_PYTHON:-$( [ -x "$spds_root/.venv/bin/python" ] && echo "$spds_root/.venv/bin/python" || command -v python3 )}
SPDS_DEEPSPEED="$(dirname "$SPDS_PYTHON")/deepspeed"
[ -x "$SPDS_DEEPSPEED" ] || SPDS_DEEPSPEED=$(command -v deepspeed)

die() { echo "launch: $*" >&2; exit 1; }

# Contracts gate every launch: the config, its DeepSpeed config and every pinned input.
spds_validate() {
  "$SPDS_PYTHON" -m spds.cli validate "$1" || die "spds validate refused $1: nothing was launched"
}

# Variables the ranks on other nodes must see. The deepspeed launcher reads KEY=VALUE lines from
# the file named by DS_ENV_FILE and crashes on a blank line or a comment, so write exactly that.
SPDS_ENV_PREFIXES=${SPDS_ENV_PREFIXES:-"PYTHONPATH DS_ACCELERATOR NCCL_ HF_ TRANSFORMERS_ TOKENIZERS_ OMP_NUM_THREADS CUDA_DEVICE_MAX_CONNECTIONS TORCH_ SPDS_"}
write_deepspeed_env() {
  local file=$1 tmp name prefix
  tmp=$(mktemp "$file.XXXXXX")
  while IFS= read -r name; do
    for prefix in $SPDS_ENV_PREFIXES; do
      case "$name" in
        "$prefix"*)
          local value=${!name}
          case "$value" in *$'\n'*) die "environment variable $name holds a newline; the deepspeed launcher cannot pass it";; esac
          [ -n "$value" ] && printf '%s=%s\n' "$name" "$value" >> "$tmp"
          break;;
      esac
    done
  done < <(compgen -e | sort)
  mv "$tmp" "$file"
  export DS_ENV_FILE="$file"
}

# A stop request older than this moment is stale (spds/stop.py); exported before anything is
# launched, through .deepspeed_env to the other nodes too.
SPDS_LAUNCH_STARTED=${SPDS_LAUNCH_STARTED:-$(date +%s.%N)}
export SPDS_LAUNCH_STARTED
spds_config=""; spds_child=""; spds_signals=0

spds_on_signal() {
  spds_signals=$((spds_signals + 1))
  if [ -z "$spds_child" ]; then
    echo "launch: $1 before anything was launched: nothing launched" >&2
    exit 143
  elif [ "$spds_signals" = 1 ]; then
    echo "launch: $1: every rank stops after the update in flight, with a checkpoint (a second signal stops them now)" >&2
    "$SPDS_PYTHON" -m spds.cli stop "$spds_config" --why "$1 to $(basename "$0") (pid $$)" >&2 || true
  else
    echo "launch: $1 again: forwarding SIGTERM to every process of the launch" >&2
    kill -TERM -- "-$spds_child" 2>/dev/null || true
  fi
}
trap 'spds_on_signal SIGTERM' TERM
trap 'spds_on_signal SIGINT' INT

# run_launcher CONFIG COMMAND...: run COMMAND in its own process group, wait for it (through any
# number of signals), return its exit status.
run_launcher() {
  spds_config=$1; shift
  setsid "$@" &
  spds_child=$!
  local status=0
  while :; do
    wait "$spds_child" && status=0 || status=$?
    kill -0 "$spds_child" 2>/dev/null || break  # a signal interrupted the wait: the launch goes on
  done
  return "$status"
}
