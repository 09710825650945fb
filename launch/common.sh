# Shared by the launch scripts (sourced, not run).
#
# Verbs: train and smoke, and generate and eval (every rank takes a share of the batches or
# records; spds/generation/batches.py, spds/trained/evaluate.py).
#
# Stopping. A launch script runs the launcher as a child, in a process group of its own, and
# turns SIGTERM or SIGINT to itself (a container runtime's stop, `kill PID`, Ctrl-C, SLURM's
# --signal=B:TERM) into a stop request: `spds stop CONFIG` writes <output_dir>/stop-request.json,
# rank 0 reads it at the next update boundary, every rank (on every node) stops after the same
# update with a committed checkpoint, the launchers exit 0, and so does this script. generate's
# ranks each read it after every batch (each batch is whole on disk: the rerun completes it). Nothing
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

# Contracts gate every launch: the config, its DeepSpeed config and every pinned input. The run's
# output directory is fixed here, at launch: a stop request goes there even if the config is
# edited or moved while the run goes on (the ranks read it once, at their start).
spds_output_dir=""
spds_validate() {
  spds_output_dir=$("$SPDS_PYTHON" -m spds.cli validate --print-output-dir "$1") ||
    die "spds validate refused $1: nothing was launched"
}

# Values that may travel on a command line to a remote shell: the deepspeed launcher's pdsh
# runner writes `export K=V;` into the command it sends (wrapping V in double quotes, inside
# which $(...) and backquotes still run). Anything else is refused, naming the variable.
spds_safe() { [[ "$1" =~ ^[A-Za-z0-9_@%+=:,./-]*$ ]]; }
spds_require_safe() {  # NAME VALUE WHAT
  spds_safe "$2" || die "$1 ($3) holds characters a remote shell would interpret: $(printf %q "$2")"
}

# Variables the ranks on other nodes must see. They never travel on a command line (visible in
# `ps` on every node, and interpreted by the remote shell): they go into a file readable by the
# user only, beside the config (a file system every node shares), and the ranks load it first
# thing (spds.cli: SPDS_ENV_FILE). Only the file's path and PYTHONPATH (needed before Python
# starts) go through .deepspeed_env, the KEY=VALUE file the deepspeed launcher reads (it crashes
# on blank lines and comments: none are written).
SPDS_ENV_PREFIXES=${SPDS_ENV_PREFIXES:-"DS_ACCELERATOR NCCL_ UCX_ MV2_ MLFLOW_ HF_ TRANSFORMERS_ TOKENIZERS_ OMP_NUM_THREADS CUDA_DEVICE_MAX_CONNECTIONS TORCH_ SPDS_"}
write_deepspeed_env() {  # FILE [--remote]: with --remote its values go through a remote shell
  local file=$1 remote=${2:-} directory env_file tmp name prefix
  directory=$(dirname "$file"); env_file="$directory/.spds-env"
  [ -z "$remote" ] || spds_require_safe SPDS_ENV_FILE "$env_file" "the directory of the config"
  tmp=$(umask 077 && mktemp "$env_file.XXXXXX")
  while IFS= read -r name; do
    for prefix in $SPDS_ENV_PREFIXES; do
      case "$name" in
        "$prefix"*) printf '%s=%s\0' "$name" "${!name}" >> "$tmp"; break;;
      esac
    done
  done < <(compgen -e | sort)
  mv "$tmp" "$env_file"
  tmp=$(mktemp "$file.XXXXXX")
  printf 'SPDS_ENV_FILE=%s\n' "$env_file" >> "$tmp"
  if [ -n "${PYTHONPATH:-}" ]; then
    [ -z "$remote" ] || spds_require_safe PYTHONPATH "$PYTHONPATH" "sent to every node on the launcher's command line"
    printf 'PYTHONPATH=%s\n' "$PYTHONPATH" >> "$tmp"
  fi
  mv "$tmp" "$file"
  export DS_ENV_FILE="$file"
}

