"""Rules for the whole suite (every directory).

No silent skip in CI: under ``CI=true`` (`.ci/run` sets it) a skipped test is a failure. A
skip means a backend, provider, wheel, namespace or dependency was missing, and a suite that
ran nothing must not pass. Expected failures stay as they are: an ``xfail`` documents, with
its reason, something known open that did run (or, for the GPU tests on a machine without a
GPU, something that could not: tests/gpu/conftest.py reports those as ``XFAIL [NOTRUN]``, so
every CI summary lists what stays unverified). Outside CI a skip stays a skip, with its
reason in the ``-ra`` summary.

Stack starts are counted: every `Stack.start` (e2e) and `Deployment.start` (namespace hosts)
with its configuration and seconds; the terminal summary lists the total and the configurations
started more than once, so a change that starts the same stack again shows up in the CI log
(server start-up is most of the suite's time on 2 cores).
"""

from __future__ import annotations

import collections
import os
import time
import tomllib

import pytest

_STARTS: list[tuple[str, float, str]] = []  # (configuration, seconds, the test that started it)


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


def _stack_label(stack) -> str:
    c = stack.cfg
    return (f"{c.role.value} {c.mode.value} {c.backend or '-'}{'/' + c.provider if c.provider else ''} {c.model} "
            f"tp{c.prefill_tp}/{c.decode_tp} dp{c.prefill_dp}/{c.decode_dp} adp{c.prefill_attn_dp}/{c.decode_attn_dp} "
            f"{' '.join(c.extra_args)} {' '.join(f'{k}={v}' for k, v in sorted(c.env))}").strip()


def _deployment_label(dep) -> str:
    table = tomllib.loads(dep.file.read_text())["deployment"]
    return "hosts " + " ".join(str(table[k]) for k in ("model", "mode", "backend", "provider", "extra_args")
                               if k in table) + f" {dep.layout}"


def _counted(cls, label):
    start = cls.start

    def counted(self, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return start(self, *args, **kwargs)
        finally:
            _STARTS.append((label(self), time.monotonic() - t0,
                            os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]))
    counted.__wrapped__ = start
    cls.start = counted
    return start


@pytest.fixture(autouse=True, scope="session")
def _count_stack_starts():
    undo = []
    try:
        from sglang_disagg.launch.stack import Stack
        undo.append((Stack, _counted(Stack, _stack_label)))
    except ImportError:  # a checkout without its environment: nothing to count
        pass
    try:
        from harness.hosts.deployment import Deployment
        undo.append((Deployment, _counted(Deployment, _deployment_label)))
    except ImportError:
        pass
    yield
    for cls, start in undo:
        cls.start = start


def pytest_terminal_summary(terminalreporter):
    if not _STARTS:
        return
    tr = terminalreporter
    total = sum(s for _, s, _ in _STARTS)
    tr.section("stack starts")
    tr.write_line(f"{len(_STARTS)} stacks started, {total:.0f} s waiting for them to come up")
    by = collections.defaultdict(list)
    for label, secs, test in _STARTS:
        by[label].append((secs, test))
    again = sorted(((sum(s for s, _ in v), k, v) for k, v in by.items() if len(v) > 1), reverse=True)
    for secs, label, v in again:
        tr.write_line(f"{len(v)}x {secs:6.0f} s  {label}  <- " + ", ".join(sorted({t.split('::')[0] for _, t in v})))
