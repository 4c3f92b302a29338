"""The owner of a data-parallel server's one transfer backend: the leader of DP group 0.

With data parallelism SGLang runs one scheduler per DP group (attention DP: each group's
attention-TP rank 0; replica DP: each replica's TP rank 0), each with its own KV pool and
requests, in processes of their own. Each group runs its own messenger (prefill.py /
decode.py over its own ranks), a logical messenger; the server still has ONE backend and
one set of ports, held here. Other groups' leaders reach it through proxy.ProxyBackend
over the owner's socket (ipc: fdpass's stream mode, messages of wire.py); their pools are
shared memory, mapped and registered here as the TP ranks' are (node.py).

Who gets a peer's control message (the owner's control thread reads them all, `dispatch`):
- decode: the group that opened the connection it came on (each group keeps its own links
  to the prefill servers, its own Hello naming its group and its pool). Hello, MigrationOrder
  and Cancel come only from another decoder taking requests that migrate from here
  (migration/targets.py): its Hello goes to every joined group (any of them may hold a
  request for it; group 0 alone answers), its MigrationOrder and Cancel to the group the
  migration handle names (a group draws its handles from its residue modulo the groups:
  migration/room.Source.new);
- prefill: a Hello goes to every joined group (each must know the decoder's regions; group 0
  alone answers; a group joining later hears it as it joins), an order to the group with the fewest orders outstanding (ties: the
  lowest group), a cancel to the group that took the order, anything else to group 0.
Peer states are mirrored to the groups using them (polled every STATE_POLL_S).

A group must take each message the owner sends it (deliveries, replies, Done from backend
threads, peer states) within SEND_TIMEOUT_S: one stopped or stuck group must not stall the
control thread, the backend's completion threads and with them the whole server. Past it
the group is dropped (logged once): its channel is closed, nothing more is dispatched to it
(it finds its owner gone when it wakes, and stops). An order whose delivery to it failed
never reached it: it is failed back to its decoder at once (OrderFailed, blamed on this
server) and forgotten here. Orders the group already held are NOT failed here: writes it
posted may still land in the decoder's pages, so the decoder keeps them until its transfer
deadline fails them (a Cancel for one is dropped, as to any group not connected).

The socket's name comes from the deployment's secret (wire.socket_name): a name
already taken stops the owner ("is taken"); a group checks the listener's user before it
sends, the owner each connecting group's (fdpass.Conn.other_user) at accept.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from ...backends.errors import PeerLostError, TransferError
from ...backends.regions import HOST, PeerState
from ...ipc import fdpass, shm, stream
from ...ratelog import RateLog
from ...threads import Thread as NamedThread
from .. import wire
from ..config import MessengerRole
from . import wire as gw

logger = logging.getLogger("sglang_disagg.messenger")
# A migration's handle in B's order (the rid is the handle) or cancel (the rid ends .m<handle>[g<k>])
_HANDLE = re.compile(r"(?:^|\.m)([0-9]{1,10})(?:g[0-9]{1,7})?$")
STATE_POLL_S = 0.05  # a lost peer must reach the groups within the links' 2 s promise
SEND_TIMEOUT_S = 1.8  # a group that takes no message for this long is dropped, as a silent peer is
JOIN_S = 10.0  # a group sends Join as it connects: a connection still silent then is closed (its thread ends)


class Owner:
    def __init__(self, backend: Any, name: str, role: MessengerRole, groups: int,
                 local: Callable[[Any, wire.Message], None] | None = None) -> None:
        self.backend, self.role, self.groups = backend, role, groups
        self.local = local  # group 0's own handler (set when its messenger starts its reader)
        self._lock = threading.Lock()
        self._conns: dict[int, gw.Channel] = {}
        self._regions: dict[int, list[Any]] = {}      # group -> MemoryRegions registered for it
        self._mappings: list[shm.Mapping] = []
        self._pids = itertools.count(1)
        self._peers: dict[int, Any] = {}              # pid -> the backend's Peer
        self._pid_of: dict[int, int] = {}             # id(Peer) -> pid
        self._users: dict[int, set[int]] = {}         # pid -> groups told about it
        self._states: dict[int, PeerState] = {}       # pid -> state last told
        self._opened_by: dict[int, int] = {}          # id(Peer) -> the group that connected it (decode)
        self._remotes: dict[int, tuple[int, Any]] = {}  # id -> (its peer's pid, RemoteRegion)
        self._hellos: dict[int, tuple[Any, bytes]] = {}  # prefill: id(Peer) -> its decoder's last Hello
        self._remote_ids = itertools.count(1)
        self.outstanding = [0] * groups               # prefill: orders given to each group, not done
        self._orders: dict[tuple[str, int], int] = {}  # (decoder instance, tag) -> group
        self._ops = self._operations()
        self._stop = threading.Event()
        self.refused = 0  # connections of another user, closed at accept
        self._log = RateLog(5.0, logger)  # another local user can connect as fast as they like
        try:
            self._listener = fdpass.Listener("dp", backlog=groups, name=name, stream=True)
        except fdpass.FdPassError as e:
            if isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.EADDRINUSE:
                raise TransferError(f"the DP owner socket @{name} is taken: another process of this "
                                    "host listens on it (an earlier server on this port still running, or another "
                                    "user who bound the name first); the groups would reach it, not this "
                                    "server") from e
            raise TransferError(f"cannot listen on the DP owner socket @{name}: {e}") from e
        self._threads = [NamedThread(target=self._accept, name="dp-owner-accept", daemon=True),
                         NamedThread(target=self._watch, name="dp-owner-watch", daemon=True)]
        for t in self._threads:
            t.start()

    # ----- the owner's control thread -------------------------------------------------------
    def dispatch(self, peer: Any, raw: bytes, msg: wire.Message) -> None:
        decode = self.role is MessengerRole.DECODE
        if decode and isinstance(msg, (wire.MigrationOrder, wire.Cancel)):  # only a migration target sends these
            targets = [self._migration_group(msg)]
        elif decode and not isinstance(msg, wire.Hello):  # a prefill server's (or migration source's) answer
            targets = [self._opened_by.get(id(peer), 0)]
        elif isinstance(msg, wire.Hello):
            with self._lock:  # a group joining later hears it then (_serve); a dropped one, never
                self._hellos[id(peer)] = (peer, raw)
                targets = [0, *sorted(self._conns)]
        elif isinstance(msg, wire.PrefillOrder):
            with self._lock:
                live = [g for g in range(self.groups) if g == 0 or g in self._conns]
                g = min(live, key=lambda g: (self.outstanding[g], g))
                self.outstanding[g] += 1
                self._orders[(peer.id, msg.tag)] = g
            targets = [g]
        elif isinstance(msg, wire.Cancel):
            targets = [self._orders.get((peer.id, msg.tag), 0)]
        else:
            targets = [0]
        for g in targets:
            if g == 0:
                if self.local is not None:
                    self.local(peer, msg)
                continue
            conn = self._conns.get(g)
            if conn is None:  # an order: its group was dropped since it was chosen
                logger.warning("messenger: DP group %d is not connected: %s from %s dropped", g,
                               type(msg).__name__, peer.address)
                if isinstance(msg, wire.PrefillOrder):
                    self._undeliverable(peer, msg, g, ConnectionError(f"DP group {g} is not connected"))
                continue
            try:
                conn.send(gw.Delivery(self._pid(peer, g), peer.id, peer.address, bytes(raw)))
            except OSError as e:
                self._drop(g, conn, e)
                if isinstance(msg, wire.PrefillOrder):
                    self._undeliverable(peer, msg, g, e)

    def _migration_group(self, msg: wire.Message) -> int:
        """The group a migration target's order or cancel names by its handle (0 if none: a
        group that does not hold the request refuses it with the reason)."""
        m = _HANDLE.search(str(getattr(msg, "rid", "")))
        g = int(m.group(1)) % self.groups if m is not None else 0
        return g if g == 0 or g in self._conns else 0

    def order_done(self, instance: str, tag: int) -> None:
        with self._lock:
            g = self._orders.pop((instance, tag), None)
            if g is not None:
                self.outstanding[g] -= 1

    def _undeliverable(self, peer: Any, order: wire.PrefillOrder, g: int, err: Exception) -> None:
        """An order that never reached group `g`: forgotten here, failed to its decoder."""
        with self._lock:
            if self._orders.get((peer.id, order.tag)) == g:
                del self._orders[(peer.id, order.tag)]
                self.outstanding[g] -= 1
        reason = f"DP group {g} of the prefill server could not take the order: {err}"
        try:
            peer.send(wire.encode(wire.OrderFailed(rid=order.rid, tag=order.tag, reason=reason,
                                                   blame=wire.Blame.SERVER, posted=0)))
        except Exception as e:  # noqa: BLE001 - a lost decoder fails the order at its own end
            logger.warning("messenger: could not fail order %s back to %s: %s", order.rid, peer.address, e)

    def _drop(self, g: int, chan: gw.Channel, err: OSError) -> None:
        """Group `g` did not take a message in time (or its connection broke): close its
        channel and dispatch nothing more to it; logged once per group."""
        with self._lock:
            first = self._conns.get(g) is chan
            if first:
                del self._conns[g]
        if first:
            logger.error("messenger: DP group %d dropped: it did not take the owner's messages (%s); its new "
                         "orders go to the other groups, those it held end at their decoders' deadlines", g, err)
        chan.close()

    # ----- group connections ------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self._listener.accept(None)
            except fdpass.FdPassError:
                if self._stop.is_set():
                    return
                continue  # the peer went between accept and its credentials
            refused = conn.other_user()
            if refused:
                conn.close()
                self.refused += 1
                self._log.warn("refused", "messenger: refused a connection to the DP owner socket: %s "
                               "(%d refused so far)", refused, self.refused)
                continue
            NamedThread(target=self._serve, args=(gw.Channel(conn.sock, SEND_TIMEOUT_S),), name="dp-owner-group",
                        daemon=True).start()

    def _serve(self, chan: gw.Channel) -> None:
        try:
            stream.read_deadline(chan.sock, JOIN_S)
            join = chan.read()
            stream.read_deadline(chan.sock, None)  # a joined group's next call may come much later
            if not isinstance(join, gw.Join) or not 0 < join.group < self.groups:
                raise gw.GroupWireError(f"expected Join of a group in 1..{self.groups - 1}, got {join}")
            b = self.backend
            chan.send(gw.Joined(b.name, b.provider or "", b.address, b.instance))
        except BlockingIOError:
            logger.error("messenger: a connection to the DP owner sent no Join within %g s: closed", JOIN_S)
            chan.close()
            return
        except (EOFError, OSError, gw.GroupWireError) as e:
            logger.error("messenger: a DP group's connection to the owner failed: %s", e)
            chan.close()
            return
        g = join.group
        try:
            with self._lock:
                # Decoders that said Hello before this group joined: it hears them before any order
                # can reach it (orders go to joined groups only, and it joins under this lock; a
                # group that takes none holds it SEND_TIMEOUT_S at most, the first failure ending it).
                for peer, raw in self._hellos.values():
                    if peer.state is PeerState.CONNECTED:
                        chan.send(gw.Delivery(self._pid_locked(peer, g), peer.id, peer.address, bytes(raw)))
                self._conns[g] = chan
                self._regions.setdefault(g, [])
        except OSError as e:
            logger.error("messenger: DP group %d did not take the decoders' Hellos as it joined: %s", g, e)
            chan.close()
            return
        logger.info("messenger: DP group %d joined the server's messenger", g)
        while not self._stop.is_set():
            try:
                call = chan.read()
                if isinstance(call, gw.Connect):  # may take seconds: the group's other calls go on
                    NamedThread(target=self._call, args=(chan, g, call), name="dp-owner-connect", daemon=True).start()
                else:
                    self._call(chan, g, call)
            except (EOFError, OSError, gw.GroupWireError) as e:
                if self._conns.get(g) is chan:  # not when dropped (_drop said why)
                    logger.error("messenger: DP group %d left: %s", g, e)
                break
            except Exception:  # noqa: BLE001 - this group's connection ends, the owner's other threads go on
                logger.exception("messenger: DP group %d: dropped its connection to the owner", g)
                break
        with self._lock:
            if self._conns.get(g) is chan:
                del self._conns[g]
        chan.close()

    def _call(self, chan: gw.Channel, g: int, call: gw.Message) -> None:
        op = self._ops.get(type(call))
        if op is None:
            raise gw.GroupWireError(f"{call.TYPE} is not a message a group sends")
        try:
            answer = op(chan, g, call)
        except Exception as e:  # noqa: BLE001 - the group gets the error as its backend would raise it
            error, kind = (str(e) or type(e).__name__)[:4000], type(e).__name__
            if hasattr(call, "id"):
                cause = type(e.__cause__).__name__ if e.__cause__ is not None else ""
                self._reply(chan, gw.Failed(call.id, error, kind, cause), g)
            elif hasattr(call, "future"):
                self._reply(chan, gw.Done(call.future, error, kind), g)
            else:
                logger.warning("messenger: DP group %d: %s failed: %s", g, call.TYPE, e)
            return
        if answer is not None:
            self._reply(chan, answer, g)

    def _reply(self, chan: gw.Channel, msg: gw.Message, g: int) -> None:
        """Send `msg` to group `g` (its own thread, the control thread, backend threads): a
        group that does not take it in time is dropped."""
        try:
            chan.send(msg)
        except OSError as e:
            self._drop(g, chan, e)

    def _done(self, chan: gw.Channel, g: int, fid: int, fut: Any) -> None:  # backend thread
        err = fut.exception()
        self._reply(chan, gw.Done(fid) if err is None else gw.Done(fid, (str(err) or type(err).__name__)[:4000],
                                                                     type(err).__name__), g)

    # ----- operations: one per message a group sends (wire.CALLS); an answer or None --------------
    def _operations(self) -> dict[type, Callable[[gw.Channel, int, Any], gw.Message | None]]:
        return {gw.Register: self._register, gw.Connect: self._connect, gw.Send: self._send,
                gw.AddRemote: self._add_remote, gw.WritePages: self._write_pages, gw.Expect: self._expect,
                gw.Retire: lambda chan, g, m: self.backend.retire(m.tag, m.reason),
                gw.Forget: lambda chan, g, m: self.backend.forget(m.tag),
                gw.IsRetired: lambda chan, g, m: gw.Answer(m.id, bool(self.backend.is_retired(m.tag))),
                gw.Landed: lambda chan, g, m: gw.Counters(m.id, {"landed": int(self.backend.landed(m.tag))}),
                gw.Stats: lambda chan, g, m: gw.Counters(m.id, dict(self.backend.stats())),
                gw.ClosePeer: self._close_peer,
                gw.OrderDone: lambda chan, g, m: self.order_done(m.instance, m.tag)}

    def _register(self, chan: gw.Channel, g: int, m: gw.Register) -> gw.Registered:
        mapping = shm.Mapping(shm.Backing(m.path, m.offset, m.inode, m.dev, m.target), m.length)
        self._mappings.append(mapping)
        region, desc = self.backend.register(mapping.addr, m.length, HOST)
        with self._lock:
            self._regions[g].append(region)
            return gw.Registered(m.id, len(self._regions[g]) - 1, desc.decode())

    def _connect(self, chan: gw.Channel, g: int, m: gw.Connect) -> gw.Connected:
        peer = self.backend.connect(m.address, m.timeout_s)
        self._opened_by[id(peer)] = g
        return gw.Connected(m.id, self._pid(peer, g), peer.id, peer.address)

    def _send(self, chan: gw.Channel, g: int, m: gw.Send) -> None:
        self._peer(m.peer).send(m.data)

    def _add_remote(self, chan: gw.Channel, g: int, m: gw.AddRemote) -> gw.Added:
        remote = self._peer(m.peer).add_remote_region(m.descriptor)
        with self._lock:
            rid = next(self._remote_ids)
            self._remotes[rid] = (m.peer, remote)
        return gw.Added(m.id, rid)

    def _write_pages(self, chan: gw.Channel, g: int, m: gw.WritePages) -> None:
        remote = self._remotes.get(m.dst)
        if remote is None:
            raise PeerLostError(f"the peer of remote region {m.dst} is gone")
        regions = self._regions[g]
        if m.src >= len(regions):
            raise TransferError(f"DP group {g} has no region {m.src}")
        fut = self.backend.write_pages(self._peer(m.peer), regions[m.src], m.src_pages, m.src_stride, remote[1],
                                       m.dst_pages, m.dst_stride, m.length, m.imm, m.src_offset, m.dst_offset)
        fut.add_done_callback(lambda f: self._done(chan, g, m.future, f))

    def _expect(self, chan: gw.Channel, g: int, m: gw.Expect) -> None:
        fut = self.backend.expect(m.tag, m.count, m.timeout_s, None if m.peers is None else set(m.peers))
        fut.add_done_callback(lambda f: self._done(chan, g, m.future, f))

    def _close_peer(self, chan: gw.Channel, g: int, m: gw.ClosePeer) -> None:
        p = self._peers.get(m.peer)  # already forgotten: it was lost or closed
        if p is not None:
            p.close()

    # ----- peers ------------------------------------------------------------------------------
    def _pid(self, peer: Any, g: int) -> int:
        with self._lock:
            return self._pid_locked(peer, g)

    def _pid_locked(self, peer: Any, g: int) -> int:
        pid = self._pid_of.get(id(peer))
        if pid is None:
            pid = self._pid_of[id(peer)] = next(self._pids)
            self._peers[pid] = peer
            self._states[pid] = peer.state
        self._users.setdefault(pid, set()).add(g)
        return pid

    def _peer(self, pid: int) -> Any:
        peer = self._peers.get(pid)
        if peer is None:
            raise PeerLostError(f"peer connection {pid} is gone")
        return peer

    def _watch(self) -> None:
        """Tell the groups using a peer that it was lost or closed, then forget the peer (a
        group's later call on it fails as on a lost peer)."""
        while not self._stop.wait(STATE_POLL_S):
            with self._lock:
                changed = [(pid, p.state, set(self._users.get(pid, ()))) for pid, p in self._peers.items()
                           if p.state is not self._states[pid]]
                for pid, _, _ in changed:
                    peer = self._peers.pop(pid)
                    for table in (self._pid_of, self._opened_by, self._hellos):
                        table.pop(id(peer), None)
                    self._states.pop(pid, None)
                    self._users.pop(pid, None)
                    for rid in [r for r, (p, _) in self._remotes.items() if p == pid]:
                        del self._remotes[rid]
                conns = dict(self._conns)
            for pid, state, users in changed:
                for g in users:
                    if g in conns:
                        self._reply(conns[g], gw.PeerState(pid, state), g)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        for chan in list(self._conns.values()):
            chan.close()
        for m in self._mappings:
            m.close()

