"""Rules for the whole suite (every directory).

No silent skip in CI: under ``CI=true`` (`.ci/run` sets it) a skipped test is a failure. A
skip means a backend, provider, wheel, namespace or dependency was missing, and a suite that
ran nothing must not pass. Expected failures stay as they are: an ``xfail`` documents, with
its reason, something known open that did run (or, for the GPU tests on a machine without a
GPU, something that could not: tests/gpu/conftest.py reports those as ``XFAIL [NOTRUN]``, so
every CI summary lists what stays unverified). Outside CI a skip stays a skip, with its
reason in the ``-ra`` summary.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI=true), which counts as a failure: {reason}"
