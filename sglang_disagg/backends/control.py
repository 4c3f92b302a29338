"""Per-peer TCP control channel: handshake, small messages, liveness.

One socket per peer pair. A process that dies has its sockets closed by the kernel,
so EOF on this socket tells the survivor within milliseconds, for every backend alike,
without waiting for the next write to fail (shm never fails it; tcp;ofi_rxm and
Mooncake only on the next write). TCP keepalive covers hosts that vanish silently.

Frames: 4-byte big-endian length, 1-byte kind, payload. Kinds are named below; a
frame of an unknown kind is a protocol error and drops the connection.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections.abc import Callable

from .errors import PeerLostError, TransferError

HELLO, MSG, NOTIFY, BYE = 1, 2, 3, 4
_HEADER = struct.Struct("!IB")
MAX_FRAME = 64 << 20


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


class ControlConn:
    """A framed connection with a reader thread; `on_lost` runs once, on EOF or error."""

    def __init__(self, sock: socket.socket, on_frame: Callable[[ControlConn, int, bytes], None],
                 on_lost: Callable[[ControlConn, str], None], dialed: bool = False) -> None:
        _tune(sock)
        self.sock = sock
        self.dialed = dialed
        self._on_frame, self._on_lost = on_frame, on_lost
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="control-reader", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def send(self, kind: int, payload: bytes = b"") -> None:
        if len(payload) > MAX_FRAME:
            raise TransferError(f"control message of {len(payload)} bytes exceeds {MAX_FRAME}")
        try:
            with self._send_lock:
                self.sock.sendall(_HEADER.pack(len(payload), kind) + payload)
        except OSError as e:
            raise PeerLostError(f"control channel send failed: {e}") from e

    def send_json(self, kind: int, obj: dict) -> None:
        self.send(kind, json.dumps(obj).encode())

    def close(self, say_bye: bool = True) -> None:
        if self._closed.is_set():
            return
        if say_bye:
            with contextlib.suppress(TransferError):
                self.send(BYE)
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if threading.current_thread() is not self._reader and self._reader.is_alive():
            self._reader.join(timeout=1.0)

    def _recv_exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def _read_loop(self) -> None:
        reason = "connection closed by peer"
        try:
            while True:
                head = self._recv_exact(_HEADER.size)
                if head is None:
                    break
                length, kind = _HEADER.unpack(head)
                if length > MAX_FRAME or kind not in (HELLO, MSG, NOTIFY, BYE):
                    reason = f"protocol error (kind {kind}, length {length})"
                    break
                payload = self._recv_exact(length) if length else b""
                if payload is None:
                    break
                if kind == BYE:
                    reason = "peer closed the connection"
                    break
                self._on_frame(self, kind, payload)
        except OSError as e:
            reason = f"connection error: {e}"
        if not self._closed.is_set():
            self._closed.set()
            with contextlib.suppress(OSError):
                self.sock.close()
            self._on_lost(self, reason)


class ControlServer:
    """Accepts incoming control connections and hands each socket to `on_accept`."""

    def __init__(self, host: str, on_accept: Callable[[socket.socket], None], port: int = 0) -> None:
        try:
            self._sock = socket.create_server((host, port))
        except OSError as e:
            raise TransferError(f"cannot listen on {host}:{port}: {e}") from e
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._on_accept = on_accept
        self._thread = threading.Thread(target=self._loop, name="control-accept", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            self._on_accept(sock)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=1.0)


def dial(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"bad peer address {address!r}: expected host:port")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as e:
        raise PeerLostError(f"cannot reach peer {address}: {e}") from e
    sock.settimeout(None)
    return sock
