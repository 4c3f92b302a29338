"""Run Python code of this process inside a host's network: threads that joined its namespace.

The test process lives in the root namespace, where no host address exists. Spawning a
process per probe (nsenter + a new interpreter) costs ~0.3 s, too coarse for faults timed
to the millisecond; a thread can instead join a host's network namespace with setns(2)
(network namespaces are per thread), and every socket it opens afterwards lives there.
So ``call(host, fn, ...)`` runs ``fn`` in the host's network, and ``Thread(host, fn)`` a
background call there. Each call has its own thread, which ends with it: a thread left in a
namespace would keep that namespace alive after its host is gone. Only the network is
joined: PIDs and files stay the test process's own.
"""

from __future__ import annotations

import ctypes
import os
import threading

from .netns import Host, HostsUnavailable

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def join(netns_file: str) -> None:
    """Move the calling thread into the network namespace at `netns_file` (/proc/<pid>/ns/net)."""
    fd = os.open(netns_file, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise HostsUnavailable(f"setns({netns_file}): {os.strerror(err)}")
    finally:
        os.close(fd)


def call(host: Host, fn, *args, timeout: float | None = 60.0):
    """`fn(*args)` run in `host`'s network, on a thread of its own; its result (or exception)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e
    t = Thread(host, run)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} in {host.name}'s network: no answer in {timeout} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


class Thread(threading.Thread):
    """A daemon thread that joins `host`'s network before running `target`."""

    def __init__(self, host: Host, target, *args) -> None:
        super().__init__(daemon=True, name=f"in-{host.name}")
        self._where, self._target_fn, self._args = host.netns_file(), target, args

    def run(self) -> None:
        join(self._where)
        self._target_fn(*self._args)
