"""Peers over the control channel: handshake, admission, messages, loss.

A PeerTable owns every control connection of one backend and the peers admitted on them.
It talks to its backend only through what it is given at construction: the backend's
HELLO, a check of the peer's, `add_remote` (a peer's region descriptor read into a
RemoteRegion), `attach`/`detach` (the backend's native per-peer state, and failing that
peer's batches and expectations) and `credit` (NOTIFY arrivals); so it never needs the
backend's class (base.py imports this module, not the other way round).

After authentication (auth.py, in control.py) the handshake is one HELLO each way
(messages.py); a mismatch is refused with a reason the dialer raises. A frame that fails a
check closes its connection (control.py logs why); nothing else changes. Peer loss (EOF,
reset, BYE) detaches the peer at once, so its batches and expectations fail within
milliseconds.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import control
from .config import BackendConfig
from .errors import DeadlineExceeded, PeerLostError, TransferError
from .messages import parse_hello, parse_notify
from .notifications import ForgedNotification, Notif, ReplayedNotification, ReplayWindow, notif_text
from .regions import PeerState, RemoteRegion
from ..threads import Thread as NamedThread

# A backend's reading of a peer's region descriptor (TransferBackend.add_remote_region).
AddRemote = Callable[["Peer", bytes | str], RemoteRegion]


class Peer:
    """A connected peer: its control connection and whatever the backend attached to it."""

    def __init__(self, add_remote: AddRemote, table: PeerTable, conn: control.ControlConn, instance: str,
                 address: str, endpoint: dict[str, Any]) -> None:
        self.id = instance            # the peer backend's instance id (descriptor owner)
        self.address = address        # its control address
        self.endpoint = endpoint      # backend-specific connection info from its hello
        self.state = PeerState.CONNECTED
        self.native: Any = None       # backend's per-peer state (fi_addr, agent name, session)
        self._add_remote, self._table, self._conn = add_remote, table, conn
        self._notif_seq = itertools.count()  # next() is atomic under the GIL: posts may race
        self._notif_seen = ReplayWindow()

    def add_remote_region(self, descriptor: bytes | str) -> RemoteRegion:
        return self._add_remote(self, descriptor)

    def last_heard(self) -> float:
        """When (time.monotonic()) the last frame from the peer arrived on this connection."""
        return self._conn.last_rx

    def send(self, data: bytes) -> None:
        """A small control message, delivered in order to the peer's `recv()`."""
        self._conn.send(control.MSG, bytes(data))

    def seal_notification(self, tag: int, count: int) -> str:
        """The text of a data-plane notification crediting `count` writes to `tag` at this peer,
        sealed with this connection's key and numbered (notifications.py)."""
        keys = self._conn.keys
        if keys is None:  # not reachable: a peer is admitted only after authentication
            raise PeerLostError(f"peer {self.address}: connection not authenticated")
        return notif_text(self._table.instance, next(self._notif_seq), tag, count, keys.notif_tx)

    def sealed(self, notif: Notif) -> bool:
        """Whether `notif` carries this connection's notification MAC."""
        keys = self._conn.keys
        try:
            notif.verify(keys.notif_rx if keys is not None else b"")
        except ForgedNotification:
            return False
        return True

    def take_notification(self, notif: Notif) -> None:
        """Accept `notif`, sealed by this connection (sealed()), or raise ReplayedNotification
        when its number was seen already."""
        if not self._notif_seen.take(notif.seq):
            raise ReplayedNotification(f"notification {notif.seq} of {self.id[:8]} for tag {notif.tag} seen before")

    def notify(self, tag: int, count: int) -> None:
        """Credit `count` arrivals for `tag` at the peer (for backends without native immediates)."""
        self._conn.send_json(control.NOTIFY, {"tag": tag, "count": count})

    def close(self) -> None:
        self._conn.close(say_bye=True)
        self._table.drop(self, PeerState.CLOSED, "closed locally")

    def __repr__(self) -> str:
        return f"Peer({self.address}, {self.id[:8]}, {self.state.value})"


