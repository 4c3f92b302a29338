"""Expected-count completion, shared by every backend.

Each paged write carries a 32-bit immediate tag. The receiver counts arrivals per tag
(whatever the backend's native notification: CQ data, NIXL notif, control message) and
`expect(tag, n, timeout)` fires once when n arrivals are reached. It fails on the
deadline ("fewer immediates than expected by the deadline = failed", the only signal
some providers give when a sender dies) or when the peer it depends on is lost.

Arrivals before the expectation are credited; a fired expectation consumes its n
arrivals. A failed (or cancelled) expectation RETIRES its tag: every later arrival for it is discarded
(counted: `landed(tag)` is every arrival of a retired tag, before and after), and the tag
cannot be expected again. Writes of a
failed request that land late therefore never count toward another request. The retired
set is bounded (oldest forgotten first): callers issue tags from a 32-bit counter, so a
tag comes back only after 2**32 newer ones.

Credits for tags nobody expects (yet) are bounded too, at EARLY_MAX tags, the least recently
credited dropped first and counted (`early_credits_dropped`); see EARLY_MAX.

Credits are tied to who sent them where the transport says so (`add(..., source=)`: the
instance id of the peer whose authenticated control frame or notification carried them, on
shmem, NIXL and Mooncake): an expectation tied to peers counts only their credits, before and
after it was set, and a retired tag's `landed` only theirs; others are dropped and counted
(`foreign_credits_dropped`). libfabric's completions name no sender (`source=None`): those
count for whoever was asked, as any write a registered key allowed could.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from typing import Any

from .errors import DeadlineExceeded, DescriptorError, PeerLostError, TransferError
from .future import TransferFuture
from ..threads import Thread as NamedThread

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Expectation:
    tag: int
    count: int
    deadline: float
    peers: frozenset[str] | None
    seq: int
    created: float = 0.0
    future: TransferFuture = field(default_factory=TransferFuture)


RETIRED_MAX = 1 << 16
# Tags holding credits with no expectation, at most. Credits legitimately come first: a
# receiver registers its expectation after it sent the order, and a fast sender's writes
# (their immediates counted on a progress thread) can land before that. But writes for tags
# never expected (a peer holding the secret writing with made-up immediates, a stray sender)
# would otherwise be held for ever. An early credit is claimed within an order's round trip,
# so the least recently credited tags are the ones dropped (and counted); a dropped tag's
# expectation, if one ever comes, misses its deadline like one whose writes were lost.
EARLY_MAX = 1 << 16
FIRED_MAX = 4096  # tags whose expectation fired, remembered with its peers (far above requests in flight)


class ExpectTracker:
    def __init__(self, name: str = "expect") -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._counts: dict[int, int] = {}
        self._retired: OrderedDict[int, int] = OrderedDict()  # tag -> its arrivals, late ones too
        self.late_writes_dropped = 0
        self._early: OrderedDict[int, None] = OrderedDict()  # tags in _counts, not in _waiting; LRU first
        self.early_credits_dropped = 0
        # An early tag's credits by sender (None: a transport that names none), so that the
        # expectation that claims them counts only its own peers' (see the module docstring).
        self._early_from: dict[int, dict[str | None, int]] = {}
        self._retired_peers: dict[int, frozenset[str]] = {}  # a retired tag's senders, if it had any
        # The peers of a tag whose expectation fired, for a retire before the expectation of its
        # rest (the decoder expects the first write alone): needed for as long as a request is in
        # flight, so FIRED_MAX recent tags; an older one falls back to counting any sender.
        self._fired_peers: OrderedDict[int, frozenset[str]] = OrderedDict()
        self.foreign_credits_dropped = 0
        self._waiting: dict[int, _Expectation] = {}
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, tag, seq)
        self._closed: BaseException | None = None
        self._seq = itertools.count()
        # Other deadlines run on the same thread (batch deadlines, TransferBackend._submit):
        # key -> (deadline, fn), fired in insertion order, so callers use one constant timeout.
        self._watches: OrderedDict[Hashable, tuple[float, Callable[[], Any]]] = OrderedDict()
        # Transport errors that name no request (a CQ error without our context): kept so that
        # an expectation failing at its deadline can say what the transport reported meanwhile.
        self._transport_error: tuple[float, str] | None = None
        self._timer = NamedThread(target=self._run_timer, name=f"{name}-deadlines", daemon=True)
        self._timer.start()

    def expect(self, tag: int, count: int, timeout_s: float,
               peer: str | Collection[str] | None = None) -> TransferFuture:
        """Future completed when `count` writes tagged `tag` have landed.

        `peer`: instance id(s) of the peers that send them; the loss of any of them fails
        the expectation at once, and credits another peer authenticated do not count toward
        it. None: the loss of any peer fails it, and any sender's credits count.
        """
        if not 0 <= tag < 2**32:
            raise DescriptorError(f"immediate tag {tag} outside 0..2**32-1")
        if count < 0 or timeout_s < 0:
            raise DescriptorError(f"count ({count}) and timeout_s ({timeout_s}) must be >= 0")
        peers = None if peer is None else frozenset([peer] if isinstance(peer, str) else peer)
        now = time.monotonic()
        exp = _Expectation(tag, count, now + timeout_s, peers, next(self._seq), now)
        exp.future.label = f"expect(tag={tag}, count={count})"
        with self._lock:
            if self._closed is not None:
                raise TransferError(f"backend closed: {self._closed}")
            if tag in self._waiting:
                raise DescriptorError(f"tag {tag} already has a pending expectation")
            if tag in self._retired:
                raise DescriptorError(f"tag {tag} belonged to a failed request and is retired")
            self._claim_early(tag, peers)
            if self._counts.get(tag, 0) >= count:
                self._consume(tag, count)
                self._fired(tag, peers)
                fire = True
            else:
                self._waiting[tag] = exp
                self._early.pop(tag, None)
                heapq.heappush(self._deadlines, (exp.deadline, tag, exp.seq))
                self._wake.notify()
                fire = False
        if fire:
            exp.future.set_result(count)
        return exp.future

    def add(self, tag: int, n: int = 1, source: str | None = None) -> None:
        """Credit `n` arrivals for `tag` (called from progress threads). `source`: the instance
        id of the peer that authenticated them, where the transport knows it."""
        with self._lock:
            if tag in self._retired:
                if self._foreign(source, self._retired_peers.get(tag)):
                    self.foreign_credits_dropped += n
                    return
                self.late_writes_dropped += n
                self._retired[tag] += n
                return
            exp = self._waiting.get(tag)
            if exp is not None and self._foreign(source, exp.peers):
                self.foreign_credits_dropped += n
                return
            total = self._counts.get(tag, 0) + n
            self._counts[tag] = total
            if exp is None:
                by = self._early_from.setdefault(tag, {})
                by[source] = by.get(source, 0) + n
                self._hold_early(tag)
                return
            if total < exp.count:
                return
            del self._waiting[tag]
            self._consume(tag, exp.count)
            self._fired(tag, exp.peers)
        exp.future.set_result(exp.count)

    def arrived(self, tag: int) -> int:
        with self._lock:
            return self._counts.get(tag, 0)

    def forget(self, tag: int) -> None:
        """Drop the unclaimed count of a tag nobody will expect."""
        with self._lock:
            self._counts.pop(tag, None)
            self._early.pop(tag, None)
            self._early_from.pop(tag, None)
            self._fired_peers.pop(tag, None)

    def retire(self, tag: int, reason: str = "cancelled") -> None:
        """Give up on `tag`: a pending expectation fails with TransferError(reason), and
        writes that still arrive for it are discarded."""
        with self._lock:
            e = self._waiting.get(tag)
            if e is not None:
                self._drop(e)
            else:  # between two expectations of it, the first's peers still say whose writes count
                self._retire(tag, self._fired_peers.get(tag))
        if e is not None:
            e.future.set_exception(TransferError(f"tag {tag}: {reason}"))

    def transport_error(self, text: str) -> None:
        """Record an error the transport reported without naming a request: expectations
        pending now that later miss their deadline quote it."""
        with self._lock:
            self._transport_error = (time.monotonic(), text)

    def watch(self, key: Hashable, deadline: float, fn: Callable[[], Any]) -> None:
        """Call `fn()` (on the deadline thread) at `deadline` unless unwatch(key) came first."""
        with self._lock:
            if self._closed is not None:
                return
            self._watches[key] = (deadline, fn)
            if len(self._watches) == 1:
                self._wake.notify()

    def unwatch(self, key: Hashable) -> None:
        with self._lock:
            self._watches.pop(key, None)

    def is_retired(self, tag: int) -> bool:
        with self._lock:
            return tag in self._retired

    def landed(self, tag: int) -> int:
        """How many writes of retired `tag` arrived, before it was retired and since (-1: not
        a retired tag, or forgotten)."""
        with self._lock:
            return self._retired.get(tag, -1)

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
            self._early.clear()
            self._early_from.clear()
            self._fired_peers.clear()
            self._watches.clear()
            self._wake.notify()
        for e in pending:
            e.future.set_exception(TransferError(f"tag {e.tag}: {reason}"))
        # close() may be called from a callback running on the deadline thread itself
        if threading.current_thread() is not self._timer:
            self._timer.join(timeout=1.0)

    def counters(self) -> dict[str, int]:
        """For the backend's stats: pending expectations and what was dropped, by why."""
        return {"expectations": self.pending(), "late_writes_dropped": self.late_writes_dropped,
                "foreign_credits_dropped": self.foreign_credits_dropped, "early_credits_dropped": self.early_credits_dropped}

    def pending(self) -> int:
        """How many expectations wait (none: a progress thread may sleep)."""
        with self._lock:
            return len(self._waiting)

    def _consume(self, tag: int, n: int) -> None:
        """An expectation of `tag` fired (none waits for it any more): what it leaves is early."""
        left = self._counts.get(tag, 0) - n
        if left > 0:  # counted for its expectation's peers already: no sender to check again
            self._counts[tag] = left
            self._early_from[tag] = {None: left}
            self._hold_early(tag)
        else:
            self._counts.pop(tag, None)
            self._early.pop(tag, None)
            self._early_from.pop(tag, None)

    def _fired(self, tag: int, peers: frozenset[str] | None) -> None:
        if peers is not None:
            self._fired_peers[tag] = peers
            self._fired_peers.move_to_end(tag)
            while len(self._fired_peers) > FIRED_MAX:
                self._fired_peers.popitem(last=False)

    def _foreign(self, source: str | None, peers: frozenset[str] | None) -> bool:
        """Whether credits from `source` are someone else's than `peers`' (then counted)."""
        return source is not None and peers is not None and source not in peers

    def _claim_early(self, tag: int, peers: frozenset[str] | None) -> None:
        """An expectation tied to `peers` takes only their early credits of `tag`."""
        by = self._early_from.pop(tag, None)
        if by is None or peers is None:
            return
        foreign = sum(n for source, n in by.items() if self._foreign(source, peers))
        if foreign:
            self.foreign_credits_dropped += foreign
            self._counts[tag] -= foreign
            if not self._counts[tag]:
                del self._counts[tag]

    def _hold_early(self, tag: int) -> None:
        """`tag` holds credits nobody expects yet: keep it, within EARLY_MAX tags."""
        self._early[tag] = None
        self._early.move_to_end(tag)
        while len(self._early) > EARLY_MAX:
            old, _ = self._early.popitem(last=False)
            if not self.early_credits_dropped:
                log.warning("credits for more than %d tags nobody expects: dropping the least recent "
                            "(counted in early_credits_dropped)", EARLY_MAX)
            self.early_credits_dropped += self._counts.pop(old, 0)
            self._early_from.pop(old, None)

    def _drop(self, e: _Expectation) -> None:
        del self._waiting[e.tag]
        self._retire(e.tag, e.peers)

    def _retire(self, tag: int, peers: frozenset[str] | None = None) -> None:
        self._early.pop(tag, None)
        self._claim_early(tag, peers)
        self._fired_peers.pop(tag, None)
        if peers is not None:  # its late writes count toward `landed` only from its own peers
            self._retired_peers[tag] = peers
        self._retired[tag] = self._retired.get(tag, 0) + self._counts.pop(tag, 0)
        while len(self._retired) > RETIRED_MAX:
            old, _ = self._retired.popitem(last=False)
            self._retired_peers.pop(old, None)

    def _run_timer(self) -> None:
        with self._lock:
            while self._closed is None:
                now = time.monotonic()
                calls = []
                while self._watches:
                    key, (deadline, fn) = next(iter(self._watches.items()))
                    if deadline > now:
                        break
                    del self._watches[key]
                    calls.append(fn)
                if calls:
                    self._lock.release()
                    try:
                        for fn in calls:
                            try:
                                fn()
                            except Exception:  # noqa: BLE001 - one bad watcher must not stop the deadlines
                                log.exception("deadline callback failed")
                    finally:
                        self._lock.acquire()
                    continue
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, tag, seq = heapq.heappop(self._deadlines)
                    e = self._waiting.get(tag)
                    if e is not None and e.seq == seq:
                        got = self._counts.get(tag, 0)
                        self._drop(e)
                        note = ""
                        if self._transport_error and self._transport_error[0] >= e.created:
                            note = f"; meanwhile the transport reported: {self._transport_error[1]}"
                        expired.append((e, got, note))
                if expired:
                    self._lock.release()
                    try:
                        for e, got, note in expired:
                            e.future.set_exception(DeadlineExceeded(
                                f"tag {e.tag}: {got} of {e.count} writes arrived before the deadline{note}"))
                    finally:
                        self._lock.acquire()
                    continue
                nxt = [d for d in (self._deadlines[0][0] if self._deadlines else None,
                                   next(iter(self._watches.values()))[0] if self._watches else None) if d is not None]
                self._wake.wait(min(nxt) - now if nxt else None)
