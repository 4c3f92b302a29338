"""Decode side: a request's prompt KV is computed by a prefill server and lands in pages
this decoder allocated; the request then runs its last prompt token as an ordinary
one-token extend (which samples the first output token, grammar included).

Scheduler-side contract (messenger/contract.py; hooks.py calls these on every TP rank, in the
scheduler thread):
  take(req)            a new request; True when the messenger owns it from now on
  apply(item)          a leader decision, arriving through SGLang's request broadcast: a Route,
                       or a migration's cut or settling (migration/lockstep.py)
  leader_inputs()      (leader) decisions to inject into the next broadcast
  step()               once per iteration: admit, agree with the other ranks, hand off, free
  abort(recv_req)      a client abort, for requests the messenger holds
  prefix_tree(req, t)  the tree to match a waiting request against (None: KV already held)
Worker side (backend threads): an expectation completing sets the entry's `landed` or
`failed` flag and wakes the scheduler; nothing else runs off the scheduler thread.

Lifecycle: MEMORY (pages allocated on every rank alike) -> ROUTE (the leader picks a
prefill server and a fresh tag) -> TRANSFER (the leader's backend, which holds every
rank's KV pages, expects the planner's total number of writes with that tag) -> handed to
SGLang's waiting queue once the writes landed.
A failure moves the request to RELEASE: the client gets the error at once, the tag is
retired (late writes are discarded) and the pages stay held until no write can land any
more (the prefill server confirmed the cancel, or it is gone: its link is GONE). A cancel
left unconfirmed for CANCEL_TIMEOUT_S (a hung server) moves the pages to QUARANTINE: out
of use until the server answers after all or is gone.
Re-routing: a request whose prefill server was lost before any of its writes landed (the
first write is expected on its own, so the decoder knows) goes back to ROUTE once, to
another ready prefill server, when the lost one is known to be gone (a dropped connection
to a live server is not enough: that server might still write into the pages).
"""

from __future__ import annotations

import collections
from http import HTTPStatus
import itertools
import logging
import time
from typing import Any

from . import admission, wire
from .config import MessengerConfig
from .decode_endings import RequestEndings
from .entry import Entry, Lost, Phase, Release, lost_verdict
from .faults import Fault
from .inputs import MessengerInput, Route
from .links import Links, LinkState
from ..backends import auth
from .migration.away import Outgoing
from .migration.carry import migration_refused
from .migration.lockstep import Lockstep
from .migration.room import Source, SourceError
from .metrics import Cause, scheduler_state
from ..backends import PeerLostError
from .node import Node
from .planner import ShardPlan
from .requests import HANDOFF_ATTR, LOCK_ATTR, abort_matches, fail_request, release

logger = logging.getLogger("sglang_disagg.messenger")



