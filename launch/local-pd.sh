#!/usr/bin/env bash
# The whole disaggregated stack on this machine: ./launch/local-pd.sh [shmem|libfabric|nixl|mooncake] [extra args]
# (messenger mode; add --mode upstream for SGLang's own PD path with mooncake|nixl)
set -euo pipefail
backend=${1:-shmem}; shift || true
exec .venv/bin/python -m sglang_disagg.launch --role all --backend "$backend" "$@"
