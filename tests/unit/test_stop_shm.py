"""A stopped server group leaves none of SGLang's /dev/shm files it held (process.py, shm_held):
SGLang unlinks them only on paths a SIGKILL skips, and every start makes new ones. The child
here is a real process group mapping such a file, stopped as the launcher stops a server."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

from sglang_disagg.launch.commands import ProcessSpec
from sglang_disagg.launch.process import ManagedProcess

# maps its file, forks a child that keeps it open (a scheduler), then waits to be killed
CHILD = """
import mmap, os, sys, time
path = sys.argv[1]
with open(path, "wb") as f:
    f.write(b"\\0" * 4096)
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 4096)
if os.fork() == 0:
    time.sleep(600)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_stop_removes_the_sglang_shm_files_its_group_held_and_no_other(tmp_path: Path):
    tag = uuid.uuid4().hex[:8]
    held, other = Path(f"/dev/shm/sglang_loads_test_{tag}.shm"), Path(f"/dev/shm/sglang_loads_other_{tag}.shm")
    other.write_bytes(b"x")  # another server's: not held by this group
    p = ManagedProcess(ProcessSpec("shm", (sys.executable, "-c", CHILD, str(held)), (), 0), tmp_path)
    try:
        p.start()
        deadline = time.monotonic() + 20
        while "ready" not in (p.log_path.read_text() if p.log_path.exists() else ""):
            assert time.monotonic() < deadline, p.log_path.read_text()
            time.sleep(0.05)
        assert held.exists()
        p.stop(grace_s=0.5)
        assert p.poll() is not None
        assert not held.exists(), "the group's file outlived it"
        assert other.exists(), "a file the group did not hold was removed"
    finally:
        for f in (held, other):
            f.unlink(missing_ok=True)
        if p.pid:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
