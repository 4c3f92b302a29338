"""The bandwidth cap on a decoder's outgoing migrations (``--migration-rate``, MB/s; 0: none).

A drain moves the KV of up to MAX_IN_FLIGHT requests at once; on a link the decoders share with
prefill-to-decode traffic (and their own NIC) that burst must not starve the streams still
decoding. All of a decoder's outgoing migrations share one token bucket: a write group goes out
when the bucket holds credit (each takes its bytes, the bucket may go below zero by one group),
the bucket refills at the rate and holds at most BURST_S of it. The groups that must wait are the
held request's ``later`` (source.py: the same mechanism the fault test's stall uses); the
scheduler posts more of them each iteration (Targets.post_due) and a timer wakes it when credit
is due. Pure arithmetic here: no writes, no threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

BURST_S = 0.05  # the bucket's depth, in seconds of the rate


class Pacer:
    def __init__(self, rate_bps: float, now: Callable[[], float] = time.monotonic) -> None:
        if rate_bps < 0:
            raise ValueError(f"migration rate: {rate_bps!r} bytes/s is negative")
        self.rate, self._now = float(rate_bps), now
        self.budget, self._t = self.rate * BURST_S, now()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    @property
    def burst(self) -> float:
        return self.rate * BURST_S

    def take(self, sizes: Sequence[int]) -> int:
        """How many of the next groups (their sizes in bytes, in order) may go out now."""
        if not self.enabled:
            return len(sizes)
        now = self._now()
        self.budget = min(self.budget + (now - self._t) * self.rate, self.burst)
        self._t = now
        n = 0
        for size in sizes:
            if self.budget <= 0:
                break
            self.budget -= size
            n += 1
        return n

    def wait_s(self) -> float:
        """Seconds until the bucket holds credit again (0 when it does)."""
        if not self.enabled or self.budget > 0:
            return 0.0
        return -self.budget / self.rate + 1e-3
