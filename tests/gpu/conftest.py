"""GPU-only tests: collected only where SGLANG_DISAGG_GPU_TESTS=1 (a machine with a CUDA
GPU), so the CPU suite neither runs nor silently skips them. Run them with
``SGLANG_DISAGG_GPU_TESTS=1 python -m pytest tests/gpu``."""

import os

if os.environ.get("SGLANG_DISAGG_GPU_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]
