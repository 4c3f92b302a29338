"""How a progress thread that can only poll (NIXL's notifications, Mooncake's) stays cheap.

Neither library offers a file descriptor or a blocking call for "a notification arrived",
so their threads poll. While something can arrive that someone waits for (an expectation
is pending, a transfer of ours is in flight) they poll with a short back-off: latency of
the KV the decoder waits for. When nothing can (nothing expected, nothing in flight) the
thread blocks on an event that `kick()` sets (a post, a new expectation) for at most
`idle_s`, so an idle decoder's thread wakes twice a second instead of a thousand times,
and never takes the GIL from the scheduler between decode steps. Notifications that come
while it sleeps wait in the library's queue and are counted on its next turn: a write that
nobody expects yet is only credited, never late.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class IdleGate:
    YIELD_TURNS = 50    # right after traffic: poll again at once
    SHORT_TURNS = 150   # then a short sleep
    SHORT_S = 0.0002
    POLL_S = 0.001      # something expected but quiet: the latency a waiter can see

    def __init__(self, has_work: Callable[[], bool], idle_s: float = 0.5) -> None:
        self._has_work, self.idle_s = has_work, idle_s
        self._kicked = threading.Event()
        self._idle = 0
        self.sleeps = 0  # times the thread blocked: tests read it

    def kick(self) -> None:
        self._kicked.set()

    def after(self, busy: bool) -> None:
        """Call after each polling turn, `busy` if it found something."""
        self._idle = 0 if busy else self._idle + 1
        if self._idle < self.YIELD_TURNS:
            time.sleep(0)
            return
        if self._idle < self.SHORT_TURNS:
            time.sleep(self.SHORT_S)
            return
        # cleared before looking, so that a kick between the look and the wait is not lost
        self._kicked.clear()
        if self._has_work():
            time.sleep(self.POLL_S)
            return
        self.sleeps += 1
        if self._kicked.wait(self.idle_s):
            self._idle = 0
        # else still idle: one look, then back to sleep (not a burst of fast turns)
