"""The suite's own rules (tests/conftest.py): a skip fails under CI=true, an expected failure
stays one, and outside CI a skip stays a skip. Run in a child pytest over a scratch directory
holding the real rule file, so the rule is tested as CI meets it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[1] / "conftest.py"
CASES = '''
import pytest

def test_skipped():
    pytest.skip("a backend is missing")

@pytest.mark.xfail(reason="known open", strict=True)
def test_known_open():
    assert False

@pytest.mark.xfail(run=False, reason="GPU only")
def test_not_run():
    raise AssertionError("must not run")

def test_passes():
    pass
'''


def run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    shutil.copy(RULES, tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci is not None else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfsx", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_skip_fails_in_ci_and_expected_failures_stay_expected(tmp_path, ci):
    r = run(tmp_path, ci)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "skipped in CI (CI=true), which counts as a failure" in r.stdout and "a backend is missing" in r.stdout
    assert "1 failed, 1 passed, 2 xfailed" in r.stdout, r.stdout


def test_outside_ci_a_skip_stays_a_skip(tmp_path):
    r = run(tmp_path, None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 1 skipped, 2 xfailed" in r.stdout, r.stdout


LEAK = '''
import os

_held = []

def test_leaks_pipes():
    _held.extend(os.pipe() for _ in range(300))  # 600 descriptors, left open

def test_clean():
    os.close(os.dup(0))
'''


@pytest.mark.parametrize("ci", ["true", None])
def test_descriptors_a_module_leaves_open_are_reported_and_fail_ci_past_the_budget(tmp_path, ci):
    shutil.copy(RULES, tmp_path / "conftest.py")
    (tmp_path / "test_leak.py").write_text(LEAK)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "2 passed" in r.stdout, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.split() == ["+600", "test_leak.py"] for line in lines), r.stdout
    assert "test_leak.py::test_leaks_pipes (budget 512)" in r.stdout, r.stdout
    if ci:
        assert r.returncode == 1 and "FAILED: the test process held" in r.stdout, r.stdout
    else:
        assert r.returncode == 0 and "FAILED" not in r.stdout, r.stdout