# The deepspeed launcher (ssh/pdsh) also writes `export K="V";` into the remote command for every
# variable of its own environment whose name starts with one of DeepSpeed's export prefixes (its
# EXPORT_ENVS and the accelerator's: PYTHON, MLFLOW, MV2, UCX, and NCCL on CUDA; read from the
# installed DeepSpeed, not copied here), and a remote shell expands $(...) and backquotes inside
# those double quotes. The variables .spds-env carries are taken out of the launcher's environment
# (the ranks load them from the file); the others (PYTHON*: needed before Python starts) must be
# plain, or the launch is refused, naming the variable. Sets spds_launcher_unset (env -u options).
spds_launcher_unset=()
spds_carried() {
  local prefix
  for prefix in $SPDS_ENV_PREFIXES; do [[ "$1" == "$prefix"* ]] && return 0; done
  return 1
}
spds_check_launcher_exports() {
  local prefixes name prefix
  prefixes=$("$SPDS_PYTHON" -c 'from deepspeed.launcher.runner import EXPORT_ENVS
from deepspeed.accelerator import get_accelerator
print(" ".join(EXPORT_ENVS + list(get_accelerator().export_envs())))' 2>/dev/null) ||
    die "could not ask DeepSpeed ($SPDS_PYTHON) which variables its launcher sends to every node"
  while IFS= read -r name; do
    for prefix in $prefixes; do
      [[ "$name" == "$prefix"* ]] || continue
      if spds_carried "$name"; then
        spds_launcher_unset+=(-u "$name")
      else
        spds_require_safe "$name" "${!name}" "the deepspeed launcher exports it to every node"
      fi
      break
    done
  done < <(compgen -e)
  # The remote command also holds `cd $PWD;` and the interpreter's path, unquoted.
  spds_require_safe "the working directory" "$PWD" "the deepspeed launcher sends 'cd' to it to every node"
  spds_require_safe SPDS_PYTHON "$SPDS_PYTHON" "the deepspeed launcher runs it on every node"
}

# A hostfile line is "HOSTNAME slots=N" (blank lines and # comments allowed). A hostname reaches
# ssh as an argument: one starting with "-" would be an ssh option (-oProxyCommand=...).
spds_check_hostfile() {
  local hostfile=$1 line number=0
  [ -f "$hostfile" ] || die "hostfile $hostfile not found"
  while IFS= read -r line || [ -n "$line" ]; do
    number=$((number + 1))
    line=${line%%#*}
    [[ "$line" =~ ^[[:space:]]*$ ]] && continue
    [[ "$line" =~ ^[[:space:]]*[A-Za-z0-9][A-Za-z0-9._-]*[[:space:]]+slots=[0-9]+[[:space:]]*$ ]] ||
      die "$hostfile:$number: not \"HOSTNAME slots=N\" with a hostname of letters, digits, '.', '_' and '-' (not starting with '-'): $(printf %q "$line")"
  done < "$hostfile"
}

spds_check_number() { [[ "$2" =~ ^[0-9]+$ ]] || die "$1 must be a whole number, not $(printf %q "$2")"; }
spds_check_host() {
  [[ "$2" =~ ^[A-Za-z0-9][A-Za-z0-9._:-]*$ ]] || die "$1 must be a hostname or address, not $(printf %q "$2")"
}

# A stop request older than this moment is stale (spds/stop.py); exported before anything is
# launched, through .deepspeed_env to the other nodes too.
SPDS_LAUNCH_STARTED=${SPDS_LAUNCH_STARTED:-$(date +%s.%N)}
export SPDS_LAUNCH_STARTED
spds_child=""; spds_signals=0

spds_on_signal() {
  spds_signals=$((spds_signals + 1))
  if [ -z "$spds_child" ]; then
    echo "launch: $1 before anything was launched: nothing launched" >&2
    exit 143
  elif [ "$spds_signals" = 1 ]; then
    echo "launch: $1: every rank stops after the update in flight, with a checkpoint (a second signal stops them now)" >&2
    "$SPDS_PYTHON" -m spds.cli stop --output-dir "$spds_output_dir" --why "$1 to $(basename "$0") (pid $$)" >&2 || true
  else
    echo "launch: $1 again: forwarding SIGTERM to every process of the launch" >&2
    kill -TERM -- "-$spds_child" 2>/dev/null || true
  fi
}
trap 'spds_on_signal SIGTERM' TERM
trap 'spds_on_signal SIGINT' INT

# run_launcher VERB COMMAND...: run COMMAND in its own process group, wait for it (through any
# number of signals), return its exit status. A launch that failed without rank 0 recording it (a
# rank killed, a crash before the run directory) is recorded in terminal.json here.
run_launcher() {
  local verb=$1; shift
  setsid "$@" &
  spds_child=$!
  local status=0
  while :; do
    wait "$spds_child" && status=0 || status=$?
    kill -0 "$spds_child" 2>/dev/null || break  # a signal interrupted the wait: the launch goes on
  done
  if [ "$status" != 0 ] && { [ "$verb" = train ] || [ "$verb" = smoke ]; }; then  # their terminal.json
    "$SPDS_PYTHON" -m spds.cli launch-ended --output-dir "$spds_output_dir" --exit-status "$status" --verb "$verb" ||
      true
  fi
  return "$status"
}
