"""A launcher that is a Slurm step's task starts its servers with SIGTERM ignored (process.py,
_preexec): a signal to the step reaches every process of it, and SGLang's schedulers died at
once instead of letting the decoder drain. Outside Slurm nothing
changes. The children here are real processes started as the launcher starts its servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_disagg.launch.commands import ProcessSpec
from sglang_disagg.launch.process import ManagedProcess

# The child reports its own disposition and that of a process it starts (a scheduler is one)
CHILD = ("import signal, subprocess, sys; "
         "print(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, flush=True); "
         "subprocess.run([sys.executable, '-c', "
         "'import signal; print(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)'])")


@pytest.mark.parametrize("step, ignored", [(True, "True\nTrue"), (False, "False\nFalse")])
def test_servers_ignore_sigterm_only_inside_a_slurm_step(tmp_path: Path, monkeypatch, step, ignored):
    if step:
        monkeypatch.setenv("SLURM_STEP_ID", "3")
    else:
        monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    p = ManagedProcess(ProcessSpec("child", (sys.executable, "-c", CHILD), (), 0), tmp_path)
    p.start()
    assert p.wait_exit(30)
    assert p.log_path.read_text().strip() == ignored


def test_a_handler_installed_by_the_server_itself_still_runs(tmp_path: Path, monkeypatch):
    """SGLang's front process installs its graceful-stop handler: the launcher's drain uses it."""
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    code = ("import os, signal, sys, time; "
            "signal.signal(signal.SIGTERM, lambda *a: (print('graceful', flush=True), sys.exit(0))); "
            "print('ready', flush=True); time.sleep(30)")
    p = ManagedProcess(ProcessSpec("front", (sys.executable, "-c", code), (), 0), tmp_path)
    p.start()
    for _ in range(300):
        if "ready" in p.log_path.read_text():
            break
        subprocess.run(["sleep", "0.05"])
    p.drain()  # SIGTERM to the server process alone
    assert p.wait_exit(10)
    assert p.log_path.read_text().split() == ["ready", "graceful"]


def test_a_scheduler_started_in_a_slurm_step_ignores_sigterm_again_after_sglang_took_it(monkeypatch):
    """Something in a scheduler's start installs a SIGTERM handler over the inherited SIG_IGN
    (seen: caught, not ignored): the scheduler died of the step's signal before the decoder drained."""
    import signal

    from sglang_disagg import hooks
    from sglang_disagg.env import IGNORE_SIGTERM_ENV
    from sglang_disagg.messenger.config import MessengerConfig

    monkeypatch.setattr(MessengerConfig, "from_env", classmethod(lambda cls: None))  # no messenger here
    before = signal.signal(signal.SIGTERM, lambda *a: None)  # what the scheduler's start did
    try:
        monkeypatch.delenv(IGNORE_SIGTERM_ENV, raising=False)
        hooks.scheduler_ready(object())
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        monkeypatch.setenv(IGNORE_SIGTERM_ENV, "1")
        hooks.scheduler_ready(object())
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_launcher_tells_its_servers_only_inside_a_slurm_step(tmp_path: Path, monkeypatch):
    from sglang_disagg.env import IGNORE_SIGTERM_ENV

    code = f"import os; print(os.environ.get('{IGNORE_SIGTERM_ENV}'))"
    for step, want in ((True, "1"), (False, "None")):
        if step:
            monkeypatch.setenv("SLURM_STEP_ID", "0")
        else:
            monkeypatch.delenv("SLURM_STEP_ID", raising=False)
        p = ManagedProcess(ProcessSpec(f"env-{step}", (sys.executable, "-c", code), (), 0), tmp_path)
        p.start()
        assert p.wait_exit(30)
        assert p.log_path.read_text().strip() == want
