"""benchmarks/transfer.py end to end on one tiny configuration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_disagg.backends import available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not available("libfabric")[0], reason="libfabric shim not built")
def test_transfer_benchmark_quick(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "transfer.py"), "--out", str(tmp_path), "--quick",
                    "--backends", "libfabric:tcp", "--workloads", "page-256K", "--budget", "0.05", "--limits-mib", "16"],
                   check=True, timeout=120, capture_output=True)
    result = json.loads((tmp_path / "transfer.json").read_text())
    assert result["memcpy_gbps"] > 0 and result["tcp_loopback_gbps"] > 0
    rows = result["rows"]
    assert {r["backend"] for r in rows} == {"libfabric", "libfabric-raw-c"}
    for r in rows:
        assert {"backend", "provider", "page_bytes", "gbps", "writes_per_s", "p50_ms", "p99_ms"} <= set(r)
        assert r["provider"] == "tcp" and r["page_bytes"] == 256 << 10 and r["gbps"] > 0
    assert (tmp_path / "transfer.png").stat().st_size > 0
