#!/usr/bin/env bash
# The multi-node tests' real daemons (tests/cluster.py): sshd, pdsh, munge and SLURM, Debian's
# packages. Installed when missing, as root with apt-get; elsewhere those tests skip and say why,
# except under CI=true, where they must run.
set -euo pipefail
packages="slurm-wlm munge openssh-server openssh-client pdsh"
missing=""
for tool in sshd ssh pdsh munged slurmctld slurmd sbatch; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing="$missing $tool"
done
[ -n "$missing" ] || exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "cluster-deps: missing$missing; installing $packages needs root and apt-get: the multi-node tests will skip" >&2
  [ -z "${CI:-}" ] || exit 1
  exit 0
fi
echo "== apt-get install $packages (the multi-node tests' daemons; they start none here)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null