class PeerTable:
    def __init__(self, config: BackendConfig, lock: threading.Lock, instance: str, *,
                 hello: Callable[[], dict[str, Any]], check: Callable[[dict[str, Any]], None], add_remote: AddRemote,
                 attach: Callable[[Peer], None], detach: Callable[[Peer, PeerState, str], None],
                 credit: Callable[..., None]) -> None:
        # `lock` is the backend's: a batch is submitted only while its peer is CONNECTED
        # under it, and drop() changes the state under it, so no batch escapes a loss.
        self._config, self._lock, self._add_remote = config, lock, add_remote
        self.instance = instance  # our backend's: the sender named in our notifications
        self._hello, self._check, self._attach, self._detach, self._credit = hello, check, attach, detach, credit
        self._conn_peer: dict[control.ControlConn, Peer] = {}
        self._handshakes: dict[control.ControlConn, queue.Queue] = {}
        self._accepted: queue.Queue[Peer] = queue.Queue()
        self._inbox: queue.Queue[tuple[Peer, bytes]] = queue.Queue()
        self.closed = False
        self._stop = threading.Event()
        self._heartbeat = NamedThread(target=self._beat, name="control-heartbeat", daemon=True)
        self._heartbeat.start()

    def close(self) -> None:
        self.closed = True
        self._stop.set()
        if threading.current_thread() is not self._heartbeat:
            self._heartbeat.join(timeout=2.0)

    def _beat(self) -> None:
        """PING every admitted peer; fail the connection of one that went silent.

        The thread sleeps until the next thing it has to do: the next beat (every
        peer_timeout_s / 9, 0.2 s by default) or the moment the quietest peer's silence
        would pass the limit, whichever is first; a peer that keeps talking pushes its
        moment back, so an idle server wakes this thread 5 times a second, not more, and a
        stopped peer is still failed the moment its silence passes the limit."""
        limit = self._config.peer_timeout_s
        every = limit / 9
        next_beat = time.monotonic() + every
        while True:
            now = time.monotonic()
            with self._lock:
                conns = list(self._conn_peer)
            beat = now >= next_beat
            if beat:
                next_beat = now + every
            wake_at = next_beat
            for conn in conns:
                silent_until = conn.last_rx + limit
                if now > silent_until:
                    conn.fail(f"silent for {now - conn.last_rx:.2f} s (peer_timeout_s {limit}): hung or stopped")
                elif beat and not conn.ping():
                    conn.fail("a heartbeat went out in part (the stream would be corrupt)")
                else:
                    wake_at = min(wake_at, silent_until)
            # a floor of 5 ms: a peer exactly at its limit must not make this spin
            if self._stop.wait(max(0.005, wake_at - now)):
                return

    # ----- the backend's public calls ------------------------------------------------
    def connect(self, address: str, timeout_s: float) -> Peer:
        cfg = self._config
        conn = control.ControlConn(control.dial(address, timeout_s), self._on_frame, self._on_conn_lost, dialed=True,
                                   secret=cfg.secret, handshake_timeout_s=min(timeout_s, cfg.handshake_timeout_s))
        box: queue.Queue = queue.Queue()
        with self._lock:
            self._handshakes[conn] = box
        try:
            conn.start()
            conn.send_json(control.HELLO, self._hello())
            try:
                reply = box.get(timeout=timeout_s)
            except queue.Empty:
                raise DeadlineExceeded(f"no handshake reply from {address} in {timeout_s} s") from None
            if isinstance(reply, BaseException):
                raise reply
            return reply
        except BaseException:
            with self._lock:
                self._handshakes.pop(conn, None)
            conn.close(say_bye=False)
            raise

    def wait_peer(self, timeout_s: float) -> Peer:
        try:
            return self._accepted.get(timeout=timeout_s)
        except queue.Empty:
            raise DeadlineExceeded(f"no peer connected within {timeout_s} s") from None

    def recv(self, timeout_s: float) -> tuple[Peer, bytes]:
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise DeadlineExceeded(f"no control message within {timeout_s} s") from None

    def all(self) -> list[Peer]:
        with self._lock:
            return list(self._conn_peer.values())

    def live(self, instance: str) -> list[Peer]:
        """The admitted peers of backend instance `instance` (one, or a few while a re-link overlaps)."""
        with self._lock:
            return [p for p in self._conn_peer.values() if p.id == instance]

    def drop(self, peer: Peer, state: PeerState, reason: str) -> None:
        """Mark the peer gone (once) and let the backend fail what depended on it."""
        with self._lock:
            if peer.state is not PeerState.CONNECTED:
                return
            peer.state = state
            self._conn_peer.pop(peer._conn, None)
        self._detach(peer, state, reason)

    def on_accept(self, sock: socket.socket, slot: control.Slot) -> None:
        if self.closed:
            sock.close()
            slot.release()
            return
        control.ControlConn(sock, self._on_frame, self._on_conn_lost, secret=self._config.secret,
                            handshake_timeout_s=self._config.handshake_timeout_s, slot=slot).start()

    # ----- control connections' reader threads --------------------------------------
    def _admit(self, conn: control.ControlConn, hello: dict[str, Any]) -> Peer:
        if "error" in hello:
            raise TransferError(f"peer refused the connection: {hello['error']}")
        self._check(hello)
        peer = Peer(self._add_remote, self, conn, hello["instance"], hello["address"], hello["endpoint"])
        self._attach(peer)
        conn.admitted()
        with self._lock:
            self._handshakes.pop(conn, None)
            self._conn_peer[conn] = peer
        return peer

    def _on_frame(self, conn: control.ControlConn, kind: int, payload: bytes) -> None:
        if kind == control.HELLO:
            self._on_hello(conn, payload)
            return
        peer = self._conn_peer.get(conn)
        if peer is None:
            raise TransferError(f"{control.KIND_NAMES.get(kind, kind)} from a peer that is not admitted")
        if kind == control.MSG:
            self._inbox.put((peer, payload))
        elif kind == control.NOTIFY:
            tag, count = parse_notify(payload)
            self._credit(tag, count, source=peer.id)  # this connection's peer: its credits only

    def _on_hello(self, conn: control.ControlConn, payload: bytes) -> None:
        with self._lock:
            if conn in self._conn_peer:
                raise TransferError("a second HELLO on an admitted connection")
            box = self._handshakes.get(conn)
        hello = parse_hello(payload)
        if box is not None:            # reply to our own connect(): admit here, before
            try:                       # this reader thread reads the peer's next frame
                box.put(self._admit(conn, hello))
            except Exception as e:  # noqa: BLE001 - handed to connect() to raise
                box.put(e)
            return
        if conn.dialed:                # late reply to a connect() that gave up
            conn.close(say_bye=False)
            return
        try:                           # an incoming peer
            peer = self._admit(conn, hello)
        except Exception as e:  # noqa: BLE001 - a bad hello only costs that connection
            with contextlib.suppress(TransferError):
                conn.send_json(control.HELLO, {"error": str(e)})
            conn.close(say_bye=False)
            return
        try:
            conn.send_json(control.HELLO, self._hello())
        except TransferError as e:
            self.drop(peer, PeerState.LOST, f"handshake reply failed: {e}")
            return
        self._accepted.put(peer)

    def _on_conn_lost(self, conn: control.ControlConn, reason: str) -> None:
        with self._lock:
            box = self._handshakes.pop(conn, None)
            peer = self._conn_peer.pop(conn, None)
        if box is not None:
            box.put(PeerLostError(f"handshake failed: {reason}"))
        if peer is not None:
            self.drop(peer, PeerState.LOST, reason)
