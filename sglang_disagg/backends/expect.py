"""Expected-count completion, shared by every backend.

Each paged write carries a 32-bit immediate tag. The receiver counts arrivals per tag
(whatever the backend's native notification: CQ data, NIXL notif, control message) and
`expect(tag, n, timeout)` fires once when n arrivals are reached. It fails on the
deadline ("fewer immediates than expected by the deadline = failed", the only signal
some providers give when a sender dies) or when the peer it depends on is lost.

Arrivals before the expectation are credited; a fired expectation consumes its n
arrivals; a failed one drops the tag's count (late writes of a failed request must not
complete a later request that reuses the tag).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field

from .errors import DeadlineExceeded, DescriptorError, PeerLostError, TransferError
from .future import TransferFuture


@dataclass(slots=True)
class _Expectation:
    tag: int
    count: int
    deadline: float
    peer: str | None
    seq: int
    future: TransferFuture = field(default_factory=TransferFuture)


class ExpectTracker:
    def __init__(self, name: str = "expect") -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._counts: dict[int, int] = {}
        self._waiting: dict[int, _Expectation] = {}
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, tag, seq)
        self._closed: BaseException | None = None
        self._seq = itertools.count()
        self._timer = threading.Thread(target=self._run_timer, name=f"{name}-deadlines", daemon=True)
        self._timer.start()

    def expect(self, tag: int, count: int, timeout_s: float, peer: str | None = None) -> TransferFuture:
        """Future completed when `count` writes tagged `tag` have landed.

        `peer`: instance id of the only peer that may send them; its loss fails the
        expectation at once. None: the loss of any peer fails it.
        """
        if not 0 <= tag < 2**32:
            raise DescriptorError(f"immediate tag {tag} outside 0..2**32-1")
        if count < 0 or timeout_s < 0:
            raise DescriptorError(f"count ({count}) and timeout_s ({timeout_s}) must be >= 0")
        exp = _Expectation(tag, count, time.monotonic() + timeout_s, peer, next(self._seq))
        exp.future.label = f"expect(tag={tag}, count={count})"
        with self._lock:
            if self._closed is not None:
                raise TransferError(f"backend closed: {self._closed}")
            if tag in self._waiting:
                raise DescriptorError(f"tag {tag} already has a pending expectation")
            if self._counts.get(tag, 0) >= count:
                self._consume(tag, count)
                fire = True
            else:
                self._waiting[tag] = exp
                heapq.heappush(self._deadlines, (exp.deadline, tag, exp.seq))
                self._wake.notify()
                fire = False
        if fire:
            exp.future.set_result(count)
        return exp.future

    def add(self, tag: int, n: int = 1) -> None:
        """Credit `n` arrivals for `tag` (called from progress threads)."""
        with self._lock:
            total = self._counts.get(tag, 0) + n
            self._counts[tag] = total
            exp = self._waiting.get(tag)
            if exp is None or total < exp.count:
                return
            del self._waiting[tag]
            self._consume(tag, exp.count)
        exp.future.set_result(exp.count)

    def arrived(self, tag: int) -> int:
        with self._lock:
            return self._counts.get(tag, 0)

    def forget(self, tag: int) -> None:
        """Drop the unclaimed count of a tag nobody will expect."""
        with self._lock:
            self._counts.pop(tag, None)

    def peer_lost(self, peer: str, reason: str) -> None:
        with self._lock:
            lost = [e for e in self._waiting.values() if e.peer is None or e.peer == peer]
            for e in lost:
                self._drop(e)
        for e in lost:
            e.future.set_exception(PeerLostError(f"tag {e.tag}: peer {peer} lost ({reason})"))

    def close(self, reason: str = "closed") -> None:
        with self._lock:
            self._closed = TransferError(reason)
            pending = list(self._waiting.values())
            self._waiting.clear()
            self._counts.clear()
            self._wake.notify()
        for e in pending:
            e.future.set_exception(TransferError(f"tag {e.tag}: {reason}"))
        self._timer.join(timeout=1.0)

    def pending(self) -> int:
        with self._lock:
            return len(self._waiting)

    def _consume(self, tag: int, n: int) -> None:
        left = self._counts.get(tag, 0) - n
        if left > 0:
            self._counts[tag] = left
        else:
            self._counts.pop(tag, None)

    def _drop(self, e: _Expectation) -> None:
        del self._waiting[e.tag]
        self._counts.pop(e.tag, None)

    def _run_timer(self) -> None:
        with self._lock:
            while self._closed is None:
                now = time.monotonic()
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, tag, seq = heapq.heappop(self._deadlines)
                    e = self._waiting.get(tag)
                    if e is not None and e.seq == seq:
                        got = self._counts.get(tag, 0)
                        self._drop(e)
                        expired.append((e, got))
                if expired:
                    self._lock.release()
                    try:
                        for e, got in expired:
                            e.future.set_exception(DeadlineExceeded(
                                f"tag {e.tag}: {got} of {e.count} writes arrived before the deadline"))
                    finally:
                        self._lock.acquire()
                    continue
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._wake.wait(wait)
