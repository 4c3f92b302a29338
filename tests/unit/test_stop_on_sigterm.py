"""A script that started servers and is sent SIGTERM stops them on the way out
(launch/process.stop_on_sigterm, which Stack.start installs). The child here is a real
process in a session of its own, as our servers are; the script is killed the way a CI
timeout or `kill` would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from sglang_disagg.launch.commands import ProcessSpec
    from sglang_disagg.launch.process import ManagedProcess, stop_on_sigterm

    {install}
    child = ManagedProcess(ProcessSpec("sleeper", ("sleep", "600"), (), 0), Path(sys.argv[1]))
    try:  # entered before the pid is printed: the test's SIGTERM, sent after it reads the pid, lands inside
        child.start()
        print(child.pid, flush=True)
        time.sleep(60)
    finally:
        child.stop(grace_s=2)
        print("stopped", flush=True)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose (its parent, the script, has exited and init reaps it).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _run(tmp_path: Path, install: str) -> tuple[int, int, str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(install=install))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert _alive(child)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.returncode, child, out


def test_sigterm_stops_the_children(tmp_path):
    code, child, out = _run(tmp_path, "stop_on_sigterm()")
    assert "stopped" in out
    assert code == 128 + signal.SIGTERM
    assert not _alive(child), "the script's child outlived its SIGTERM"


def test_without_it_the_child_would_stay(tmp_path):
    """The negative control: the same script without the handler leaves its child running
    (what benchmark scripts did), so the test above tests the handler."""
    code, child, out = _run(tmp_path, "")
    try:
        assert code == -signal.SIGTERM and "stopped" not in out
        assert _alive(child)
    finally:
        os.killpg(child, signal.SIGKILL)


def test_a_handler_already_installed_is_kept():
    """The launcher drains on SIGTERM with its own handler: stop_on_sigterm leaves it."""
    from sglang_disagg.launch.process import stop_on_sigterm

    def mine(signum, frame):  # pragma: no cover - never called
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        stop_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)
