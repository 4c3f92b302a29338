"""The device check's CPU twin: `python -m sglang_disagg.devcheck --device cpu` runs the same
harness that scripts/gpu-check runs on a GPU (toy model, the messenger's LayerCounter and
Streamer, a receiving process, the same-host backend, fd passing), with the CPU counter and
shmem, so the script that goes to a GPU is known to work up to the device calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("devcheck")
    p = subprocess.run([sys.executable, "-m", "sglang_disagg.devcheck", "--device", "cpu", "--out", str(out),
                        "--part-timeout", "120"], capture_output=True, text=True, timeout=400, cwd=ROOT)
    data = json.loads((out / "devcheck-cpu.json").read_text())
    assert p.returncode == 0, (p.stdout, p.stderr, json.dumps(data, indent=1)[:4000])
    return data


def test_every_part_ran_and_passed(result):
    assert set(result["parts"]) == {"streaming", "bandwidth", "fdpass"}
    assert all(part["ok"] for part in result["parts"].values())


def test_streaming_delivers_every_byte_and_posts_layer_0_while_the_forward_runs(result):
    part = result["parts"]["streaming"]
    eager = part["runs"]["eager"]
    assert part["backend"] == "shmem" and eager["streamed"] and eager["bytes_equal"]
    assert eager["writes"] == part["shape"]["layers"] * part["shape"]["pages"]
    # layer 0 is posted after its own layer (one delay in) and well before the last layer ends
    delay = part["shape"]["layer_delay_s"]
    assert delay <= eager["layer0_posted_s"] < eager["forward_end_s"] - delay
    # CPU forwards are synchronous, so the hook-time control is correct here (on a GPU it is not)
    assert "hook_time" in part["runs"] and "negative_control_differs" in part


def test_bandwidth_compares_the_backend_with_a_copy_in_the_same_run(result):
    part = result["parts"]["bandwidth"]
    assert part["ok"] and part["backend_gbps"] > 0 and part["copy_gbps"] > 0
    assert len(part["backend_s"]) == len(part["copy_s"]) == part["repeats"]


def test_a_failed_part_is_reported_and_the_rest_still_written(tmp_path):
    p = subprocess.run([sys.executable, "-m", "sglang_disagg.devcheck", "--device", "cuda:0", "--out", str(tmp_path),
                        "--parts", "bandwidth", "--part-timeout", "60"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    data = json.loads((tmp_path / "devcheck-cuda.json").read_text())
    assert p.returncode == 1 and not data["parts"]["bandwidth"]["ok"]  # no GPU here: the part fails, named
    assert data["parts"]["bandwidth"]["error"]


def test_the_gpu_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu-check")], check=True)
