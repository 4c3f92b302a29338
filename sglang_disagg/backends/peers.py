"""Peer management over the control channel: handshake, admission, messages, loss.

Mixed into TransferBackend (base.py), whose state it uses. The handshake is one HELLO
each way carrying version, backend, provider, instance id, control address and the
backend's endpoint info; a mismatch is refused with a reason the dialer raises.
Peer loss (EOF, reset, BYE) fails that peer's batches and expectations at once.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
from typing import Any

from . import control
from .errors import DeadlineExceeded, PeerLostError, TransferError
from .peer import Peer
from .regions import DESCRIPTOR_VERSION, PeerState


class PeerManager:
    """Uses TransferBackend's _lock, _peers, _conn_peer, _handshakes, _accepted, _inbox,
    _batches, _tracker and its _native_connect / _native_disconnect hooks."""

    def connect(self, address: str, timeout_s: float | None = None) -> Peer:
        self._check_open()
        timeout = timeout_s if timeout_s is not None else self.config.connect_timeout_s
        conn = control.ControlConn(control.dial(address, timeout), self._on_frame, self._on_conn_lost, dialed=True)
        box: queue.Queue = queue.Queue()
        with self._lock:
            self._handshakes[conn] = box
        conn.start()
        try:
            conn.send_json(control.HELLO, self._hello())
            try:
                reply = box.get(timeout=timeout)
            except queue.Empty:
                raise DeadlineExceeded(f"no handshake reply from {address} in {timeout} s") from None
            if isinstance(reply, BaseException):
                raise reply
            return reply
        except BaseException:
            with self._lock:
                self._handshakes.pop(conn, None)
            conn.close(say_bye=False)
            raise

    def wait_peer(self, timeout_s: float) -> Peer:
        """Next peer that connected to us."""
        try:
            return self._accepted.get(timeout=timeout_s)
        except queue.Empty:
            raise DeadlineExceeded(f"no peer connected within {timeout_s} s") from None

    def peers(self) -> list[Peer]:
        with self._lock:
            return list(self._peers.values())

    def _hello(self) -> dict[str, Any]:
        return {"v": DESCRIPTOR_VERSION, "backend": self.name, "provider": self.provider,
                "instance": self.instance, "address": self.address, "endpoint": self._endpoint_info()}

    def _admit(self, conn: control.ControlConn, hello: dict[str, Any]) -> Peer:
        if (hello.get("v"), hello.get("backend"), hello.get("provider")) != (DESCRIPTOR_VERSION, self.name, self.provider):
            raise TransferError(f"peer runs {hello.get('backend')}/{hello.get('provider')} v{hello.get('v')}, "
                                f"we run {self.name}/{self.provider} v{DESCRIPTOR_VERSION}")
        peer = Peer(self, conn, str(hello["instance"]), str(hello["address"]), hello.get("endpoint") or {})
        self._native_connect(peer)
        with self._lock:
            self._handshakes.pop(conn, None)
            self._peers[peer.id] = peer
            self._conn_peer[conn] = peer
        return peer

    def _on_accept(self, sock: socket.socket) -> None:
        if self._closed:
            sock.close()
            return
        control.ControlConn(sock, self._on_frame, self._on_conn_lost).start()

    def _on_frame(self, conn: control.ControlConn, kind: int, payload: bytes) -> None:
        if kind == control.HELLO:
            hello = json.loads(payload)
            with self._lock:
                box = self._handshakes.get(conn)
            if box is not None:            # reply to our own connect(): admit here, before
                try:                       # this reader thread reads the peer's next frame
                    if "error" in hello:
                        raise TransferError(f"peer refused the connection: {hello['error']}")
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
                self._drop_peer(peer, PeerState.LOST, f"handshake reply failed: {e}")
                return
            self._accepted.put(peer)
            return
        peer = self._conn_peer.get(conn)
        if peer is None:
            return
        if kind == control.MSG:
            self._inbox.put((peer, payload))
        elif kind == control.NOTIFY:
            note = json.loads(payload)
            self._tracker.add(int(note["tag"]), int(note["count"]))

    def _on_conn_lost(self, conn: control.ControlConn, reason: str) -> None:
        with self._lock:
            box = self._handshakes.pop(conn, None)
            peer = self._conn_peer.pop(conn, None)
        if box is not None:
            box.put(PeerLostError(f"handshake failed: {reason}"))
        if peer is not None:
            self._drop_peer(peer, PeerState.LOST, reason)

    def _drop_peer(self, peer: Peer, state: PeerState, reason: str) -> None:
        with self._lock:
            if peer.state is not PeerState.CONNECTED:
                return
            peer.state = state
            self._peers.pop(peer.id, None)
            failed = [(bid, fut) for bid, (pid, fut) in self._batches.items() if pid == peer.id]
            for bid, _ in failed:
                del self._batches[bid]
        try:
            self._native_disconnect(peer)
        finally:
            err = PeerLostError(f"peer {peer.address} ({peer.id[:8]}) {state.value}: {reason}")
            for _, fut in failed:
                fut.set_exception(err)
            self._tracker.peer_lost(peer.id, reason)
