#!/usr/bin/env bash
# The whole disaggregated stack on this machine: ./launch/local-pd.sh [mooncake|nixl] [extra SGLang args]
set -euo pipefail
backend=${1:-mooncake}; shift || true
exec .venv/bin/python -m sglang_disagg.launch --role all --transfer-backend "$backend" "$@"
