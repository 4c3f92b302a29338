#!/usr/bin/env bash
# One decode node: HOST=10.0.0.2 PREFILL="10.0.0.1:30003 10.0.0.3:30003" MODEL=/models/x ./launch/decode-node.sh
set -euo pipefail
args=()
for p in ${PREFILL:?set PREFILL to the prefill messengers, host:port}; do args+=(--prefill-messenger "$p"); done
exec .venv/bin/python -m sglang_disagg.launch --role decode --host "${HOST:?set HOST}" \
  --port "${PORT:-30000}" --model-path "${MODEL:-smollm2-135m}" \
  --backend "${BACKEND:-libfabric}" ${PROVIDER:+--provider "$PROVIDER"} --tp "${TP:-1}" ${SECRET_FILE:+--secret-file "$SECRET_FILE"} "${args[@]}" "$@"
