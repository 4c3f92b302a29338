"""A decoder leader's links to prefill servers: first contact, health, load.

Each configured prefill messenger gets a thread that connects (retrying while the server
starts), sends Hello and waits for Welcome or Refuse. A refusal (by the messenger, or by
the transfer backend's own handshake: another backend, provider or descriptor version) is
final for that server until it restarts; a lost connection is retried at once. A lost
server whose port then refuses connections is GONE: its process no longer exists, so no
write of it can land any more (the decoder frees or re-routes what it had asked of it).
Requests go to the ready link with the fewest outstanding requests.

A link whose server keeps failing valid orders (FAIL_STRIKES requests in a row: its writes
into this decoder fail, or never arrive) is FAILING: out of use, so requests go to another
server or fail at once with the reason, instead of each one burning a prefill. After a
backoff (the decoder's `recheck_s`, doubling up to RECHECK_MAX_S) it is connected again from
scratch (a new Hello: the server re-reads this decoder's regions) and comes back on probation:
one more failure and it is FAILING again, one success and it is trusted again.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Any

from ..backends import PeerState, TransferError
from . import wire
from ..threads import Thread as NamedThread

logger = logging.getLogger("sglang_disagg.messenger")

RETRY_S = 0.5
POLL_S = 0.05  # how often a ready link's liveness is checked: loss must be seen within 2 s
REFUSED_RETRY_S = 5.0
REFUSED_MARK = "refused by"  # in every refusal the client sees; the launcher stops on it
FAIL_STRIKES = 3             # valid requests in a row a link's server failed: the link is FAILING
RECHECK_MAX_S = 30.0         # longest wait before a FAILING link is connected again (the first: recheck_s)
MAX_SOURCES = 64             # links to other decoders that requests migrated here from


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    REFUSED = "refused"
    DOWN = "down"    # was ready, connection lost, process may still be alive (not reconnected yet)
    GONE = "gone"    # was ready, and its port now refuses connections: the process is gone
    FAILING = "failing"  # connected, but its server failed FAIL_STRIKES requests in a row: re-checked later


class Link:
    def __init__(self, address: str, backoff: float, source: bool = False) -> None:
        self.address = address
        self.source = source  # another decoder, the KV source of requests migrating here: never chosen
        self.state = LinkState.CONNECTING
        self.reason = "not contacted yet"
        self.peer: Any = None
        self.prefill_tp = 0
        self.instances: tuple[str, ...] = ()
        self.outstanding = 0
        self.strikes = 0         # requests in a row its server failed (scheduler thread)
        self.recheck_at = 0.0    # FAILING: when it is connected again
        self.backoff = backoff   # FAILING next: how long until it is connected again
        self.losses = 0          # times a ready link's connection was lost
        self.outage_s = 0.0      # the last loss: seen lost (within POLL_S) until ready again
        self._lost_at: float | None = None
        self._reply = threading.Event()
        self._answer: wire.Message | None = None

    def alive(self) -> bool:
        return self.state is LinkState.READY and self.peer is not None and self.peer.state is PeerState.CONNECTED

    def send(self, msg: wire.Message) -> None:
        if self.peer is None:
            raise TransferError(f"prefill server {self.address} is not connected")
        self.peer.send(wire.encode(msg))

    def describe(self) -> str:
        if self.state is LinkState.READY and not self.alive():  # its thread marks it DOWN within POLL_S
            return f"{self.address}: connection just lost ({self.reason})"
        return f"{self.address}: {self.state.value} ({self.reason})"


class Links:
    def __init__(self, node: Any, hello: wire.Hello, addresses: tuple[str, ...], connect_timeout_s: float,
                 on_change: Any = None, recheck_s: float = 1.0) -> None:
        self._node, self._hello, self._timeout, self._recheck_s = node, hello, connect_timeout_s, recheck_s
        self._on_change = on_change or (lambda: None)  # wakes the scheduler: entries wait on link states
        self.links = {a: Link(a, recheck_s) for a in addresses}
        self._by_peer: dict[str, Link] = {}
        self._stop = threading.Event()
        self._threads = [NamedThread(target=self._run, args=(link,), name=f"messenger-link-{a}", daemon=True)
                         for a, link in self.links.items()]
        for t in self._threads:
            t.start()

    def source(self, address: str) -> Link | None:
        """The link to decoder `address`, the KV source of a request migrating here, made on
        first use (None: MAX_SOURCES links exist already). Its address was authenticated
        (migration/room.py) before this is called."""
        link = self.links.get(address)
        if link is not None:
            return link
        if sum(1 for x in self.links.values() if x.source) >= MAX_SOURCES:
            return None
        link = self.links[address] = Link(address, self._recheck_s, source=True)
        t = NamedThread(target=self._run, args=(link,), name=f"messenger-link-{address}", daemon=True)
        self._threads.append(t)
        t.start()
        return link

    def _prefill(self) -> list[Link]:
        return [link for link in self.links.values() if not link.source]

    def choose(self) -> Link | None:
        ready = [link for link in self._prefill() if link.alive()]
        return min(ready, key=lambda link: link.outstanding) if ready else None

    def connecting(self) -> bool:
        """A link may become ready soon: requests wait for it (not for a GONE one). So does a
        READY link whose connection was lost a moment ago: its thread has not marked it DOWN yet
        (within POLL_S), and a request arriving then must not fail while the link comes back
        (seen in tests/e2e/test_relay.py: "no usable prefill server: ...: ready")."""
        return any(link.state in (LinkState.CONNECTING, LinkState.DOWN)
                   or (link.state is LinkState.READY and not link.alive()) for link in self._prefill())

    def why(self) -> str:
        return "no usable prefill server: " + "; ".join(link.describe() for link in self._prefill())

    def on_message(self, peer: Any, msg: wire.Message) -> bool:
        """Welcome/Refuse for a link waiting on first contact; False for other messages."""
        if not isinstance(msg, (wire.Welcome, wire.Refuse)):
            return False
        link = self._by_peer.get(peer.id)
        if link is not None:
            link._answer = msg
            link._reply.set()
        return True

    def outcome(self, address: str, error: str = "") -> None:
        """A request this link's server served (error "") or failed although the order was
        valid (scheduler thread). Enough failures in a row take the link out of use."""
        link = self.links.get(address)
        if link is None:
            return
        if not error:
            link.strikes, link.backoff = 0, self._recheck_s
            return
        link.strikes += 1
        if link.strikes < FAIL_STRIKES or link.state is not LinkState.READY:
            return
        link.recheck_at = time.monotonic() + link.backoff
        link.state, link.reason = LinkState.FAILING, (
            f"its last {link.strikes} requests failed, the last one with: {error}; "
            f"connected again in {link.backoff:g} s")
        link.backoff = min(2 * link.backoff, max(RECHECK_MAX_S, self._recheck_s))
        logger.error("messenger: prefill server %s out of use: %s", address, link.reason)
        self._on_change()

    def link_of(self, peer_id: str) -> Link | None:
        return self._by_peer.get(peer_id)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)

    def _run(self, link: Link) -> None:
        while not self._stop.is_set():
            if link.alive():
                self._stop.wait(POLL_S)
                continue
            if link.state is LinkState.FAILING:
                if self._stop.wait(max(0.0, link.recheck_at - time.monotonic())):
                    return
                self._recheck(link)
                self._on_change()
                continue
            if link.state is LinkState.READY:  # it was up: the connection dropped
                link.state, link.reason = LinkState.DOWN, "connection lost"
                link.losses, link._lost_at = link.losses + 1, time.monotonic()
                logger.warning("messenger: prefill server %s lost", link.address)
                self._on_change()
            before = link.state
            self._contact(link)
            if link.state is not before:
                self._on_change()
            if link.state is not LinkState.READY:
                self._stop.wait(REFUSED_RETRY_S if link.state is LinkState.REFUSED else RETRY_S)

    def _recheck(self, link: Link) -> None:
        """A FAILING link from scratch: a new connection and Hello. On probation after it."""
        old, link.peer = link.peer, None
        if old is not None:
            old.close()
        link.state, link.reason = LinkState.DOWN, "re-checking after repeated failures"
        self._contact(link)
        if link.state is LinkState.READY:  # strikes stay: the next failure takes it out again
            logger.warning("messenger: prefill server %s connected again after repeated failures (on probation)",
                           link.address)

    def _contact(self, link: Link) -> None:
        try:
            peer = self._node.backend.connect(link.address, self._timeout)
        except TransferError as e:
            if "peer refused the connection" in str(e):  # the backend handshake: never compatible
                link.state, link.reason = LinkState.REFUSED, f"{REFUSED_MARK} {link.address}: {e}"
                logger.error("messenger: prefill server %s refused this decoder: %s", link.address, e)
            elif link.state in (LinkState.DOWN, LinkState.GONE) and isinstance(e.__cause__, ConnectionRefusedError):
                link.state, link.reason = LinkState.GONE, f"lost, and its port refuses connections: {e}"
            elif link.state is not LinkState.REFUSED:
                link.reason = str(e)
            return
        link._reply.clear()
        self._by_peer[peer.id] = link
        try:
            peer.send(wire.encode(self._hello))
            if not link._reply.wait(self._timeout):
                raise TransferError(f"no answer to Hello within {self._timeout} s")
        except TransferError as e:
            link.reason = str(e)
            peer.close()
            return
        answer = link._answer
        if isinstance(answer, wire.Refuse):
            link.state, link.reason = LinkState.REFUSED, f"{REFUSED_MARK} {answer.prefill}: {answer.reason}"
            logger.error("messenger: prefill server %s refused this decoder: %s", link.address, answer.reason)
            peer.close()
            return
        assert isinstance(answer, wire.Welcome)
        link.peer, link.prefill_tp = peer, answer.kv.tp
        link.instances = tuple(r.instance for r in answer.ranks)
        link.state, link.reason = LinkState.READY, f"{answer.prefill}, TP {answer.kv.tp}"
        if link._lost_at is not None:  # how long a re-link took (a flood must not stretch it: security.md)
            link.outage_s, link._lost_at = time.monotonic() - link._lost_at, None
        logger.info("messenger: linked to prefill server %s (%s)", link.address, link.reason)
