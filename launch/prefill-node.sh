#!/usr/bin/env bash
# One prefill node: HOST=10.0.0.1 SECRET_FILE=/shared/secret MODEL=/models/x ./launch/prefill-node.sh [extra SGLang args]
# Its messenger listens on PORT+3; decoders name it with --prefill-messenger HOST:PORT+3.
set -euo pipefail
exec .venv/bin/python -m sglang_disagg.launch --role prefill --host "${HOST:?set HOST}" \
  --port "${PORT:-30000}" --model-path "${MODEL:-smollm2-135m}" \
  --backend "${BACKEND:-libfabric}" ${PROVIDER:+--provider "$PROVIDER"} --tp "${TP:-1}" ${SECRET_FILE:+--secret-file "$SECRET_FILE"} "$@"
