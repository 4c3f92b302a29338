#!/usr/bin/env bash
# The PD router: PREFILL_URLS="http://10.0.0.1:30001@30003" DECODE_URLS="http://10.0.0.2:30002" ./launch/router.sh
set -euo pipefail
args=()
for u in ${PREFILL_URLS:?set PREFILL_URLS}; do args+=(--prefill-url "$u"); done
for u in ${DECODE_URLS:?set DECODE_URLS}; do args+=(--decode-url "$u"); done
exec .venv/bin/python -m sglang_disagg.launch --role router --host "${HOST:-0.0.0.0}" --port "${PORT:-30000}" "${args[@]}" "$@"
