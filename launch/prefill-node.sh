#!/usr/bin/env bash
# One prefill node: HOST=10.0.0.1 MODEL=/models/x ./launch/prefill-node.sh [extra SGLang args]
set -euo pipefail
exec .venv/bin/python -m sglang_disagg.launch --role prefill --host "${HOST:?set HOST}" \
  --port "${PORT:-30000}" --model-path "${MODEL:-tiny-llama}" \
  --transfer-backend "${BACKEND:-mooncake}" --tp "${TP:-1}" "$@"
