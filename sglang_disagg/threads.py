"""Our threads, named where the operating system shows them.

Python (before 3.14) keeps a thread's name to itself: `top -H`, `py-spy`, `/proc/<pid>/task/
*/comm` show every thread of a scheduler as "sglang::schedul" (SGLang's process title, which
new threads inherit). To account for the CPU the messenger costs a server, thread by thread,
each thread of ours sets its OS name (prctl PR_SET_NAME, 15 bytes) to PREFIX + a short form
of its Python name; threads a transfer library starts inside our backends inherit the name
of the thread that created them, so backends create their native objects inside
`native_scope` and those threads carry our prefix too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator

PREFIX = "sd:"
_PR_SET_NAME = 15
_MAX = 15  # TASK_COMM_LEN - 1
# Long words shortened so that names stay distinct within 15 bytes.
_SHORT = (("messenger", "msg"), ("libfabric", "fab"), ("control", "ctl"), ("mooncake", "mc"),
          ("heartbeat", "beat"), ("deadlines", "dl"), ("progress", "prog"), ("complete", "done"),
          ("notifies", "note"), ("worker", "w"), ("accept", "acc"), ("watchdog", "wdog"))
_libc = None


def os_name(name: str) -> str:
    """The OS-visible name of our thread called `name` (PREFIX first, at most 15 bytes)."""
    for long, short in _SHORT:
        name = name.replace(long, short)
    return (PREFIX + name).encode()[:_MAX].decode(errors="ignore")


def set_os_name(name: str) -> None:
    """Name the calling thread as the OS sees it; a platform without prctl keeps its name."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(_PR_SET_NAME, name.encode()[:_MAX], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def current_os_name() -> str:
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class Thread(threading.Thread):
    """threading.Thread whose OS name says it is ours (see the module docstring)."""

    def run(self) -> None:
        set_os_name(os_name(self.name))
        super().run()


@contextlib.contextmanager
def native_scope(name: str) -> Iterator[None]:
    """Threads a native library starts inside this block are named as ours (`name`)."""
    if os.name != "posix":
        yield
        return
    old = current_os_name()
    set_os_name(os_name(name))
    try:
        yield
    finally:
        if old:
            set_os_name(old)
