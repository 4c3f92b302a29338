"""Decoder A: running requests leaving for another decoder, from the cut to the end of the relay.

Scheduler-side contract (DecodeMessenger calls these in A's scheduler thread, leader; what
changes the scheduler's state, the cut and the settling, goes through lockstep.py so that
every TP rank does it in the same iteration):
  on_message(peer, msg)  control thread: a B's Hello, MigrationOrder or Cancel, queued (True when
                         ours); the scheduler thread applies them (targets.py)
  step()                 once per iteration: answer B's messages, cut due requests out of the
                         running batch, start their relays, free what was handed over, emit
                         relayed tokens as the requests' own
  abort(recv_req)        a client abort of a relayed request: its relay closes, B aborts
  idle()                 nothing held, cut or relayed
Worker side: write completions (backend threads) and relay threads only count/append under
their own locks and wake the scheduler.

The cut under the overlap scheduler: when a request is due its result of the batch in
flight may not be processed yet. It leaves the running batch when the cut is applied (at
once with one rank, at the next broadcast with more; so no later batch runs it) and is held
one iteration after that, once whatever was in flight for it was processed: then its KV
holds every token but the last sampled one, with or without overlap.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .. import wire
from ..entry import Phase
from ..kvpool import page_ids
from .carry import Carried, refusals
from .drain import MAX_IN_FLIGHT, DrainDoor
from .metrics import MigrationMetrics
from .hook import TestHook
from .lockstep import MigrationCut, MigrationSettled, Outcome
from .relay import Relay, finish_reason, merge_speculation
from .room import Source
from .source import Held, HeldState, MigrationSource
from .targets import Targets

logger = logging.getLogger("sglang_disagg.migration")
CUT_ATTR = "sglang_disagg_migrated"
WAITING = (Phase.MEMORY, Phase.ROUTE, Phase.TRANSFER)  # a messenger entry that is a request to come
TRIED_ATTR = "sglang_disagg_migration_tried"  # the targets a request failed to move to (a drain tries the others)


@dataclass(slots=True, eq=False)
class Away:
    """A request that left A's batch: held, then relayed."""

    req: Any
    to: str
    source: Source
    carried: Carried | None = None
    relay: Relay | None = None
    held: Held | None = None
    cut_step: int = 0        # the step of Outgoing in which (or before which) it left the batch
    handed: float = 0.0      # when A's pages were freed (every write completed)
    cut_at: float = field(default_factory=time.monotonic)
    aborted: bool = False
    pending: dict | None = None  # B's finish, seen before A's writes were all complete
    spec_base: tuple[int, int, tuple[int, ...]] = (0, 0, ())  # A's speculative counters at the hold


