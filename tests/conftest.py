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

File descriptors are counted too: the test process's open descriptors before and after each
test, summed per module, with the peak, the final count and what the descriptors are. A module
that leaves sockets, pipes or memfds open shows up by name; under CI a peak above FD_BUDGET
fails the run (a suite that leaked past 1,024 once made an unrelated test's ``select()`` fail,
far from the leak).
"""

from __future__ import annotations

import collections
import os
import time
import tomllib

import pytest

_STARTS: list[tuple[str, float, str]] = []  # (configuration, seconds, the test that started it)
_FDS: collections.Counter = collections.Counter()  # module -> descriptors its tests left open
_FD_DIR = "/proc/self/fd"
FD_BUDGET = 512  # the test process's own descriptors; the whole suite peaks far below
_PEAK = [0, ""]  # descriptors, the test after which they peaked


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


def _open_fds() -> list[str]:
    out = []
    for fd in os.listdir(_FD_DIR):
        try:
            out.append(os.readlink(f"{_FD_DIR}/{fd}"))
        except OSError:  # the descriptor listdir itself used, closed since
            pass
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = len(os.listdir(_FD_DIR)) if os.path.isdir(_FD_DIR) else 0
    yield
    if before:
        after = len(os.listdir(_FD_DIR))
        _FDS[item.nodeid.split("::")[0]] += after - before
        if after > _PEAK[0]:
            _PEAK[:] = [after, item.nodeid]


def pytest_sessionfinish(session, exitstatus):
    if in_ci() and _PEAK[0] > FD_BUDGET and exitstatus == 0:
        session.exitstatus = 1  # reported in the "file descriptors" section


def _kind(target: str) -> str:
    if target.startswith(("socket:", "pipe:")):
        return target.split(":")[0]
    if target.startswith("anon_inode:"):
        return target
    return "file " + os.path.dirname(target)


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
    tr = terminalreporter
    if _FDS:
        held = _open_fds()
        tr.section("file descriptors")
        tr.write_line(f"{len(held)} open at the end: " + ", ".join(
            f"{n} {k}" for k, n in collections.Counter(map(_kind, held)).most_common(6)))
        tr.write_line(f"peak {_PEAK[0]} after {_PEAK[1]} (budget {FD_BUDGET})")
        if in_ci() and _PEAK[0] > FD_BUDGET:
            tr.write_line(f"FAILED: the test process held {_PEAK[0]} descriptors, more than {FD_BUDGET}: "
                          "a leak; the modules that left the most open:", red=True)
        for module, n in _FDS.most_common(8):
            if n > 0:
                tr.write_line(f"{n:+5d}  {module}")
    if not _STARTS:
        return
    total = sum(s for _, s, _ in _STARTS)
    tr.section("stack starts")
    tr.write_line(f"{len(_STARTS)} stacks started, {total:.0f} s waiting for them to come up")
    by = collections.defaultdict(list)
    for label, secs, test in _STARTS:
        by[label].append((secs, test))
    again = sorted(((sum(s for s, _ in v), k, v) for k, v in by.items() if len(v) > 1), reverse=True)
    for secs, label, v in again:
        tr.write_line(f"{len(v)}x {secs:6.0f} s  {label}  <- " + ", ".join(sorted({t.split('::')[0] for _, t in v})))
