"""Decoder A's side of a migration: the requests it holds for another decoder, and the
writes that move their KV into decoder B's pages.

A held request has left A's running batch at a step boundary (its KV up to the last
computed position is complete, its last sampled token not yet run: the cut point, see
migration/__init__.py). Its pages stay A's until B's MigrationOrder came and every write
posted for it completed, or until no order came within `hold_s` (B never asked: the
request goes back to A's batch and continues there, nothing lost). B names only its own
pages; A checks B's claims (which request, how many tokens, how many pages) against what
it holds and refuses anything else, so a peer cannot make A write pages it does not hold
for that request.

Planning is the prefill-to-decode planner's (planner.ShardPlan: any TP pair, MLA replicas,
HND page-shards in one write each); the decoder counts writes by immediate as from a
prefill server, so B needs nothing new to receive. Everything before `post` is pure and
address-free; `post` binds the plan to registered regions.

Threads: hold/take/finish and expiry run in A's scheduler thread; write completions arrive
on backend threads and only count (under the held request's lock).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import wire
from ..kvpool import post
from ..planner import KVGeometry, ShardPlan, WriteGroup, pages_for

MAX_HELD = 1024   # requests one decoder holds for others at once (a drain moves at most its batch)
HOLD_S = 10.0     # how long a held request waits for its order before it goes back to A's batch


class MigrationRefused(Exception):
    """A migration that cannot go ahead, with the reason (the request stays where it is)."""


class HeldState(enum.Enum):
    HELD = "held"          # out of A's batch, pages kept, waiting for B's order
    WRITING = "writing"    # B's order came: writes posted, some not completed
    WRITTEN = "written"    # every write completed: A's pages can be freed
    FAILED = "failed"      # a write failed or the order was refused: the request goes back to A


@dataclass(slots=True, eq=False)
class Held:
    rid: str
    pages: tuple[int, ...]   # A's page ids (alike on every rank), in token order
    num_tokens: int          # tokens whose KV the pages hold
    since: float
    state: HeldState = HeldState.HELD
    tag: int = 0
    posted: int = 0          # write batches posted
    writes: int = 0          # single writes in them: what B counts
    completed: int = 0
    nbytes: int = 0
    error: str = ""
    later: tuple = ()        # write groups held back (a fault test's stall: post_later posts them)
    tag_of: tuple = ()       # (B's name, the order's tag): what B's Cancel names
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def done_one(self, err: BaseException | None) -> None:  # backend thread
        with self._lock:
            self.completed += 1
            if err is not None and not self.error:
                self.error = f"KV write to the new decoder failed: {err}"
            if self.completed == self.posted and not self.later:
                self.state = HeldState.FAILED if self.error else HeldState.WRITTEN


class MigrationSource:
    """The requests A holds for other decoders (bounded), and their plans."""

    def __init__(self, geometry: KVGeometry, tp: int, max_held: int = MAX_HELD, hold_s: float = HOLD_S) -> None:
        self.geometry, self.tp, self.max_held, self.hold_s = geometry, tp, max_held, hold_s
        self.held: dict[str, Held] = {}

    # ----- scheduler thread -----------------------------------------------------------
    def hold(self, rid: str, pages: Sequence[int], num_tokens: int, now: float | None = None) -> Held:
        """Keep `rid`'s pages for a migration; raises MigrationRefused when it cannot be held."""
        if rid in self.held:
            raise MigrationRefused(f"request {rid} is already being migrated")
        if len(self.held) >= self.max_held:
            raise MigrationRefused(f"{len(self.held)} requests are already held for migration (at most "
                                   f"{self.max_held})")
        need = pages_for(num_tokens, self.geometry.page_size)
        if num_tokens < 1 or len(pages) < need:
            raise MigrationRefused(f"request {rid}: {len(pages)} pages cannot hold {num_tokens} tokens")
        h = Held(rid, tuple(int(p) for p in pages[:need]), num_tokens, time.monotonic() if now is None else now)
        self.held[rid] = h
        return h

    def plan(self, order: wire.MigrationOrder, dst_tp: int) -> tuple[Held, list[WriteGroup], int]:
        """The held request `order` names, the write groups moving all its KV into B's
        pages and the writes B will count; raises MigrationRefused naming what does not
        match (nothing is posted then). Pure: no addresses."""
        h = self.held.get(order.rid)
        if h is None:
            raise MigrationRefused(f"no request {order.rid!r} is held for migration here")
        if h.state is not HeldState.HELD:
            raise MigrationRefused(f"request {order.rid} is {h.state.value}, not waiting for an order")
        if order.num_tokens != h.num_tokens:
            raise MigrationRefused(f"request {order.rid} holds KV of {h.num_tokens} tokens, the order names "
                                   f"{order.num_tokens}")
        if len(order.dst_pages) != len(h.pages):
            raise MigrationRefused(f"request {order.rid} needs {len(h.pages)} pages, the order gives "
                                   f"{len(order.dst_pages)}")
        plan = ShardPlan.build(self.geometry, self.tp, dst_tp).for_request(order.tag)
        return h, plan.groups(h.pages, order.dst_pages), plan.total_writes(len(h.pages))

    def post(self, h: Held, tag: int, groups: list[WriteGroup], backend: Any, peers: dict[int, Any],
             regions: Sequence[Sequence[Any]], remote: dict[int, list[Any]],
             wakeup: Callable[[], None] = lambda: None, hold_back: int = 0) -> None:
        """Post every group (A's leader holds every rank's regions); completions count on
        backend threads. A failure to post marks the request FAILED once the posted ones
        drained (it then goes back to A's batch: B never completes its count). With `hold_back`
        (a fault test's stall) the last that many groups wait for post_later."""
        h.state, h.tag = HeldState.WRITING, tag
        if hold_back:
            with h._lock:
                h.later = (groups[-hold_back:], backend, peers, regions, remote, wakeup)
            groups = groups[:-hold_back]
        kinds = len(self.geometry.kinds)
        futures = []
        try:
            for g in groups:
                fut = post(backend, peers[g.dst_rank], g, regions[g.src_rank], remote[g.dst_rank], tag, kinds)
                with h._lock:
                    h.posted += 1
                    h.writes += g.writes
                    h.nbytes += g.nbytes
                futures.append(fut)
        except Exception as e:  # noqa: BLE001 - the migration fails; what was posted still drains
            with h._lock:
                h.error = f"posting the migration's KV writes failed: {e}"
                if h.completed == h.posted:
                    h.state = HeldState.FAILED
        if not futures:
            with h._lock:
                if not h.error and h.completed == h.posted and not h.later:
                    h.state = HeldState.WRITTEN
        for fut in futures:
            fut.add_done_callback(lambda f: (h.done_one(f.exception()), wakeup()))

    def cancel(self, h: Held) -> None:
        """B gave the request up: nothing more is posted; FAILED once the posted writes drained."""
        with h._lock:
            h.later = ()
            if not h.error:
                h.error = "the new decoder gave it up"
            if h.state is HeldState.HELD or h.completed == h.posted:
                h.state = HeldState.FAILED

    def post_later(self, h: Held, limit: int | None = None) -> None:
        """Post the groups `post` held back (a stalled migration going on), or the first `limit`
        of them (a paced one, pacer.py: the rest stay held back)."""
        with h._lock:
            if not h.later:
                return
            if h.error:  # failed meanwhile: nothing more goes out; FAILED once the posted drained
                h.later = ()
                if h.completed == h.posted:
                    h.state = HeldState.FAILED
                return
            groups, backend, peers, regions, remote, wakeup = h.later
            n = len(groups) if limit is None else max(0, limit)
            now, keep = tuple(groups[:n]), tuple(groups[n:])
            h.later = (keep, backend, peers, regions, remote, wakeup) if keep else ()
        if now:
            self.post(h, h.tag, list(now), backend, peers, regions, remote, wakeup)

    @staticmethod
    def later_sizes(h: Held) -> list[int]:
        """The bytes of each group still held back, in order."""
        with h._lock:
            return [g.nbytes for g in h.later[0]] if h.later else []

    def drop(self, rid: str) -> bool:
        """Forget a held request no order came for (B gave up first); False if writes were posted
        (then it settles first: its pages may not be reused while a write is in flight)."""
        h = self.held.get(rid)
        if h is None or h.state is not HeldState.HELD:
            return False
        del self.held[rid]
        return True

    def expired(self, now: float | None = None) -> list[Held]:
        """Held requests no order came for within hold_s: forgotten here, to go back to A's batch."""
        now = time.monotonic() if now is None else now
        out = [h for h in self.held.values() if h.state is HeldState.HELD and now - h.since > self.hold_s]
        for h in out:
            del self.held[h.rid]
        return out

    def settled(self) -> list[Held]:
        """Held requests whose writes all completed (WRITTEN: free A's pages) or that failed
        (FAILED: back to A's batch, after its posted writes drained), forgotten here."""
        out = [h for h in self.held.values() if h.state in (HeldState.WRITTEN, HeldState.FAILED)]
        for h in out:
            del self.held[h.rid]
        return out
