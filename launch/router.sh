#!/usr/bin/env bash
# The router in front of the decoders: DECODE_URLS="http://10.0.0.2:30002" ./launch/router.sh
# (upstream mode: MODE=upstream PREFILL_URLS="http://10.0.0.1:30001@30003" DECODE_URLS=...)
set -euo pipefail
args=(--mode "${MODE:-messenger}")
for u in ${PREFILL_URLS:-}; do args+=(--prefill-url "$u"); done
for u in ${DECODE_URLS:?set DECODE_URLS}; do args+=(--decode-url "$u"); done
exec .venv/bin/python -m sglang_disagg.launch --role router --host "${HOST:-0.0.0.0}" --port "${PORT:-30000}" "${args[@]}" "$@"
