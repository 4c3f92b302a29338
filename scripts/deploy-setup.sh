#!/usr/bin/env bash
# What `make test-deploy` needs beyond `make setup`: Debian's Slurm (22.05) and munge, as
# programs only (no service is started or enabled: harness/slurm.py runs its own daemons).
set -euo pipefail
PKGS=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if (( ${#missing[@]} )); then
  if [ "$(id -u)" != 0 ]; then
    echo "error: the deployment tests need root and these Debian packages: ${missing[*]}" >&2
    exit 2
  fi
  echo "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
fi
