"""A file descriptor the scheduler can poll together with its ZeroMQ sockets.

Backend threads (a write landed, a batch completed, a control message arrived) call
``set()``; the scheduler's idle wait polls ``fd`` alongside the tokenizer socket, so it
sleeps without spinning and wakes within microseconds of either.
"""

from __future__ import annotations

import contextlib
import os


class Wakeup:
    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.pending = False  # set() since the last clear(): lets clear() skip its syscall

    def set(self) -> None:
        # the write first: a clear() between the two sees no flag and leaves the fd readable
        # for one more turn; the other order could leave it readable with no flag for good
        with contextlib.suppress(OSError):
            os.eventfd_write(self.fd, 1)
        self.pending = True

    def clear(self) -> None:
        if not self.pending:
            return
        self.pending = False  # before the read: a set() racing with it leaves the fd readable
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
