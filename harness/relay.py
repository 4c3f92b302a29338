"""An on-path attacker for our control connections: a TCP relay a dialer reaches instead of its
target. Every connection's handshake passes untouched (the relay holds no secret, as an attacker
on the path would not); after it the dialer's sealed frames are parsed and, once `arm(mode)` was
called, the first frame `match(kind, payload)` takes is tampered with, in a way that still parses:

- ``alter``:  its payload edited by `alter(payload)` (the frame's length fixed up; only the seal
  can tell): tests/e2e/test_relay.py swaps a PrefillOrder's destination page for another of the
  same order, tests/backends/test_frame_auth.py edits an in-range page id;
- ``replay``: sent twice;
- ``inject``: the connection's first MSG frame (sealed earlier in this very session) sent again in
  front of it;
- ``swap``:   held back and sent after the frame that follows it;
- ``drop``:   never sent.

Frames from the target to the dialer are copied as they are. The relay records that it tampered
(`done`) and how many connections it carried (a re-link is one more), so a test checks that the
fault happened before it judges the outcome."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections.abc import Callable

from sglang_disagg.backends import auth, control, frames

FRAME = struct.Struct("!IB")  # backends/control.py: length, kind; then payload and the seal
MODES = ("alter", "replay", "inject", "swap", "drop")


def any_message(kind: int, payload: bytes) -> bool:
    return kind == control.MSG


def prefill_order(kind: int, payload: bytes) -> bool:
    """A messenger PrefillOrder (messenger/wire.py, TYPE "prefill")."""
    return kind == control.MSG and b'"type":"prefill"' in payload


def other_page(payload: bytes) -> bytes:
    """A PrefillOrder whose first destination page is another page of the same order."""
    order = json.loads(payload)
    pages = order["dst_pages"]
    pages[0] = pages[-1] if len(pages) > 1 and pages[-1] != pages[0] else pages[0] + 1
    return json.dumps(order, separators=(",", ":")).encode()


class Relay:
    def __init__(self, target: str, match: Callable[[int, bytes], bool] = any_message,
                 alter: Callable[[bytes], bytes] = other_page) -> None:
        self.target, self.match, self.alter = target, match, alter
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.mode = ""
        self.armed = threading.Event()
        self.done = threading.Event()
        self.connections = 0
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def arm(self, mode: str) -> None:
        assert mode in MODES, mode
        self.mode = mode
        self.done.clear()
        self.armed.set()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                host, port = self.target.rsplit(":", 1)
                try:
                    server = socket.create_connection((host, int(port)), timeout=5)
                except OSError:
                    client.close()
                    continue
                server.settimeout(None)
                with self._lock:
                    self.connections += 1
                    self._socks += [client, server]
                threading.Thread(target=self._copy, args=(server, client), daemon=True).start()
                threading.Thread(target=self._frames, args=(client, server), daemon=True).start()

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _exactly(sock: socket.socket, n: int) -> bytes:
        data = sock.recv(n, socket.MSG_WAITALL) if n else b""
        if len(data) < n:
            raise OSError("closed")
        return data

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError, struct.error):
            dst.sendall(self._exactly(src, auth._CHALLENGE.size))  # the dialer's challenge,
            dst.sendall(self._exactly(src, 32))                      # then its proof, untouched
            first_msg, held = b"", None
            while True:
                header = self._exactly(src, FRAME.size)
                length, kind = FRAME.unpack(header)
                payload = self._exactly(src, length)
                frame = header + payload + self._exactly(src, frames.TAG_BYTES)
                if kind == control.MSG and not first_msg:
                    first_msg = frame
                if held is not None:  # "swap": the frame after the held order goes first
                    dst.sendall(frame + held)
                    held = None
                    self._tampered()
                    continue
                if self.armed.is_set() and not self.done.is_set() and self.match(kind, payload):
                    if self.mode == "swap":
                        held = frame
                        continue
                    frame = {"alter": lambda: self._altered(kind, payload, frame), "replay": lambda: frame + frame,
                             "inject": lambda: first_msg + frame, "drop": lambda: b""}[self.mode]()
                    self._tampered()
                dst.sendall(frame)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def _altered(self, kind: int, payload: bytes, frame: bytes) -> bytes:
        body = self.alter(payload)
        assert body != payload, "the edit changed nothing"
        return FRAME.pack(len(body), kind) + body + frame[-frames.TAG_BYTES:]

    def _tampered(self) -> None:
        self.armed.clear()
        self.done.set()

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
