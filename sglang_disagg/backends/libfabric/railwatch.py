"""What each rail of the libfabric backend carries, whether it is up, and what happens when one
stops: `RailBook` (the bookkeeping, pure) and `RailWatch` (a mixin of the backend).

Choosing: each batch goes to the rail, among the peer's routes that are up for that peer and
run from a rail carrying the source region to a peer rail carrying the destination
(registration.py), that has carried the fewest bytes since the rails last changed state (a rail
that comes back starts even with the others); the first such route of that rail (its paired peer
rail, rails.py). With no such route, or every one down, the batch is refused with the reason.

A lost rail (two rails or more). A tcp link that goes down stalls its writes rather than
failing them, so the progress of each (rail, peer) is watched: a rail with batches in flight to a
peer and none completed for RAIL_STALL_S since it last made progress, while another rail to the
same peer completed one since then, is down for that peer (when every rail to a peer stalls, the peer is slow or gone:
the heartbeat and the transfer deadline judge that, as with one rail). Then its batches in
flight to that peer fail with the reason (their writes stay the provider's, freed unreported when
they complete), so the requests they carried fail as after any failed write: the decoder holds
their pages until every write posted for them arrived or LATE_WRITES_S passed (messenger/entry.py;
the stalled writes are delivered when the link returns, as after a partition). They are not
re-posted on another rail: those that landed before the stall would count twice toward the tag.
New batches to that peer leave the rail out until a TCP connection from the rail's address reaches
the peer rail's listener (probed every RAIL_PROBE_S); then it takes its share again. Other peers
and the peer's other requests are untouched.

Contract with the backend: `_eps`, `_nets`, `_book`, `_closed`, `_complete_batch`, `peers()`;
`_rail_tick()` is called by the watchdog loop; abandoning a batch in the shim is `_abandon(rail, id)`.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence

from ..errors import TransferError
from . import rails as railmod
from ...threads import Thread as NamedThread

log = logging.getLogger("sglang_disagg.backends.libfabric.backend")
RAIL_STALL_S = 1.0   # a rail with writes in flight and none done this long is down (fault deadline: 2 s)
RAIL_PROBE_S = 1.0   # how often a down rail is probed
PROBE_TIMEOUT_S = 0.5


class RailState(enum.Enum):
    UP = "up"
    DOWN = "down"


Key = tuple[int, str]  # (local rail, peer instance id)


class RailBook:
    """Per rail: bytes and writes posted; per (rail, peer): batches in flight, last completion,
    state."""

    def __init__(self, rails: int) -> None:
        self._lock = threading.Lock()
        self.rails = rails
        self.bytes = [0] * rails
        self.writes = [0] * rails
        # What the choice balances: bytes since the rails last changed state (a rail coming back
        # starts even, rather than taking every batch until it caught up with the others' lifetime)
        self._weight = [0] * rails
        self.lost = 0
        self._down: set[Key] = set()
        self._done_at: dict[Key, float] = {}
        self._live: dict[int, tuple[Key, float]] = {}  # batch id -> ((rail, peer), posted at)

    def pick(self, peer: str, routes: Sequence[railmod.RailRoute], n: int, nbytes: int,
             ours: frozenset[int] | None = None, theirs: frozenset[int] | None = None) -> railmod.RailRoute:
        """Among routes from one of `ours` (our rails that registered the source; None: any) to
        one of `theirs` (the peer rails that registered the destination; None: any)."""
        with self._lock:  # scheduler and streamer threads post concurrently
            fit = [r for r in routes if (ours is None or r.local in ours) and (theirs is None or r.remote in theirs)]
            if not fit:
                raise TransferError(
                    f"libfabric: no route from a rail holding the source region (ours: "
                    f"{'any' if ours is None else sorted(ours)}) to a rail holding the destination (theirs: "
                    f"{'any' if theirs is None else sorted(theirs)}); routes to this peer: "
                    f"{sorted({(r.local, r.remote) for r in routes})}")
            up = [r for r in fit if (r.local, peer) not in self._down]
            if not up:
                raise TransferError(f"libfabric: every rail to this peer is down (of those carrying these regions: "
                                    f"rails {sorted({r.local for r in fit})}); waiting for one to answer again")
            best = min(up, key=lambda r: self._weight[r.local])
            self._weight[best.local] += nbytes
            self.bytes[best.local] += nbytes
            self.writes[best.local] += n
        return best

    def posted(self, batch_id: int, rail: int, peer: str, now: float) -> None:
        with self._lock:
            self._live[batch_id] = ((rail, peer), now)

    def finished(self, batch_id: int, now: float) -> None:
        """A batch completed (well or not): its rail made progress to its peer."""
        with self._lock:
            got = self._live.pop(batch_id, None)
            if got is not None:
                self._done_at[got[0]] = now

    def forget(self, batch_id: int) -> None:
        """A batch failed here (expired, its peer or endpoint gone): no progress, not judged."""
        with self._lock:
            self._live.pop(batch_id, None)

    def forget_peer(self, peer: str) -> None:
        with self._lock:
            for bid in [b for b, ((_, p), _) in self._live.items() if p == peer]:
                del self._live[bid]

    def stalled(self, now: float, stall_s: float) -> list[tuple[int, str, list[int]]]:
        """(rail, peer, its live batch ids) for each up (rail, peer) with batches in flight and no
        completion for `stall_s` since it last made progress (the later of its last completion and
        its oldest live batch's post), while another rail to that peer completed one since then."""
        with self._lock:
            oldest: dict[Key, float] = {}
            for key, at in self._live.values():
                oldest[key] = min(at, oldest.get(key, at))
            out = []
            for (rail, peer), at in sorted(oldest.items()):
                since = max(at, self._done_at.get((rail, peer), 0.0))
                if (rail, peer) in self._down or now - since <= stall_s:
                    continue
                others = any(t > since for (r, p), t in self._done_at.items() if p == peer and r != rail)
                if others:
                    out.append((rail, peer, [b for b, (k, _) in self._live.items() if k == (rail, peer)]))
            return out

    def mark(self, rail: int, peer: str, state: RailState) -> None:
        with self._lock:
            key = (rail, peer)
            if state is RailState.DOWN:
                self.lost += key not in self._down
                self._down.add(key)
                for bid in [b for b, (k, _) in self._live.items() if k == key]:
                    del self._live[bid]  # they fail here; never judged again
            else:
                self._down.discard(key)
            self._done_at[key] = time.monotonic()
            self._weight = [0] * self.rails

    def down(self) -> list[Key]:
        with self._lock:
            return sorted(self._down)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {"rails_lost": self.lost}
            down = {r for r, _ in self._down}
            for i, (b, w) in enumerate(zip(self.bytes, self.writes)):
                out[f"rail{i}_bytes"], out[f"rail{i}_writes"] = b, w
                out[f"rail{i}_up"] = int(i not in down)  # 0 while down for any peer
            return out


class RailWatch:
    def _init_rails(self, rails: int) -> None:
        self._book = RailBook(rails)
        self._probe_at = 0.0
        self._probing = False

    def _rail_tick(self) -> None:
        """Watchdog thread, every tick: a stalled (rail, peer) is down; down ones are probed."""
        if len(self._eps) < 2 or self._closed:
            return
        now = time.monotonic()
        for rail, peer, batches in self._book.stalled(now, RAIL_STALL_S):
            self._book.mark(rail, peer, RailState.DOWN)
            why = (f"libfabric rail {rail} ({self._nets[rail]}) to peer {peer[:8]} stalled: no write completed on it "
                   f"for {RAIL_STALL_S:g} s while another rail's did; its link is down or cut (the rail is left "
                   "out for this peer until it answers again)")
            log.warning("%s; failing %d batch(es) in flight on it", why, len(batches))
            for bid in batches:
                self._abandon(rail, bid)
                self._complete_batch(bid, why)
        if self._book.down() and not self._probing and now - self._probe_at >= RAIL_PROBE_S:
            self._probe_at, self._probing = now, True
            NamedThread(target=self._probe_rails, name="libfabric-rail-probe", daemon=True).start()

    def _probe_rails(self) -> None:
        try:
            routes: dict[tuple[int, str], railmod.RailRoute] = {}
            for p in self.peers():
                for r in p.native or ():
                    routes.setdefault((r.local, p.id), r)  # the rail's paired peer rail
            for rail, peer in self._book.down():
                route = routes.get((rail, peer))
                if route is not None and railmod.reachable(str(self._nets[rail].ip), route.address, PROBE_TIMEOUT_S):
                    self._book.mark(rail, peer, RailState.UP)
                    log.warning("libfabric: rail %d (%s) reaches peer %s again: back in use", rail,
                                self._nets[rail], peer[:8])
        finally:
            self._probing = False
