# Shared by the launch scripts (sourced, not run).
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
