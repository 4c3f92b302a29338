#!/usr/bin/env bash
# One decode node: HOST=10.0.0.2 MODEL=/models/x ./launch/decode-node.sh [extra SGLang args]
set -euo pipefail
exec .venv/bin/python -m sglang_disagg.launch --role decode --host "${HOST:?set HOST}" \
  --port "${PORT:-30000}" --model-path "${MODEL:-tiny-llama}" \
  --transfer-backend "${BACKEND:-mooncake}" --tp "${TP:-1}" "$@"
