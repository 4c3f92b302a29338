"""Expected-count completion, shared by every backend.

Each paged write carries a 32-bit immediate tag. The receiver counts arrivals per tag
(whatever the backend's native notification: CQ data, NIXL notif, control message) and
`expect(tag, n, timeout)` fires once when n arrivals are reached. It fails on the
deadline ("fewer immediates than expected by the deadline = failed", the only signal
some providers give when a sender dies) or when the peer it depends on is lost.

Arrivals before the expectation are credited; a fired expectation consumes its n
arrivals. A failed (or cancelled) expectation RETIRES its tag: its count is dropped and
every later arrival for it is discarded, and the tag cannot be expected again. Writes of a
failed request that land late therefore never count toward another request. The retired
set is bounded (oldest forgotten first): callers issue tags from a 32-bit counter, so a
tag comes back only after 2**32 newer ones.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

from .errors import DeadlineExceeded, DescriptorError, PeerLostError, TransferError
from .future import TransferFuture


@dataclass(slots=True)
class _Expectation:
    tag: int
    count: int
    deadline: float
    peers: frozenset[str] | None
    seq: int
    future: TransferFuture = field(default_factory=TransferFuture)


RETIRED_MAX = 1 << 16


class ExpectTracker:
    def __init__(self, name: str = "expect") -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._counts: dict[int, int] = {}
        self._retired: OrderedDict[int, None] = OrderedDict()
        self.late_writes_dropped = 0
        self._waiting: dict[int, _Expectation] = {}
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, tag, seq)
        self._closed: BaseException | None = None
        self._seq = itertools.count()
        self._timer = threading.Thread(target=self._run_timer, name=f"{name}-deadlines", daemon=True)
        self._timer.start()

    def expect(self, tag: int, count: int, timeout_s: float,
               peer: str | Collection[str] | None = None) -> TransferFuture:
        """Future completed when `count` writes tagged `tag` have landed.

        `peer`: instance id(s) of the peers that send them; the loss of any of them fails
        the expectation at once. None: the loss of any peer fails it.
        """
        if not 0 <= tag < 2**32:
            raise DescriptorError(f"immediate tag {tag} outside 0..2**32-1")
        if count < 0 or timeout_s < 0:
            raise DescriptorError(f"count ({count}) and timeout_s ({timeout_s}) must be >= 0")
        peers = None if peer is None else frozenset([peer] if isinstance(peer, str) else peer)
        exp = _Expectation(tag, count, time.monotonic() + timeout_s, peers, next(self._seq))
        exp.future.label = f"expect(tag={tag}, count={count})"
        with self._lock:
            if self._closed is not None:
                raise TransferError(f"backend closed: {self._closed}")
            if tag in self._waiting:
                raise DescriptorError(f"tag {tag} already has a pending expectation")
            if tag in self._retired:
                raise DescriptorError(f"tag {tag} belonged to a failed request and is retired")
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
            if tag in self._retired:
                self.late_writes_dropped += n
                return
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

    def retire(self, tag: int, reason: str = "cancelled") -> None:
        """Give up on `tag`: a pending expectation fails with TransferError(reason), and
        writes that still arrive for it are discarded."""
        with self._lock:
            e = self._waiting.get(tag)
            if e is not None:
                self._drop(e)
            else:
                self._retire(tag)
        if e is not None:
            e.future.set_exception(TransferError(f"tag {tag}: {reason}"))

    def is_retired(self, tag: int) -> bool:
        with self._lock:
            return tag in self._retired

    def peer_lost(self, peer: str, reason: str) -> None:
        with self._lock:
            lost = [e for e in self._waiting.values() if e.peers is None or peer in e.peers]
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
        self._retire(e.tag)

    def _retire(self, tag: int) -> None:
        self._counts.pop(tag, None)
        self._retired[tag] = None
        while len(self._retired) > RETIRED_MAX:
            self._retired.popitem(last=False)

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
