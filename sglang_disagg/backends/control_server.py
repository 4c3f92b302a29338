"""The control channel's listening side: accepting connections under a bound on how many live.

A ControlServer hands each accepted socket, with its Slot, to its owner (peers.PeerTable, which
wraps it in a control.ControlConn). Every source shares the slots, so a flood of connections
that never authenticate must not keep a real peer out: when all are taken, a newcomer evicts the
oldest connection not yet admitted (admitted peers hold the secret and are never pushed out).
Warnings about it are rate-bounded: anyone who can reach the port can cause them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from ..ratelog import RateLog
from ..threads import Thread as NamedThread
from .errors import TransferError

# The control channel's logger (control.py): one name for the whole channel.
logger = logging.getLogger("sglang_disagg.backends")


def _Throttle(every_s: float) -> RateLog:  # noqa: N802 - the control server's rate-bounded warnings
    return RateLog(every_s, logger)


class Slot:
    """One accepted connection's place under its server's bound, handed to `on_accept` with
    the socket. The connection's owner calls admitted() once the peer has authenticated and
    said HELLO (from then on no newcomer can take the place) and release() when it is closed
    (once is enough; later calls do nothing). `evicted`: the server shut the socket down to
    make room for a newcomer; the reader then ends and releases the slot as on any close."""

    __slots__ = ("_server", "_sock", "evicted", "is_admitted", "released")

    def __init__(self, server: ControlServer, sock: socket.socket) -> None:
        self._server, self._sock = server, sock
        self.evicted = self.is_admitted = self.released = False

    def admitted(self) -> None:
        self._server._admit(self)

    def release(self) -> None:
        self._server._release(self)

    def log_closed(self, remote: str, reason: str) -> None:
        """Log why a connection that was never admitted closed, rate-bounded per server:
        anyone who can reach the port can make these as fast as they can connect."""
        self._server._log.warn("closed", "control server %s: connection from %s closed: %s",
                               self._server.address, remote, reason)

    def _shut(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


class ControlServer:
    """Accepts incoming control connections and hands each socket to `on_accept` with its
    Slot, at most `max_connections` alive at once.

    When every slot is taken, a newcomer evicts the oldest connection not yet admitted;
    only when every slot holds an admitted peer is the newcomer closed at accept (counted
    in `refused`; evictions in `evicted`). Admitted peers hold the secret and are never
    pushed out. Why eviction: slots shared by every source let 300 connections that
    never authenticate keep a real decoder from re-linking; it needs its slot only for its
    handshake (a few round trips), and an attacker must now open `max_connections` newer
    connections within that time to push it out. The warnings are rate-bounded
    (`log_every_s`); the counters are exact."""

    def __init__(self, host: str, on_accept: Callable[[socket.socket, Slot], None], port: int = 0,
                 max_connections: int = 256, log_every_s: float = 5.0) -> None:
        try:
            self._sock = socket.create_server((host, port))
        except OSError as e:
            raise TransferError(f"cannot listen on {host}:{port}: {e}") from e
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._on_accept = on_accept
        self._max = max_connections
        self._lock = threading.Lock()
        self._waiting: dict[Slot, None] = {}  # not admitted nor evicted, oldest first
        self._admitted = 0                    # admitted, not released
        self.refused = self.evicted = 0
        self._log = _Throttle(log_every_s)
        self._thread = NamedThread(target=self._loop, name="control-accept", daemon=True)
        self._thread.start()

    def _take(self, sock: socket.socket) -> tuple[Slot | None, Slot | None]:
        """A slot for a new connection (None: refused) and the one it evicts, if any. An
        evicted slot stops counting at once: its reader releases it moments later."""
        with self._lock:
            victim = None
            if self._admitted + len(self._waiting) >= self._max:
                if not self._waiting:
                    self.refused += 1
                    return None, None
                victim = next(iter(self._waiting))
                del self._waiting[victim]
                victim.evicted = True
                self.evicted += 1
            slot = Slot(self, sock)
            self._waiting[slot] = None
            return slot, victim

    def _admit(self, slot: Slot) -> None:
        with self._lock:
            if slot.evicted or slot.released or slot.is_admitted:
                return  # evicted first: its socket is already shut down
            del self._waiting[slot]
            slot.is_admitted = True
            self._admitted += 1

    def _release(self, slot: Slot) -> None:
        with self._lock:
            if slot.released:
                return
            slot.released = True
            if slot.is_admitted:
                self._admitted -= 1
            else:
                self._waiting.pop(slot, None)  # absent if evicted

    def _loop(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            slot, victim = self._take(sock)
            if victim is not None:
                victim._shut()
                self._log.warn("limit", "control server %s: connection limit (%d) reached: evicted the oldest "
                               "connection not yet admitted (%d evicted, %d refused so far)",
                               self.address, self._max, self.evicted, self.refused)
            if slot is None:
                sock.close()
                self._log.warn("limit", "control server %s: refused %s: connection limit (%d) reached, every "
                               "connection admitted (%d evicted, %d refused so far)",
                               self.address, addr, self._max, self.evicted, self.refused)
                continue
            try:
                self._on_accept(sock, slot)
            except Exception:  # noqa: BLE001 - one bad socket must not stop accepting
                logger.exception("control server %s: accepting %s failed", self.address, addr)
                sock.close()
                slot.release()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=1.0)
