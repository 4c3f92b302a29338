"""Decoder A's side of its links to migration targets: the Hello of a decoder B (the same
first-contact checks as a prefill server's, a data connection for the writes), B's
MigrationOrder (checked against what A holds, planned, posted) and B's Cancel (nothing more is
posted; B hears how many writes carried the tag once they drained, as a prefill server answers).

Scheduler-side contract (Outgoing calls these in A's scheduler thread): on(peer, msg) for each
queued message; post_due() each iteration (the test hook's held-back writes, migration/hook.py);
settled(h) for every settled held request; answer_cancels() after them. Bounded: MAX_PEERS
linked decoders, MAX_ANSWERED remembered write counts and pending cancels.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from ...backends import PeerState
from ...backends.errors import TransferError
from .. import compat, wire
from ..orders import DecoderLink
from ..planner import ShardPlan
from .hook import STALL_S
from .pacer import Pacer
from .source import Held, MigrationRefused

logger = logging.getLogger("sglang_disagg.migration")
MAX_PEERS = 64      # decoders that said Hello to this one as migration targets (bounded table)
MAX_ANSWERED = 256  # settled orders whose write counts a late cancel is answered with


class Targets:
    def __init__(self, out: Any) -> None:
        self.out, self.m, self.node, self.source, self.hook = out, out.m, out.node, out.source, out.hook
        # B's links by (its instance, its DP group): a data-parallel B's groups each say Hello, on
        # connections of their own from one backend instance, each naming its own group's pages
        # (keyed by instance alone, the last group's Hello took the others' orders: their KV went
        # into that group's pool). `keys`: each control connection's key, from its Hello.
        self.peers: dict[tuple[str, int], DecoderLink] = {}
        self.keys: dict[Any, tuple[str, int]] = {}
        self.stalled: list[tuple[float, Held]] = []  # the test hook's held-back writes, with when they go
        # B's cancels: answered (wire.Released with the writes posted) once the request's writes
        # drained; `answered` remembers the last MAX_ANSWERED settled orders for a late cancel
        self.cancels: list[tuple[Any, wire.Cancel]] = []
        self.answered: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()
        # the bandwidth cap (--migration-rate, pacer.py) and the held requests waiting for its credit
        self.pacer = Pacer(getattr(self.m.cfg, "migration_rate_bps", 0.0))
        self.paced: list[Held] = []
        self._timer = False

    def on(self, peer: Any, msg: wire.Message) -> None:
        """One of B's messages, in A's scheduler thread. A B whose connection closed between its
        message and our answer (it dropped the link, e.g. on a heartbeat lost under load, and
        will link again) costs its link here, never the scheduler: an answer that cannot be sent
        was raised out of the decoder's step once and stopped the server (CI of 7e81fcc)."""
        try:
            if isinstance(msg, wire.Hello):
                self._hello(peer, msg)
            elif isinstance(msg, wire.Cancel):
                self._cancel(peer, msg)
            else:
                self._order(peer, msg)
        except TransferError as e:
            self.peers.pop(self.keys.pop(peer, None), None)
            logger.info("migration: decoder %s went away before its %s was answered: %s", peer.address,
                        type(msg).__name__, e)

    def post_due(self) -> None:
        now = time.monotonic()
        for due, h in [x for x in self.stalled if x[0] <= now]:
            self.stalled.remove((due, h))
            self.source.post_later(h)
        for h in list(self.paced):  # first come, first served: the bucket is the decoder's
            self.source.post_later(h, self.pacer.take(self.source.later_sizes(h)))
            if not h.later:
                self.paced.remove(h)
        self._wake_for_credit()

    def _wake_for_credit(self) -> None:
        """A paced migration waits for credit: wake the scheduler then (it may have nothing else)."""
        if not self.paced or self._timer:
            return
        self._timer = True

        def wake() -> None:
            self._timer = False
            self.node.wakeup.set()
        threading.Timer(max(self.pacer.wait_s(), 0.002), wake).start()

    def settled(self, h: Held) -> None:
        if h.tag_of:  # what B's Cancel for it is answered with from now on
            self.answered[h.tag_of] = h.writes
            while len(self.answered) > MAX_ANSWERED:
                self.answered.popitem(last=False)

    def answer_cancels(self) -> None:
        for peer, msg in [c for c in self.cancels if self._named(c[0], c[1].tag) in self.answered]:
            self.cancels.remove((peer, msg))
            self._released(peer, msg)

    def _hello(self, peer: Any, hello: wire.Hello) -> None:
        key = (peer.id, hello.group)
        reasons = compat.differences(hello.kv, self.node.spec)
        link = None
        if not reasons:
            try:
                for gone in [k for k, x in self.peers.items() if x.peers[0].state is not PeerState.CONNECTED]:
                    del self.peers[gone]  # a decoder that went away: its slot is free again
                for conn in [c for c, k in self.keys.items()
                             if k not in self.peers or c is peer or c.state is not PeerState.CONNECTED]:
                    del self.keys[conn]
                if len(self.peers) >= MAX_PEERS and key not in self.peers:
                    raise ValueError(f"{MAX_PEERS} decoders are linked for migration already")
                link = DecoderLink(hello, ShardPlan.build(self.node.view.geometry, self.m.ranks.size, hello.kv.tp))
                compat.decoder_pages(self.node.view.geometry, hello)
                data = self.m.backend.connect(hello.ranks[0].address, self.m.cfg.connect_timeout_s)
                for d, endpoint in enumerate(hello.ranks):
                    link.peers[d] = data
                    link.remote[d] = [data.add_remote_region(desc) for desc in endpoint.regions]
            except Exception as e:  # noqa: BLE001 - refused with the reason
                reasons = [str(e)]
        # A data-parallel decoder's owner hands B's Hello to every group (any may hold a request
        # for B: dp/owner.py); B awaits one answer, group 0's.
        answers = self.node.group == 0
        if reasons:
            logger.error("migration: refused decoder %s: %s", hello.decoder, "; ".join(reasons))
            if answers:
                peer.send(wire.encode(wire.Refuse(prefill=self.node.name, reason="; ".join(reasons))))
            return
        self.peers[key], self.keys[peer] = link, key
        if answers:
            peer.send(wire.encode(wire.Welcome(prefill=self.node.name, kv=self.node.spec, ranks=tuple(
                wire.RankEndpoint(r.rank, r.address, r.instance, ()) for r in self.node.endpoints))))

    def _order(self, peer: Any, order: wire.MigrationOrder) -> None:
        link = self._link(peer)
        try:
            if link is None:
                raise MigrationRefused("no Hello on this connection")
            h, groups, _ = self.source.plan(order, link.hello.kv.tp)
        except MigrationRefused as e:
            peer.send(wire.encode(wire.OrderFailed(rid=order.rid, tag=order.tag, reason=str(e),
                                                   blame=wire.Blame.ORDER, posted=0)))
            return
        a = self.out.away.get(h.rid)
        if a is not None:
            a.held = h
            a.req.sglang_disagg_migration_order = time.monotonic()
        h.tag_of = self._named(peer, order.tag)
        hold_back = 0
        if self.hook is not None and a is not None and self.hook.stalls(a.req.rid) and len(groups) > 1:
            hold_back = len(groups) // 2  # the fault injector: the rest goes out STALL_S later
            self.stalled.append((time.monotonic() + STALL_S, h))
            threading.Timer(STALL_S, self.node.wakeup.set).start()
        elif self.pacer.enabled:
            # queued behind the migrations already waiting for credit: none overtakes another
            now = 0 if self.paced else self.pacer.take([g.nbytes for g in groups])
            hold_back = len(groups) - now
            if hold_back:
                self.paced.append(h)
        self.source.post(h, order.tag, groups, self.m.backend, link.peers, self.node.regions, link.remote,
                         self.node.wakeup.set, hold_back)

    def _cancel(self, peer: Any, msg: wire.Cancel) -> None:
        """B gave a migrating request up (e.g. its link here dropped): nothing more is posted for
        it, and B hears how many writes carried its tag once they drained (wire.Released), so it
        frees its pages then rather than after the late-writes deadline."""
        key = self._named(peer, msg.tag)
        h = next((x for x in self.source.held.values() if x.tag_of == key), None)
        if h is None and key not in self.answered:
            return  # no such order from this peer: nothing to say
        if h is not None:
            self.source.cancel(h)
            if len(self.cancels) < MAX_ANSWERED:
                self.cancels.append((peer, msg))
            return
        self._released(peer, msg)

    def _named(self, peer: Any, tag: int) -> tuple[str, int]:
        """(the decoder's name from its Hello, tag): B's cancel may come on a new connection."""
        link = self._link(peer)
        return (link.hello.decoder if link is not None else f"?{peer.id}", tag)

    def _link(self, peer: Any) -> DecoderLink | None:
        return self.peers.get(self.keys.get(peer, ("", -1)))

    def _released(self, peer: Any, msg: wire.Cancel) -> None:
        try:
            peer.send(wire.encode(wire.Released(rid=msg.rid, tag=msg.tag,
                                                posted=self.answered[self._named(peer, msg.tag)])))
        except Exception as e:  # noqa: BLE001 - B went away: it frees by its own rules
            logger.info("migration: the answer to %s's cancel was not sent: %s", peer.address, e)

