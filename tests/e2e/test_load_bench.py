"""benchmarks/load.py, small: load through the router with clients leaving mid-stream, then
its own checks (no failed request, outputs equal to a colocated server's, KV pages, threads
and fds back to idle) must all hold, and the report must say what they measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import _ports

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_load_bench_small_run_passes_its_checks(tmp_path):
    port = next(_ports)
    next(_ports)  # the colocated reference server takes the ten ports after the stack's
    cmd = [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--out", str(tmp_path), "--requests", "60",
           "--concurrency", "8", "--abort-fraction", "0.2", "--sample", "12", "--port", str(port),
           # A small KV pool: long prompts and decodes compete for pages (a decoder that handed
           # out prompt pages without keeping decode room once deadlocked here).
           "--max-total-tokens", "2048"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = tmp_path / "load.json"
    assert report.exists(), f"no report (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    doc = json.loads(report.read_text())
    assert r.returncode == 0, f"checks failed: {doc['checks_failed']}\n{r.stderr[-2000:]}"
    assert doc["checks_failed"] == []
    assert doc["requests"] == 60 and doc["concurrency"] == 8
    assert doc["errors"] == 0 and doc["errors_before_abort"] == 0, doc["error_samples"]
    # The storm happened: clients left, some before their first token, some straight at the decoder.
    assert doc["aborted"] == doc["abort_clients"] >= 6
    assert doc["aborted_at_decoder"] >= 1
    assert doc["long_prompts"] >= 1
    assert doc["outputs_compared"] == 12 and doc["outputs_identical"] == 12
    assert doc["pages_idle_after"] == doc["pages_idle_before"] == 0
    assert doc["threads_after"] == doc["threads_before"] > 0
    assert doc["fds_after"] == doc["fds_before"] > 0
    assert set(doc["processes_after"]) == {"prefill", "decode", "router"}
    assert all(p["processes"] >= 2 for name, p in doc["processes_after"].items() if name != "router"), \
        "a server's scheduler and detokenizer children were not counted"
    assert doc["requests_per_s"] > 0 and doc["p99_latency_ms"] >= doc["p50_latency_ms"] > 0
