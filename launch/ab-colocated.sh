#!/usr/bin/env bash
# A colocated baseline with the same model and flags: ./launch/ab-colocated.sh [extra SGLang args]
set -euo pipefail
exec .venv/bin/python -m sglang_disagg.launch --role colocated --port "${PORT:-30100}" --model-path "${MODEL:-smollm2-135m}" "$@"
