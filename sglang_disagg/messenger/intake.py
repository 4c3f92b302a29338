"""The prefill leader's front door: decoders' messages, read on the control thread, checked
and queued as broadcast inputs for the scheduler thread; decoders whose control connection
was lost are noticed there too.

Control thread: on_message() answers first contact (Welcome or Refuse) and refuses bad orders
at once; everything that touches the scheduler is queued. Scheduler thread (leader):
drain() takes the queue, plus one CancelTicket per order of every decoder lost since the
last look. Nothing here touches SGLang.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..backends import PeerState
from . import compat, wire
from .faults import HoldOrders
from .inputs import CancelTicket, DecoderJoined, MessengerInput, OrderTicket
from .node import Node
from .planner import ShardPlan, pages_for

logger = logging.getLogger("sglang_disagg.messenger")


class Intake:
    def __init__(self, node: Node, tp: int, vocab: int) -> None:
        self.node, self.tp, self.vocab = node, tp, vocab
        # A DP prefill server: every group hears each Hello (it writes into that decoder),
        # group 0 alone answers it (the decoder awaits one Welcome or Refuse).
        self.answers = node.group == 0
        self.peers: dict[str, Any] = {}             # decoder key -> control peer
        self._keys: dict[Any, str] = {}              # control peer -> decoder key, from its Hello
        self._inbox: collections.deque[MessengerInput] = collections.deque()
        self._capacity: dict[str, int] = {}          # decoder key -> pages its regions hold
        self._lost: dict[str, Any] = {}              # decoder key -> the lost peer already handled
        self._hold = HoldOrders.from_env()           # test fault: some orders wait before they are taken

    def on_message(self, peer: Any, msg: wire.Message) -> None:  # control thread
        if isinstance(msg, wire.Hello):
            # A decoder is one instance per server; a DP decoder's groups each say Hello.
            key = f"{peer.id}/{msg.group}"
            reasons = compat.differences(msg.kv, self.node.spec)
            if not reasons:
                try:
                    ShardPlan.build(self.node.view.geometry, self.tp, msg.kv.tp)
                    self._capacity[key] = compat.decoder_pages(self.node.view.geometry, msg)
                except ValueError as e:
                    reasons.append(str(e))
            if reasons:
                if self.answers:
                    logger.error("messenger: refused decoder %s: %s", msg.decoder, "; ".join(reasons))
                    peer.send(wire.encode(wire.Refuse(prefill=self.node.name, reason="; ".join(reasons))))
                return
            self.peers[key], self._keys[peer] = peer, key
            self._inbox.append(DecoderJoined(key, msg))
            if self.answers:
                peer.send(wire.encode(wire.Welcome(prefill=self.node.name, kv=self.node.spec, ranks=tuple(
                    wire.RankEndpoint(r.rank, r.address, r.instance, ()) for r in self.node.endpoints))))
        elif isinstance(msg, wire.PrefillOrder):
            key = self._keys.get(peer, "")
            problem = self.check_order(key, msg)
            if problem:
                self.node.order_done(peer.id, msg.tag)
                peer.send(wire.encode(wire.OrderFailed(rid=msg.rid, tag=msg.tag, reason=problem,
                                                                blame=wire.Blame.ORDER)))
                return
            if self._hold is not None and msg.rid.startswith(self._hold.prefix):
                timer = threading.Timer(self._hold.seconds, self._take_held, args=(OrderTicket(key, msg),))
                timer.daemon = True
                timer.start()
                return
            self._inbox.append(OrderTicket(key, msg))
        elif isinstance(msg, wire.Cancel):
            self._inbox.append(CancelTicket(self._keys.get(peer, ""), msg.tag))
        else:
            logger.warning("messenger: unexpected %s from %s", type(msg).__name__, peer.address)
            return
        self.node.wakeup.set()

    def _take_held(self, ticket: OrderTicket) -> None:  # timer thread (test fault)
        self._inbox.append(ticket)
        self.node.wakeup.set()

    def check_order(self, key: str, o: wire.PrefillOrder) -> str:
        """Why this order must be refused before anything is computed or written ("" if not)."""
        ps = self.node.page_size
        if key not in self.peers:
            return "no Hello from this decoder yet"
        if not o.token_ids:
            return "an order needs at least one token"
        if len(o.dst_pages) != pages_for(len(o.token_ids), ps):
            return (f"{len(o.token_ids)} tokens need {pages_for(len(o.token_ids), ps)} pages "
                    f"of {ps}, the order names {len(o.dst_pages)}")
        if o.start_page > len(o.dst_pages):
            return f"start_page {o.start_page} beyond the order's {len(o.dst_pages)} pages"
        if o.tag >= 1 << 32:
            return f"tag {o.tag} does not fit 32 bits"
        if o.dst_pages and max(o.dst_pages) >= self._capacity[key]:
            return f"page id {max(o.dst_pages)} outside the decoder's {self._capacity[key]} pages"
        if max(o.token_ids) >= self.vocab:
            return f"token id {max(o.token_ids)} outside the model's vocabulary of {self.vocab}"
        # The prompt's last token: a speculative draft's forward embeds it (prefill.py), so an id
        # past the vocabulary would index past the embedding.
        if type(o.last_token) is not int or not 0 <= o.last_token < self.vocab:
            return f"last token {o.last_token!r} outside the model's vocabulary of {self.vocab}"
        return ""

    def drain(self, open_tags: Callable[[str], Iterable[int]]) -> list[MessengerInput]:
        """Queued inputs, then a cancel for every order (`open_tags(key)`, or just queued) of
        each decoder lost since the last look."""
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        for key in self._lost_decoders():
            # After the orders just taken from the inbox, so their tickets exist when these apply.
            tags = set(open_tags(key)) | {i.order.tag for i in out if isinstance(i, OrderTicket) and i.key == key}
            logger.warning("messenger: decoder %s lost: cancelling its %d order(s)", key[:12], len(tags))
            out += [CancelTicket(key, tag) for tag in sorted(tags)]
        return out

    def _lost_decoders(self) -> list[str]:
        lost = []
        for key, peer in list(self.peers.items()):
            if peer.state is not PeerState.CONNECTED and self._lost.get(key) is not peer:
                self._lost[key] = peer
                lost.append(key)
        return lost

    def pending(self) -> bool:
        """Inputs queued, or a decoder lost and not cancelled yet."""
        return bool(self._inbox) or any(p.state is not PeerState.CONNECTED and self._lost.get(k) is not p
                                        for k, p in list(self.peers.items()))

    def send(self, key: str, msg: wire.Message) -> None:
        """To the decoder's control connection; a decoder that is gone needs no answer."""
        peer = self.peers.get(key)
        if peer is not None:
            try:
                peer.send(wire.encode(msg))
            except Exception:  # noqa: BLE001
                pass
