"""The prefill leader's front door: decoders' messages, read on the control thread, checked
and queued as broadcast inputs for the scheduler thread; decoders whose control connection
was lost are noticed there too.

Control thread: on_message() answers first contact (Welcome or Refuse) and refuses bad orders
at once; everything that touches the scheduler is queued. Scheduler thread (leader):
drain() takes the queue, plus one CancelTicket per order of every decoder lost since the
last look and then its DecoderLeft. Nothing here touches SGLang.

Bounded: the decoder tables hold one key per live control connection that said Hello (a
second Hello on a connection replaces its key), a lost connection's key is forgotten once
the cancels of its orders are out (drain), and at most MAX_DECODERS keys live at once: a
Hello beyond that is refused. A peer holding the secret, or decoders restarting for months,
cannot grow them.
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
from .inputs import CancelTicket, DecoderJoined, DecoderKey, DecoderLeft, MessengerInput, OrderTicket
from .node import Node
from .planner import ShardPlan, pages_for

logger = logging.getLogger("sglang_disagg.messenger")
MAX_DECODERS = 4096  # distinct live decoder keys (connection x DP group) one prefill group serves


class Intake:
    def __init__(self, node: Node, tp: int, vocab: int) -> None:
        self.node, self.tp, self.vocab = node, tp, vocab
        # A DP prefill server: every group hears each Hello (it writes into that decoder),
        # group 0 alone answers it (the decoder awaits one Welcome or Refuse).
        self.answers = node.group == 0
        # peers and _keys are inverse maps (one key per connection, one connection per key).
        # The control thread adds, the scheduler thread (drain) forgets: both under _lock.
        self._lock = threading.Lock()
        self.peers: dict[DecoderKey, Any] = {}           # decoder key -> control peer
        self._keys: dict[Any, DecoderKey] = {}            # control peer -> decoder key, from its Hello
        self._inbox: collections.deque[MessengerInput] = collections.deque()
        self._capacity: dict[DecoderKey, int] = {}        # decoder key -> pages its regions hold
        self._replaced: list[DecoderKey] = []             # keys a connection's later Hello replaced: to cancel
        self._hold = HoldOrders.from_env()           # test fault: some orders wait before they are taken

    def on_message(self, peer: Any, msg: wire.Message) -> None:  # control thread
        if isinstance(msg, wire.Hello):
            # A decoder is one instance per server; a DP decoder's groups each say Hello.
            key = DecoderKey(peer.id, msg.group)
            reasons = compat.differences(msg.kv, self.node.spec)
            if not reasons:
                try:
                    ShardPlan.build(self.node.view.geometry, self.tp, msg.kv.tp)
                    reasons = self._join(peer, key, msg, compat.decoder_pages(self.node.view.geometry, msg))
                except ValueError as e:
                    reasons.append(str(e))
            if reasons:
                if self.answers:
                    logger.error("messenger: refused decoder %s: %s", msg.decoder, "; ".join(reasons))
                    peer.send(wire.encode(wire.Refuse(prefill=self.node.name, reason="; ".join(reasons))))
                return
            if self.answers:
                peer.send(wire.encode(wire.Welcome(prefill=self.node.name, kv=self.node.spec, ranks=tuple(
                    wire.RankEndpoint(r.rank, r.address, r.instance, ()) for r in self.node.endpoints))))
        elif isinstance(msg, wire.PrefillOrder):
            held = self._hold is not None and msg.rid.startswith(self._hold.prefix)
            with self._lock:  # checked and queued at once: drain cannot forget the key in between
                key = self._keys.get(peer)
                problem = self.check_order(key, msg)
                if not problem and not held:
                    self._inbox.append(OrderTicket(key, msg))
            if problem:
                self.node.dp.order_done(key or DecoderKey(peer.id), msg.tag)  # the owner forgets it
                peer.send(wire.encode(wire.OrderFailed(rid=msg.rid, tag=msg.tag, reason=problem,
                                                                blame=wire.Blame.ORDER, posted=0)))
                return
            if held:
                timer = threading.Timer(self._hold.seconds, self._take_held, args=(OrderTicket(key, msg),))
                timer.daemon = True
                timer.start()
                return
        elif isinstance(msg, wire.Cancel):
            with self._lock:
                self._inbox.append(CancelTicket(self._keys.get(peer), msg.tag))
        elif isinstance(msg, wire.MigrationOrder):  # a decoder's message sent here by mistake: say so at once
            peer.send(wire.encode(wire.OrderFailed(rid=msg.rid, tag=msg.tag, blame=wire.Blame.ORDER, posted=0,
                                                   reason="a prefill server holds no running request to migrate")))
            return
        else:
            logger.warning("messenger: unexpected %s from %s", type(msg).__name__, peer.address)
            return
        self.node.wakeup.set()

    def _join(self, peer: Any, key: DecoderKey, hello: wire.Hello, capacity: int) -> list[str]:
        """Record a Hello that passed the checks (control thread); why it is refused if not."""
        with self._lock:
            old = self._keys.get(peer)
            replaces = old is not None and old != key
            if key not in self.peers and len(self.peers) - replaces >= MAX_DECODERS:
                return [(f"this prefill server already serves {MAX_DECODERS} decoders (MAX_DECODERS, one per "
                         "control connection): retry later or use another prefill server")]
            if replaces:
                # One key per connection: the old one's orders are cancelled at the next drain,
                # as a lost decoder's; nothing addressed to it reaches the connection any more.
                self._forget(old)
                self._replaced.append(old)
            holder = self.peers.get(key)
            if holder is not None and holder is not peer:
                # The decoder connected again (the old connection lost or not): the key follows
                # the new connection; the old one's orders are refused as before any Hello.
                self._keys.pop(holder, None)
            self.peers[key], self._keys[peer], self._capacity[key] = peer, key, capacity
            self._inbox.append(DecoderJoined(key, hello))
        return []

    def _forget(self, key: DecoderKey) -> None:  # under _lock
        peer = self.peers.pop(key, None)
        if peer is not None and self._keys.get(peer) == key:
            del self._keys[peer]
        self._capacity.pop(key, None)

    def _take_held(self, ticket: OrderTicket) -> None:  # timer thread (test fault)
        self._inbox.append(ticket)
        self.node.wakeup.set()

    def check_order(self, key: DecoderKey | None, o: wire.PrefillOrder) -> str:
        """Why this order must be refused before anything is computed or written ("" if not)."""
        ps = self.node.page_size
        capacity = self._capacity.get(key)
        if key not in self.peers or capacity is None:
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
        if o.dst_pages and max(o.dst_pages) >= capacity:
            return f"page id {max(o.dst_pages)} outside the decoder's {capacity} pages"
        if max(o.token_ids) >= self.vocab:
            return f"token id {max(o.token_ids)} outside the model's vocabulary of {self.vocab}"
        # The prompt's last token: a speculative draft's forward embeds it (prefill.py), so an id
        # past the vocabulary would index past the embedding.
        if type(o.last_token) is not int or not 0 <= o.last_token < self.vocab:
            return f"last token {o.last_token!r} outside the model's vocabulary of {self.vocab}"
        return ""

    def drain(self, open_tags: Callable[[DecoderKey], Iterable[int]]) -> list[MessengerInput]:
        """Queued inputs, then a cancel for every order (`open_tags(key)`, or just queued) of
        each decoder lost (or replaced by its connection's later Hello) since the last look;
        such a decoder's key is forgotten here, its cancels being out."""
        with self._lock:
            out: list[MessengerInput] = list(self._inbox)
            self._inbox.clear()
            gone = [(key, "lost") for key, peer in self.peers.items() if peer.state is not PeerState.CONNECTED]
            gone += [(key, "replaced by a later Hello on its connection") for key in self._replaced]
            self._replaced.clear()
            for key, why in gone:
                # After the orders just taken from the inbox, so their tickets exist when these apply.
                tags = set(open_tags(key)) | {i.order.tag for i in out
                                              if isinstance(i, OrderTicket) and i.key == key}
                logger.warning("messenger: decoder %s %s: cancelling its %d order(s)", key, why, len(tags))
                out += [CancelTicket(key, tag) for tag in sorted(tags)]
                out.append(DecoderLeft(key))  # after its cancels: the ranks drop its link
                if why == "lost":
                    self._forget(key)
        return out

    def pending(self) -> bool:
        """Inputs queued, or a decoder lost (or replaced) and not cancelled yet."""
        with self._lock:
            return bool(self._inbox or self._replaced) or any(
                p.state is not PeerState.CONNECTED for p in self.peers.values())

    def send(self, key: DecoderKey, msg: wire.Message) -> None:
        """To the decoder's control connection; a decoder that is gone needs no answer."""
        peer = self.peers.get(key)
        if peer is not None:
            try:
                peer.send(wire.encode(msg))
            except Exception:  # noqa: BLE001
                pass