class Outgoing:
    def __init__(self, messenger: Any) -> None:
        self.m, self.sched, self.node = messenger, messenger.sched, messenger.node
        self.source = MigrationSource(self.node.view.geometry, messenger.ranks.size)
        self.hook = TestHook.from_env()
        self.secret = messenger.secret  # loaded once, by the decode messenger
        args = self.sched.server_args
        self.api_key = getattr(args, "api_key", None)
        # what decides which requests can move (carry.py): a sampled one only under deterministic
        # inference (a speculative decoder's draft KV moves with the target's: its view's layers)
        self.deterministic = bool(getattr(args, "enable_deterministic_inference", False))
        self.inbox: collections.deque[tuple[Any, wire.Message]] = collections.deque()
        self.cutting: list[Away] = []
        self.deciding: dict[str, tuple[Any, str]] = {}  # rid -> (request, target): cut, not applied yet
        self.lock = messenger.lock
        self.lock.on_cut = self._cut_applied
        self.steps, self._in_step = 0, False
        self.away: dict[str, Away] = {}           # handle -> request held or relayed
        self.recent: collections.deque[dict] = collections.deque(maxlen=64)  # migration traces
        self.failures: collections.deque[dict] = collections.deque(maxlen=8)  # the last ones, for /drain
        # Requests given back to SGLang's queue by a failed migration: between the queue and the
        # running batch (their prefill from the tree) they are in neither, and still here.
        self.returned: list[Any] = []
        self.stats = {"migrations_started": 0, "migrations_handed_over": 0, "migrations_failed": 0,
                      "migrations_refused": 0, "migration_bytes": 0, "relays_active": 0}
        self.metrics = MigrationMetrics(self.node.metrics.registry, self.stats)
        self.door = DrainDoor(getattr(self.sched.server_args, "admin_api_key", None), self.node.wakeup.set)
        if self.node.metrics.server is not None:
            self.node.metrics.server.routes.add("/drain", self.door)
        self.draining: tuple[str, ...] = ()   # the decoders a drain moves requests to
        self.drain_base: dict = {}
        self.changed = False  # a migration was handed over or ended since the messenger last published
        self.targets = Targets(self)
        self.sent: dict[str, int] = {}        # target -> migrations from here not handed over yet

    # ----- control thread -------------------------------------------------------------
    def on_message(self, peer: Any, msg: wire.Message) -> bool:
        if not isinstance(msg, (wire.Hello, wire.MigrationOrder, wire.Cancel)):
            return False
        self.inbox.append((peer, msg))
        self.node.wakeup.set()
        return True

    # ----- scheduler thread -----------------------------------------------------------
    def idle(self) -> bool:
        return not (self.away or self.cutting or self.deciding or self.inbox)

    def wants_step(self) -> bool:
        return self.hook is not None or bool(self.draining) or not self.idle() or self.door.status.get("draining")

    def step(self) -> None:
        self.steps, self._in_step = self.steps + 1, True
        try:
            self._step()
        finally:
            self._in_step = False

    def _step(self) -> None:
        while self.inbox:
            self.targets.on(*self.inbox.popleft())
        asked = self.door.take()
        if asked:
            if not self.draining:  # what the status counts: since this drain began
                self.drain_base = dict(self.stats)
            self.draining = asked
            logger.warning("migration: draining: running requests move to %s", ", ".join(asked))
        self.targets.post_due()
        self._hold_cut()
        if self.hook is not None or self.draining:
            self._cut_due()
        for h in self.source.expired():
            if (a := self.away.get(h.rid)) is not None:
                self._back(a, "no order came from the new decoder in time")
        for h in self.source.settled():
            self.targets.settled(h)
            a = self.away.get(h.rid)
            if a is None:
                continue
            if h.state is HeldState.WRITTEN and not a.aborted and not (a.relay is not None and a.relay.failed):
                self._handed(a)
            else:
                self._back(self.away.pop(h.rid), h.error or "the migration failed")
        self.targets.answer_cancels()
        self._relay()
        if self.draining:
            self._publish()

    def _publish(self) -> None:
        batch = self.sched.running_batch
        in_batch = {id(r) for r in batch.reqs}
        seen = in_batch | {id(r) for r in self.sched.waiting_queue}
        self.returned = [r for r in self.returned if not r.finished() and not getattr(r, CUT_ATTR, False)
                         and id(r) not in in_batch]  # back in the batch: counted there from now on
        # Waiting: no output token yet, receiving its KV (the messenger's) or queued for its first
        # step (SGLang's). Each migrates once it has a token; until then the drain is not done.
        fresh = sum(1 for r in self.sched.waiting_queue if not r.output_ids)
        waiting = fresh + sum(1 for e in self.m.entries.values() if e.phase in WAITING)
        running = len(seen) - fresh + sum(1 for r in self.returned if id(r) not in seen)
        relaying = sum(1 for a in self.away.values() if a.handed)
        since = {k: self.stats[k] - self.drain_base.get(k, 0) for k in self.stats}
        self.door.publish({"draining": True, "to": list(self.draining), "running": running, "waiting": waiting,
                           "migrating": len(self.away) - relaying + len(self.cutting) + len(self.deciding),
                           "relaying": relaying,
                           "migrated": since["migrations_handed_over"], "failed": since["migrations_failed"],
                           "refused": since["migrations_refused"], "last_failures": list(self.failures),
                           "done": running == 0 and waiting == 0 and len(self.away) == relaying
                           and not self.cutting and not self.deciding})

    def abort(self, recv_req: Any) -> None:
        from ..requests import abort_matches

        for a in [*self.away.values(), *self.cutting]:  # cut but not held yet: in no batch SGLang aborts in
            if abort_matches(recv_req, a.req.rid) and not a.aborted:
                a.aborted = True
                if a.relay is not None:
                    a.relay.close()

    # ----- the cut ----------------------------------------------------------------------
    def _cut_due(self) -> None:
        batch = self.sched.running_batch
        inflight = 1 if getattr(self.sched, "enable_overlap", False) else 0
        # With more ranks the cut reaches the batches at the next broadcast: one more decode
        # step runs first (the hook's count stays exact for a request decoding on its own)
        inflight += 1 if self.m.ranks.size > 1 else 0
        due = [(r, hit[1]) for r in batch.reqs if not getattr(r, CUT_ATTR, False) and not r.finished()
               and self.hook is not None and (hit := self.hook.after(r.rid)) is not None
               and len(r.output_ids) >= hit[0] - inflight and hit[1] not in getattr(r, TRIED_ATTR, ())]
        if self.draining:
            room = MAX_IN_FLIGHT - sum(1 for a in self.away.values() if not a.handed) - len(self.cutting) - \
                len(self.deciding)
            for r in batch.reqs:
                if room <= len(due):
                    break
                left = [t for t in self.draining if t not in getattr(r, TRIED_ATTR, ())]
                if left and not getattr(r, CUT_ATTR, False) and not r.finished() and r.output_ids and \
                        all(r is not d for d, _ in due):
                    due.append((r, min(left, key=lambda t: self.sent.get(t, 0))))
                    self.sent[due[-1][1]] = self.sent.get(due[-1][1], 0) + 1
        cut = []
        for req, to in due:
            setattr(req, CUT_ATTR, True)
            why = refusals(req, self.deterministic)
            if why:
                self.stats["migrations_refused"] += 1
                self.metrics.outcome("refused")
                logger.warning("migration: %s stays here: %s", req.rid, "; ".join(why))
                continue
            self.deciding[req.rid] = (req, to)
            cut.append(req.rid)
        if cut:
            self.lock.send(MigrationCut(tuple(cut)))  # every rank: out of the batch (_cut_applied here)

    def _cut_applied(self, item: MigrationCut, reqs: list[Any]) -> None:
        """Every rank took `reqs` out of its batch (lockstep.py); here they begin to leave."""
        found = {r.rid for r in reqs}
        # cut during a step: held at the next; cut by the broadcast, before a step: the one after
        step = self.steps if self._in_step else self.steps + 1
        for rid in item.rids:
            req, to = self.deciding.pop(rid, (None, ""))
            if req is None:
                continue
            if rid in found:
                source = Source.new(self.node.endpoints[0].address, group=self.node.group, groups=self.node.groups)
                self.cutting.append(Away(req, to, source, cut_step=step))
            else:  # it finished or was retracted before the cut reached the ranks: nothing moves
                setattr(req, CUT_ATTR, False)

    def _hold_cut(self) -> None:
        """Requests cut one iteration ago: what was in flight for them is processed now."""
        due = [a for a in self.cutting if a.cut_step < self.steps]
        self.cutting = [a for a in self.cutting if a.cut_step >= self.steps]
        for a in due:
            req = a.req
            if req.finished():  # it ended in the batch that was in flight: SGLang finished it
                self.lock.send(MigrationSettled(req.rid, Outcome.GONE))
                continue
            if getattr(req, "to_finish", None) is not None:
                # SGLang marked it to finish at its next result (an abort that came before the cut
                # reached the batch, a discarded output), which no batch here gives it now: it ends
                # as SGLang would have ended it
                req.finished_reason, req.to_finish = req.to_finish, None
                self.sched.output_streamer.stream_output([req], False)
                self.lock.send(MigrationSettled(req.rid, Outcome.ENDED))
                continue
            if a.aborted:  # the client left after the cut, before the hold (abort() found it here)
                self._back(a, "the client left")
                continue
            try:
                a.carried = Carried.of(req, self.deterministic)
                a.spec_base = (int(getattr(req, "spec_verify_ct", 0) or 0),
                               int(getattr(req, "spec_num_correct_drafts", 0) or 0),
                               tuple(getattr(req, "spec_correct_drafts_histogram", None) or ()))
                if a.carried.grammar:  # B's grammar accepts every output first (room.py: replay)
                    a.source = dataclasses.replace(a.source, replay=len(a.carried.outputs))
                n = a.carried.kv_tokens
                row = self.sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx][:n]
                self.source.hold(str(a.source.handle), page_ids(row.tolist(), self.node.page_size), n)
            except Exception as e:  # noqa: BLE001 - whatever it was, the request continues here
                self._back(a, f"{type(e).__name__}: {e}")
                continue
            body = {**a.carried.resume(), **a.source.fields(self.secret, req.rid)}
            a.relay = Relay(a.to, body, self.api_key, self.node.wakeup.set)
            self.away[str(a.source.handle)] = a
            self.stats["migrations_started"] += 1
            self.metrics.outcome("started")
            self.stats["relays_active"] += 1
            a.relay.start()
            logger.info("migration: %s cut after %d output tokens, to %s", req.rid, len(req.output_ids), a.to)

    def _handed(self, a: Away) -> None:
        """Every write completed: A's pages go (every rank); the request lives on B, relayed here."""
        self.lock.send(MigrationSettled(a.req.rid, Outcome.HANDED))
        a.handed = time.monotonic()
        self.changed = True
        self._unsent(a)
        self.stats["migrations_handed_over"] += 1
        self.stats["migration_bytes"] += a.held.nbytes if a.held else 0
        self.metrics.handed_over(a.held.nbytes if a.held else 0, a.handed - a.cut_at)
        self.recent.append({"rid": a.req.rid, "to": a.to, "outputs_at_cut": len(a.carried.outputs),
                            "kv_tokens": a.carried.kv_tokens, "bytes": a.held.nbytes if a.held else 0,
                            "writes": a.held.writes if a.held else 0,
                            "hand_over_s": round(a.handed - a.cut_at, 4)})
        logger.info("migration: %s handed over to %s (%d bytes, %.3f s after the cut)", a.req.rid, a.to,
                    a.held.nbytes if a.held else 0, a.handed - a.cut_at)

    def _back(self, a: Away, reason: str) -> None:
        """The migration failed before the hand-over: the request continues here. Its KV is
        given back through SGLang's retraction path (radix tree kept), and it re-enters the
        waiting queue: its prompt + outputs match the tree, so little is recomputed."""
        self.stats["migrations_failed"] += 1
        self.metrics.outcome("failed")
        self.changed = True
        self._unsent(a)
        if a.relay is not None:
            a.relay.close()
            self.stats["relays_active"] -= 1
        logger.warning("migration: %s stays on this decoder: %s", a.req.rid, reason)
        self.failures.append({"rid": str(a.req.rid)[:128], "to": a.to, "reason": reason[:300]})
        # a drain may try it on another target (never the same twice: TRIED_ATTR)
        setattr(a.req, TRIED_ATTR, (*getattr(a.req, TRIED_ATTR, ()), a.to))
        setattr(a.req, CUT_ATTR, False)
        self.away.pop(str(a.source.handle), None)
        self.source.drop(str(a.source.handle))  # held with no write posted (posted ones settled first)
        if a.aborted:
            self._finish(a, {"type": "abort", "message": "aborted"})
            self.lock.send(MigrationSettled(a.req.rid, Outcome.ENDED))
            return
        self.lock.send(MigrationSettled(a.req.rid, Outcome.BACK))  # every rank: to the waiting queue
        self.returned.append(a.req)  # counted as running here until it runs or moves again

    def _unsent(self, a: Away) -> None:
        if self.sent.get(a.to):
            self.sent[a.to] -= 1

    # ----- the relay ----------------------------------------------------------------------
    def _relay(self) -> None:
        out = []
        for key, a in list(self.away.items()):
            if a.relay is None:
                continue
            new, finish, error = a.relay.take()
            if a.aborted and not a.handed:
                # The client left before the hand-over: with no write posted A's pages go now,
                # else once its writes settled (the settled loop then ends it the same way).
                if self.source.drop(key):
                    self._back(a, "the client left")
                continue
            if new:
                a.req.output_ids.extend(new)
            merge_speculation(a.req, a.spec_base, a.relay.speculation())
            if error and not a.handed:
                # B failed before the hand-over: with no write posted the request comes back now,
                # else once A's writes settled (its pages may not be reused before).
                if self.source.drop(key):
                    self._back(a, error)
                continue
            if error or a.aborted:
                finish = {"type": "abort", "message": "aborted" if a.aborted else error}
            if finish and not a.handed:
                # B ended it before A saw every write complete: A's pages are still lent to the
                # writes in flight, so the request ends here once they settled (_handed)
                a.pending, finish = finish, None
            elif a.handed and a.pending and not finish:
                finish, a.pending = a.pending, None
            if new or finish:
                out.append(a.req)
            if finish:
                self._finish(a, finish)
                self.changed = True
                del self.away[key]
                self.stats["relays_active"] -= 1
        if out:
            self.sched.output_streamer.stream_output(out, False)

    @staticmethod
    def _finish(a: Away, finish: dict) -> None:
        a.req.finished_reason = finish_reason(finish, a.carried.max_new_tokens if a.carried else 0)