class DecodeMessenger(RequestEndings):
    def __init__(self, cfg: MessengerConfig, scheduler: Any) -> None:
        self.cfg, self.sched = cfg, scheduler
        self.node = Node(cfg, scheduler)
        self.ranks, self.backend = self.node.ranks, self.node.backend
        self.fault = Fault.from_env()
        self.entries: dict[int, Entry] = {}
        self._seq = itertools.count()
        self._tags = itertools.count(1)
        self.stats = {"requests_carried": 0, "requests_local": 0, "requests_failed": 0, "writes_received": 0,
                      "pages_reused": 0, "pages_quarantined": 0, "requests_rerouted": 0,
                      "late_writes_given_up": 0}
        self.links: Links | None = None
        self._inbox: collections.deque[tuple[Any, wire.Message]] = collections.deque()
        self.recent: collections.deque[dict] = collections.deque(maxlen=64)  # handed-off requests' timelines
        self._first_step: dict[str, float] = {}  # rid -> hand-off time, until its first output token
        self.node.metrics.watch(self._gauges)
        self.secret = auth.load_secret() or b""
        # requests migrating away: cut and settled alike on every rank (migration/lockstep.py), by the
        # leader's decisions (migration/away.py)
        self.lock = Lockstep(scheduler, self.ranks.size)
        self.out = Outgoing(self) if self.ranks.is_leader else None
        if self.ranks.is_leader:
            hello = wire.Hello(decoder=self.node.name, backend=self.backend.name, provider=self.backend.provider,
                               kv=self.node.spec, ranks=self.node.endpoints, group=self.node.group)
            self.links = Links(self.node, hello, cfg.prefill, cfg.connect_timeout_s, on_change=self.node.wakeup.set,
                               recheck_s=cfg.recheck_s)
            self.node.start_reader(self._on_message)

    # ----- intake -------------------------------------------------------------------
    def take(self, req: Any) -> bool:
        n = len(req.origin_input_ids) - 1
        # A request SGLang rejected at intake (e.g. too long for this pool, a migrated one too)
        # ends by SGLang's own path with its reason (a migration's source then keeps it)
        rejected = admission.rejected(req)
        try:
            source = None if rejected else Source.of(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room, self.secret, req.rid)
            if source is not None:
                migration_refused(self.sched.server_args, req, source.replay)
        except SourceError as e:
            e_ = Entry(next(self._seq), req, n, Phase.MEMORY, time.monotonic())
            self.entries[e_.seq] = e_
            self._finish_failed(e_, str(e), Cause.INTAKE, HTTPStatus.BAD_REQUEST)  # nothing to retry elsewhere
            return True
        local_reason = "" if source is not None else admission.runs_locally(req, n)
        if local_reason:
            self.stats["requests_local"] += 1
            self.node.metrics.requests.labels("local").inc()
            logger.debug("messenger: %s runs on the decoder (%s)", req.rid, local_reason)
            return False
        e = Entry(next(self._seq), req, n, Phase.MEMORY, time.monotonic())
        e.times["take"] = e.since
        if source is not None:  # a running request migrating here: its KV comes from that decoder only
            e.source, e.rerouted = source, True
        self.entries[e.seq] = e
        return True

    def _allocate(self, e: Entry) -> bool:
        held = [x.req for x in self.entries.values() if x.pages and x.phase in (Phase.ROUTE, Phase.TRANSFER)]
        ps = self.node.page_size
        got = admission.allocate(self.sched, e.req, e.n_tokens, ps, self.cfg.reuse_prefix and e.source is None,
                                 admission.promised_room(self.sched, held, ps))
        if got is None:
            return False
        e.pages, e.start_page = got.pages, got.start_page
        self.stats["pages_reused"] += e.start_page
        return True

    # ----- leader decisions ---------------------------------------------------------
    def leader_inputs(self) -> list[MessengerInput]:
        out: list[MessengerInput] = []
        with self.node.owner_may_go(self._fail_all):
            self._route(out)
        return out + self.lock.inputs()

    def _route(self, out: list[Route]) -> None:
        for e in self.entries.values():
            if e.phase is not Phase.ROUTE or e.routed:
                continue
            if e.source is not None:
                link = self.links.source(e.source.address)
                if link is None or not link.alive():
                    if link is not None and link.state in (LinkState.CONNECTING, LinkState.DOWN) and \
                            time.monotonic() - e.since < self.cfg.connect_timeout_s:
                        continue
                    why = link.describe() if link is not None else "too many migration sources linked"
                    out.append(Route(e.seq, 0, "", 0, (), error=f"the decoder this request migrates from: {why}"))
                    e.routed = True
                    continue
            else:
                link = self.links.choose()
            if link is None:
                if self.links.connecting() and time.monotonic() - e.since < self.cfg.connect_timeout_s:
                    continue
                out.append(Route(e.seq, 0, "", 0, (), error=self.links.why()))
            else:
                link.outstanding += 1
                out.append(Route(e.seq, self._next_tag(), link.address, link.prefill_tp, link.instances))
            e.routed = True

    def _next_tag(self) -> int:
        # The server's one backend counts every DP group's writes by tag: group g takes the
        # tags that are g modulo the number of groups, so no two groups share one.
        groups, group = self.node.groups, self.node.group
        while True:
            tag = (next(self._tags) * groups + group) % (1 << 32)
            if tag and not self.backend.is_retired(tag):
                return tag

    def apply(self, route: MessengerInput) -> None:
        if not isinstance(route, Route):  # a migration's cut or settling (migration/lockstep.py)
            self.lock.apply(route)
            return
        e = self.entries.get(route.seq)
        if e is None or e.phase is not Phase.ROUTE:  # aborted meanwhile
            if self.links is not None and route.link:
                self.links.links[route.link].outstanding -= 1
            return
        if route.error:
            self._finish_failed(e, route.error, Cause.NO_PREFILL)
            return
        plan = ShardPlan.build(self.node.view.geometry, route.prefill_tp, self.ranks.size)
        e.tag, e.link, e.phase = route.tag, route.link, Phase.TRANSFER
        e.times["route"] = time.monotonic()
        e.writes = plan.total_writes(len(e.pages) - e.start_page)
        e.bytes = plan.total_bytes(len(e.pages) - e.start_page)
        if not self.ranks.is_leader:  # the leader's backend counts the writes into every rank's pages
            e.landed = True
            return
        # One backend per server on both sides: every write of the request carries its tag
        # into the leader's backend, from the prefill server's one backend instance.
        e.expected = e.writes
        peers = set(route.prefill_instances)
        # The first write alone, then the rest: whether any landed decides if a lost request may be re-routed.
        first = self.backend.expect(e.tag, 1, self.cfg.transfer_timeout_s, peers)
        first.add_done_callback(lambda f, e=e, tag=e.tag: self._on_first(e, tag, f, peers))
        prompt = e.req.origin_input_ids
        if e.source is not None:  # nothing to compute: the source decoder writes what it holds
            order = wire.MigrationOrder(rid=str(e.source.handle), tag=e.tag, num_tokens=e.n_tokens, dst_pages=e.pages)
        else:
            order = wire.PrefillOrder(rid=e.req.rid, tag=e.tag, token_ids=tuple(prompt[:e.n_tokens]),
                                      dst_pages=e.pages, start_page=e.start_page, last_token=int(prompt[e.n_tokens]))
        try:
            e.route_peer = self.links.links[e.link].peer
            self.links.links[e.link].send(order)
            e.times["sent"] = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - becomes this request's failure
            e.failed, e.cause = f"could not send the prefill request to {e.link}: {exc}", Cause.SEND

    def _on_first(self, e: Entry, tag: int, fut: Any, peers: set[str]) -> None:  # backend thread (or scheduler)
        if fut.exception() is not None or e.expected == 1 or e.tag != tag:
            self._on_expect(e, tag, fut)
            return
        e.first_landed = True
        left = max(0.0, self.cfg.transfer_timeout_s - (time.monotonic() - e.times["route"]))
        try:
            rest = self.backend.expect(tag, e.expected - 1, left, peers)
        except Exception as exc:  # noqa: BLE001 - the tag was retired meanwhile (abort): the request failed
            if not e.failed:
                e.failed, e.cause = f"KV transfer from {e.link} failed: {exc}", Cause.TRANSFER
            self.node.wakeup.set()
            return
        rest.add_done_callback(lambda f, e=e, tag=tag: self._on_expect(e, tag, f))

    def _on_expect(self, e: Entry, tag: int, fut: Any) -> None:  # backend thread
        err = fut.exception()
        if e.tag != tag:  # an earlier route's expectation (the request was re-routed)
            return
        e.times["landed"] = time.monotonic()
        if err is None:
            e.landed = True
        elif not e.failed:
            if isinstance(err, PeerLostError):
                e.lost = time.monotonic()
            e.failed, e.cause = f"KV transfer from {e.link} failed: {err}", Cause.TRANSFER
        self.node.wakeup.set()

    def _on_message(self, peer: Any, msg: wire.Message) -> None:  # control thread (leader)
        if self.links.on_message(peer, msg) or self.out.on_message(peer, msg):
            return
        if isinstance(msg, (wire.OrderFailed, wire.Released)):
            self._inbox.append((peer, msg))  # applied by the scheduler thread in step()
            self.node.wakeup.set()

    def _apply_messages(self) -> None:
        while self._inbox:
            peer, msg = self._inbox.popleft()
            for e in self.entries.values():
                if e.tag == msg.tag and e.link and self.links.links[e.link].peer is peer:
                    if isinstance(msg, wire.OrderFailed) and not e.failed:
                        e.failed = f"prefill server {e.link} failed the request: {msg.reason}"
                        e.cause = Cause.INTAKE if msg.blame is wire.Blame.ORDER else Cause.PREFILL
                    # The prefill server is done with this tag either way; its writes may still
                    # be on their way: the pages go once the count it gives arrived (endings).
                    e.answered, e.posted = e.answered or time.monotonic(), msg.posted

    # ----- every iteration ------------------------------------------------------------
    def step(self) -> None:
        self.node.wakeup.clear()
        self.node.stop_if_owner_gone(self._fail_all)
        with self.node.owner_may_go(self._fail_all):
            self._step()

    def _step(self) -> None:
        if self.out is not None and self.out.wants_step():
            self.out.step()
            if self.out.changed:  # a hand-over or an ending: its trace is published at once
                self.out.changed = False
                self.node.stats_file.publish(self.snapshot, force=True)
        if not self.entries and not self._inbox:
            # Nothing of ours in flight and nothing arrived: the requests decoding hold their
            # KV and are SGLang's alone, so a decode step pays only this test. (Entries are
            # the same on every rank, so all ranks skip the collective below together.)
            if self.ranks.is_leader:
                self.node.stats_file.publish(self.snapshot)
            return
        # Migrations first: each is a running stream someone is reading, and one does not wait
        for e in sorted((e for e in self.entries.values() if e.phase is Phase.MEMORY), key=lambda e: e.source is None):
            if not self._allocate(e):
                if e.source is not None:  # a migration does not queue for room: it goes on where it runs
                    self._finish_failed(e, "no free KV pages on this decoder for a migrated request",
                                        Cause.INTAKE, HTTPStatus.SERVICE_UNAVAILABLE)
                    continue
                break  # first come, first served
            e.phase, e.since = Phase.ROUTE, time.monotonic()
            if e.start_page == len(e.pages):  # the whole prompt is cached here: no prefill
                e.phase, e.landed = Phase.TRANSFER, True
        if self.ranks.size == 1:
            # A single rank needs no broadcast: route now rather than one iteration later.
            for route in self.leader_inputs():
                self.apply(route)
        if self.ranks.is_leader:
            self._apply_messages()
            self._leader_release_decisions()
        live = [e for e in self.entries.values() if e.phase in (Phase.TRANSFER, Phase.RELEASE, Phase.QUARANTINE)]
        flags = []
        for e in live:
            lost = lost_verdict(e, self.links.links, time.monotonic()) if self.ranks.is_leader and e.failed and e.phase is Phase.TRANSFER else Lost.FAIL
            flags += [int(e.landed), int(bool(e.failed) and lost is Lost.FAIL), int(lost is Lost.REROUTE),
                      e.release if self.ranks.is_leader else 0]
        sums = self.ranks.agree(flags)
        for i, e in enumerate(live):
            landed, failed, reroute, release = sums[4 * i:4 * i + 4]
            if e.phase is Phase.TRANSFER:
                if reroute:
                    self._reroute(e)
                elif failed:
                    self._fail(e, e.failed or "KV transfer failed on another TP rank", e.cause or Cause.TRANSFER)
                elif landed == self.ranks.size:
                    self._hand_off(e)
            elif release == Release.FREE:
                self._release(e, quarantine=False)
            elif release == Release.QUARANTINE and e.phase is Phase.RELEASE:
                self._release(e, quarantine=True)
        if self.ranks.is_leader:
            self.node.stats_file.publish(self.snapshot)

    def _fail_all(self, reason: str) -> None:
        """Every request this group holds fails (its KV can no longer arrive)."""
        for e in list(self.entries.values()):
            if e.phase is Phase.TRANSFER:
                self._fail(e, reason, Cause.OWNER)
            elif e.phase in (Phase.MEMORY, Phase.ROUTE):
                self._finish_failed(e, reason, Cause.OWNER)

    def _gauges(self) -> dict[str, dict[str, float]]:  # metrics HTTP thread, at each scrape
        phases = collections.Counter(e.phase.name.lower() for e in list(self.entries.values()))
        return scheduler_state(self.sched, self.node.page_size) | self.node.backend_gauges() | {
            "sglang_disagg_requests_in_flight": {p.name.lower(): phases[p.name.lower()] for p in Phase},
            "sglang_disagg_peer_outstanding": {a: link.outstanding
                                               for a, link in list((self.links.links if self.links else {}).items())}}

    def snapshot(self) -> dict:
        phases = {p.name.lower(): 0 for p in Phase}
        for e in self.entries.values():
            phases[e.phase.name.lower()] += 1
        links = {a: {"state": link.state.value, "reason": link.reason, "outstanding": link.outstanding,
                     "losses": link.losses, "outage_s": round(link.outage_s, 4)}
                 for a, link in self.links.links.items()} if self.links else {}
        return self.node.describe(self.sched) | self.stats | {
            "in_flight": phases, "links": links, "scheduler": scheduler_state(self.sched, self.node.page_size),
            "late_writes_dropped": self.backend.stats()["late_writes_dropped"] if self.backend else 0,
            "recent": list(self.recent)} | ({**self.out.stats, "migrations": list(self.out.recent)} if self.out else {})

    # ----- aborts, scheduling, idleness -----------------------------------------------
    def abort(self, recv_req: Any) -> None:
        if self.out is not None:
            self.out.abort(recv_req)
        for e in list(self.entries.values()):
            if not abort_matches(recv_req, e.req.rid):
                continue
            if e.phase is Phase.TRANSFER:
                self._fail(e, "aborted", Cause.ABORTED)
            elif e.phase in (Phase.MEMORY, Phase.ROUTE):
                self._finish_failed(e, "aborted", Cause.ABORTED)
        # Handed-off requests wait in SGLang's queue holding their KV: SGLang's own abort
        # would drop them from the queue without freeing it.
        for req in [r for r in self.sched.waiting_queue if getattr(r, HANDOFF_ATTR, None) and r.kv.holds_kv]:
            if abort_matches(recv_req, req.rid):
                self.sched.waiting_queue.remove(req)
                fail_request(self.sched, req, "aborted")
                release(self.sched, req)  # unlocks req.lock, still ours
                setattr(req, LOCK_ATTR, None)

    @staticmethod
    def prefix_tree(req: Any, tree: Any) -> Any:
        return None if getattr(req, HANDOFF_ATTR, None) and req.kv.holds_kv else tree

    @staticmethod
    def rows_held(reqs: Any) -> int:
        """Handed-off requests waiting to run already hold their req_to_token row (taken
        with their pages): admitting them needs no free row."""
        return sum(1 for r in reqs if getattr(r, HANDOFF_ATTR, None) and r.kv.holds_kv)

    def before_forward(self, batch: Any) -> None:
        """Nothing to send from a decoder."""

    def after_forward(self, batch: Any) -> None:
        """Nothing to send from a decoder. A handed-off request's first extend is the step
        that samples its first token (its results are processed right after): time it."""
        tree = self.sched.tree_cache
        for req in batch.reqs:
            mine = getattr(req, LOCK_ATTR, None)
            if mine is not None and req.lock is not mine:  # SGLang holds its own lock now
                tree.unlock(mine)
                setattr(req, LOCK_ATTR, None)
        if not self._first_step:
            return
        now = time.monotonic()
        for req in batch.reqs:
            start = self._first_step.pop(req.rid, None)
            if start is not None:
                self.node.metrics.observe_ttft("first_step", start, now)

    def hold_release(self, req: Any, checkpoint: bool) -> bool:
        return False

    @staticmethod
    def draft_tail_tokens(batch: Any, tail: Any) -> Any:
        """A decoder's draft extends follow its own sampling: SGLang's tokens stand."""
        return tail

    def idle(self) -> bool:
        # Quarantined pages keep the scheduler from being idle although they wait on a prefill
        # server's answer, not on a step (wait_while_busy sleeps until a message wakes us): an
        # idle SGLang scheduler checks its pool for leaks (and raised on the quarantined pages,
        # killing the decoder, when a prefill host stayed cut off), and /flush_cache would
        # hand pages back to the allocator that a stale write may still land in.
        return not self.entries and not self.lock.holding() and (self.out is None or self.out.idle())

    def has_leader_work(self) -> bool:
        return any(e.phase is Phase.ROUTE and not e.routed for e in self.entries.values()) and \
            self.links.choose() is not None

    def wakeup_fd(self) -> int | None:
        return self.node.wakeup_fd()


    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        self.node.close()
