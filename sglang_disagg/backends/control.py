"""Per-peer TCP control channel: authentication, handshake, small messages, liveness.

One socket per peer pair. A process that dies has its sockets closed by the kernel,
so EOF on this socket tells the survivor within milliseconds, for every backend alike,
without waiting for the next write to fail (tcp;ofi_rxm and Mooncake fail only the
next write). TCP keepalive covers hosts that vanish silently.

A connection is authenticated first (auth.py: fixed-size challenge and proof, nothing
parsed), then must be admitted by a HELLO; an accepted connection must do both within the
handshake timeout of its accept (one deadline, not a timeout per recv: a peer trickling
bytes is cut like a silent one). Until then only HELLO frames of at most MAX_HELLO bytes
are read. After admission: frames of a 4-byte big-endian length, 1-byte kind, payload, up
to MAX_FRAME. Every frame after authentication, HELLO and PING included, ends with a 16-byte
tag sealed with the keys of that connection's handshake (frames.py): one that fails its check
(altered, injected, replayed, reordered on the way) closes the connection before its payload
is looked at. A frame of an unknown kind, an oversized length, a frame the owner cannot
parse (its handler raised), a silent peer during the handshake: each closes that
connection, with the reason logged and passed to `on_lost`; nothing else changes. The
server bounds how many connections live at once; when full, a newcomer takes the place of
the oldest connection not yet admitted (control_server.py: ControlServer, Slot).

Liveness: admitted peers PING each other (peers.py's heartbeat thread, a few times per
`peer_timeout_s`); a peer from which nothing at all arrived for `peer_timeout_s` is hung
or stopped (SIGSTOP, a frozen host: TCP itself still answers) and its connection fails.
The PINGs come from a thread of their own, so a server busy computing still sends them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

from . import auth
from .control_server import ControlServer, Slot, _Throttle  # noqa: F401 - control.X, as before the split
from .frames import TAG_BYTES, FrameAuthError, FrameKeys
from .errors import PeerLostError, TransferError
from ..ipc import stream
from ..threads import Thread as NamedThread

logger = logging.getLogger("sglang_disagg.backends")

HELLO, MSG, NOTIFY, BYE, PING = 1, 2, 3, 4, 5
KIND_NAMES = {HELLO: "HELLO", MSG: "MSG", NOTIFY: "NOTIFY", BYE: "BYE", PING: "PING"}
_HEADER = struct.Struct("!IB")
MAX_FRAME = 16 << 20   # an order for 2**20 tokens is ~8 MB of JSON
MAX_HELLO = 64 << 10


TCP_THIN_LINEAR_TIMEOUTS = 16  # linux/tcp.h; not in the socket module


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if sys.platform.startswith("linux"):
        # A control connection is a thin stream (a heartbeat every 0.2 s). With TCP's doubling
        # retransmit timer a link down for 0.8 s left the peers silent for ~1.8 s (retries at
        # 0.25, 0.75, 1.75 s) and lost them; linear timeouts retry every RTO for the first six.
        sock.setsockopt(socket.IPPROTO_TCP, TCP_THIN_LINEAR_TIMEOUTS, 1)
    for opt, val in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


def _peername(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


class ControlConn:
    """A framed connection with a reader thread; `on_lost` runs once, on EOF or error.

    A dialed connection authenticates in start() (the caller gets AuthError); an accepted
    one in its reader thread, so a slow or hostile client never blocks the accept loop.
    The owner calls admitted() from its HELLO handler (in the reader thread) once the peer
    is known. Until then every read ends by a deadline: `handshake_timeout_s` after the
    accept for an accepted connection (authentication and HELLO together); for a dialed one,
    after its authentication (the reply waits on the acceptor attaching us natively;
    connect() bounds the whole by its own timeout). `slot`: an accepted one's place in its
    ControlServer, released when the connection closes."""

    def __init__(self, sock: socket.socket, on_frame: Callable[[ControlConn, int, bytes], None],
                 on_lost: Callable[[ControlConn, str], None], dialed: bool = False, secret: bytes | None = None,
                 handshake_timeout_s: float = 2.0, slot: Slot | None = None) -> None:
        _tune(sock)
        self.sock = sock
        self.dialed = dialed
        self.remote = _peername(sock)
        self._on_frame, self._on_lost, self._slot = on_frame, on_lost, slot
        self._secret, self._handshake_s = secret, handshake_timeout_s
        self._admitted = False
        self._keys: FrameKeys | None = None  # set by the handshake, before any frame
        self._deadline = time.monotonic() + handshake_timeout_s  # a dialed one re-arms it in start()
        self.last_rx = time.monotonic()   # any frame counts: the peer's PINGs keep it fresh
        self._fail_reason = ""
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = NamedThread(target=self._read_loop, name="control-reader", daemon=True)

    def start(self) -> None:
        if self.dialed:
            try:
                self._keys = auth.handshake(self.sock, self._secret, True, self._handshake_s)
            except auth.AuthError:
                self._shut()
                raise
            self._deadline = time.monotonic() + self._handshake_s
            self.sock.settimeout(self._handshake_s)  # for our HELLO, sent before the reader arms it
        self._reader.start()

    @property
    def keys(self) -> FrameKeys | None:
        """This connection's keys (None until authenticated): its frames' and its notifications'."""
        return self._keys

    def admitted(self) -> None:
        """The peer's HELLO was accepted: lift the handshake deadline and frame bound."""
        self._admitted = True
        with contextlib.suppress(OSError):
            self.sock.settimeout(None)
        if self._slot is not None:
            self._slot.admitted()

    def send(self, kind: int, payload: bytes = b"") -> None:
        if len(payload) > MAX_FRAME:
            raise TransferError(f"control message of {len(payload)} bytes exceeds {MAX_FRAME}")
        header = _HEADER.pack(len(payload), kind)
        try:
            with self._send_lock:  # seal and write in one order: the receiver checks them in it
                keys = self._keys
                if keys is None:
                    raise PeerLostError("control channel send before authentication")
                self.sock.sendall(header + payload + keys.seal(header, payload))
                keys.commit()
        except OSError as e:
            raise PeerLostError(f"control channel send failed: {e}") from e

    def ping(self) -> bool:
        """Send a PING without ever blocking (the caller watches many connections); skipped
        while a send is in progress or the send buffer is full (a slow reader is not a dead
        one: the peer's own silence decides). False only if the frame went out in part,
        which would corrupt the stream."""
        if not self._send_lock.acquire(blocking=False):
            return True
        try:
            keys = self._keys
            if keys is None:
                return True
            header = _HEADER.pack(0, PING)
            frame = header + keys.seal(header, b"")
            sent = self.sock.send(frame, socket.MSG_DONTWAIT)
            if sent == len(frame):
                keys.commit()  # a PING not sent at all is sealed again, with the same number, next beat
        except OSError:  # BlockingIOError: buffer full; anything else the reader reports
            return True
        finally:
            self._send_lock.release()
        return sent == len(frame)

    def fail(self, reason: str) -> None:
        """End the connection from another thread: the reader stops and reports `reason`."""
        self._fail_reason = reason
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def send_json(self, kind: int, obj: dict) -> None:
        self.send(kind, json.dumps(obj).encode())

    def close(self, say_bye: bool = True) -> None:
        if self._closed.is_set():
            return
        if say_bye:
            with contextlib.suppress(TransferError):
                self.send(BYE)
        self._closed.set()
        self._shut()
        if threading.current_thread() is not self._reader and self._reader.is_alive():
            self._reader.join(timeout=1.0)

    def _shut(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self._slot is not None:
            self._slot.release()

    def _recv_exact(self, n: int) -> bytes | None:
        # Before admission, the handshake's one deadline; admitted() runs on this thread, so
        # the flag cannot change under a read.
        try:
            return stream.recv_exactly(self.sock, n, "the control connection", None if self._admitted else self._deadline)
        except EOFError:
            return None

    def _read_loop(self) -> None:
        reason = "connection closed by peer"
        try:
            if not self.dialed:
                self._keys = auth.handshake(self.sock, self._secret, False,
                                            max(0.0, self._deadline - time.monotonic()))
            keys = self._keys
            if keys is None:  # start() authenticates a dialed connection before this thread runs
                raise auth.AuthError("connection not authenticated")
            while True:
                head = self._recv_exact(_HEADER.size)
                if head is None:
                    break
                length, kind = _HEADER.unpack(head)
                self.last_rx = time.monotonic()
                limit = MAX_FRAME if self._admitted else MAX_HELLO
                if kind not in KIND_NAMES or length > limit:
                    reason = f"protocol error: frame kind {kind}, length {length} (limit {limit})"
                    break
                if kind == PING and length:
                    reason = "protocol error: PING with a payload"
                    break
                # The accepting side admits its dialer (the heartbeat thread sees it) before
                # its HELLO reply goes out, so a PING can arrive first: an empty PING from an
                # authenticated peer is harmless; the pre-HELLO deadline still holds.
                if not self._admitted and kind not in (HELLO, BYE, PING):
                    reason = f"protocol error: {KIND_NAMES[kind]} before the handshake"
                    break
                payload = self._recv_exact(length) if length else b""
                tag = self._recv_exact(TAG_BYTES) if payload is not None else None
                if tag is None:
                    break
                try:
                    keys.open(head, payload, tag)  # before a byte of the payload is believed
                except FrameAuthError as e:
                    reason = f"protocol error: {e}"
                    break
                if kind == BYE:
                    reason = "peer closed the connection"
                    break
                if kind == PING:
                    continue
                try:
                    self._on_frame(self, kind, payload)
                except Exception as e:  # noqa: BLE001 - a bad frame costs its connection only
                    reason = f"malformed {KIND_NAMES[kind]} frame: {e}"
                    break
        except auth.AuthError as e:
            reason = str(e)
        except socket.timeout:
            reason = f"no handshake within {self._handshake_s} s"
        except OSError as e:
            reason = f"connection error: {e}"
        reason = self._fail_reason or reason
        if self._slot is not None and self._slot.evicted:  # the server logged it (rate-bounded)
            reason = "evicted: the connection limit was reached before this peer said HELLO"
        if not self._closed.is_set():
            self._closed.set()
            self._shut()
            if reason.startswith(("protocol error", "malformed", "authentication", "no handshake", "no auth",
                                  "peer does not", "peer's control", "peer echoed", "silent")):
                if self._slot is not None and not self._admitted:  # anyone can cause these: bounded
                    self._slot.log_closed(self.remote, reason)
                else:
                    logger.warning("control connection %s %s closed: %s", "to" if self.dialed else "from",
                                   self.remote, reason)
            self._on_lost(self, reason)


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
