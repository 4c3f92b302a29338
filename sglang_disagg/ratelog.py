"""Warnings a peer can cause, logged at a bounded rate: at most one line per `every_s` for
each kind, the lines held back in between counted in the next one. Anyone who reaches a port
can make such events as fast as they can connect or send (one connection flood wrote 13,000
lines a second), so the count stays exact in the metrics and the log stays readable."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


class RateLog:
    """`suffix` says what was held back: `{n}` lines, `{every}` the period in seconds."""

    SUFFIX = " (and {n} more since the last such line)"

    def __init__(self, every_s: float, logger: logging.Logger, clock: Callable[[], float] = time.monotonic,
                 suffix: str | None = None) -> None:
        self.every_s, self._logger, self._clock = every_s, logger, clock
        self._suffix = self.SUFFIX if suffix is None else suffix
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, fmt: str, *args: Any, exc_info: BaseException | None = None) -> bool:
        """True when the line was logged."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(kind, float("-inf")):
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._next[kind] = now + self.every_s
            held = self._held.pop(kind, 0)
        if held:
            fmt += self._suffix.format(n=held, every=self.every_s).replace("%", "%%")
        self._logger.warning(fmt, *args, exc_info=exc_info)
        return True
