#!/usr/bin/env bash
# make test's pytest run: the two-host cluster's tests (tests/test_multinode.py: their daemons are
# made once per process, and they spend most of their time waiting on SLURM's clock and on paced
# updates) run in a process of their own, beside the rest on two xdist workers balanced test by
# test. Their output follows the rest's; the exit status is non-zero if either failed.
#   tools/run-tests.sh PYTHON [PYTEST ARGS...]
set -uo pipefail
python=$1; shift
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$python" -m pytest -q "$@" tests/test_multinode.py > "$log" 2>&1 &
cluster=$!
"$python" -m pytest -q -n 2 --durations=15 "$@" --ignore=tests/test_multinode.py tests
rest=$?
wait "$cluster"
multinode=$?
echo "== the two-host cluster's tests (tests/test_multinode.py), run beside the others"
cat "$log"
[ "$rest" = 0 ] && { [ "$multinode" = 0 ] || [ "$multinode" = 5 ]; }  # 5: none collected (a -m filter)
