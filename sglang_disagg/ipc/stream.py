"""A framed byte stream between two of our processes on one host, with a bounded send.

Frames: a 4-byte big-endian length, then that many bytes (what they mean is the caller's:
dp/wire.py). The socket comes from fdpass (``Listener(stream=True)`` / ``connect(stream=True)``),
which also says who is at the other end. A channel is written from any thread and read
from one.

With `send_timeout_s`, a send ends within that long of its call, the wait for another
thread's send included: past it the send raises SendTimeout (an OSError) and every later
send raises at once, the stream being cut mid-frame. The bound is per call, not per syscall
(SO_SNDTIMEO is set to what is left before each one: a reader taking a byte now and then
cannot stretch it). Reads stay blocking on their own thread.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from . import fdpass

LENGTH = struct.Struct(">I")


class FrameTooLarge(ValueError):
    """A frame announced longer than the reader takes: the stream is of no further use."""


class SendTimeout(TimeoutError):
    """The other end did not take a frame within the channel's send timeout (stopped, or
    stuck): part of the frame may have gone, so the channel is of no further use."""


def recv_exactly(sock: socket.socket, n: int, what: str = "the stream", deadline: float | None = None) -> bytes:
    """`n` bytes from `sock`; EOFError when the other end closes first. With `deadline` (a
    time.monotonic() instant), socket.timeout once it passed, however slowly the bytes trickle
    in: one deadline for the whole read, not a timeout per recv (the one reader of exact byte
    counts: this stream, the control connections' frames and the authentication handshake)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:  # settimeout(0) would make the socket non-blocking, not expire it
                raise socket.timeout
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"the other end closed {what}")
        buf += chunk
    return bytes(buf)


class Channel:
    """One end of a framed stream: `send` from any thread, `read` from one."""

    def __init__(self, sock: socket.socket, send_timeout_s: float | None = None, name: str = "the channel") -> None:
        self.sock, self.send_timeout_s, self.name = sock, send_timeout_s, name
        self._send_lock = threading.Lock()
        self._broken = ""

    def send(self, *parts: bytes) -> None:
        """One frame made of `parts` (written as one: nothing of another send in between)."""
        data = LENGTH.pack(sum(len(p) for p in parts)) + b"".join(parts)
        if self.send_timeout_s is None:
            with self._send_lock:
                self.sock.sendall(data)
            return
        deadline = time.monotonic() + self.send_timeout_s
        if not self._send_lock.acquire(timeout=self.send_timeout_s):
            raise self._break(f"another send on {self.name} held it past {self.send_timeout_s:g} s")
        try:
            if self._broken:
                raise SendTimeout(self._broken)
            view = memoryview(data)
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._break(self._took(data, view))
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(left))
                try:
                    view = view[self.sock.send(view):]
                except BlockingIOError:  # SO_SNDTIMEO ran out with nothing taken
                    raise self._break(self._took(data, view)) from None
        finally:
            self._send_lock.release()

    def _took(self, data: bytes, view: memoryview) -> str:
        return f"the other end took {len(data) - len(view)} of {len(data)} bytes in {self.send_timeout_s:g} s"

    def _break(self, why: str) -> SendTimeout:
        self._broken = self._broken or f"a send timed out earlier: {why}"
        return SendTimeout(why)

    def read(self, max_frame: int) -> bytes:
        """The next frame; EOFError when the other end closed or died, FrameTooLarge past
        `max_frame` (nothing of it read: the stream cannot go on)."""
        (n,) = LENGTH.unpack(recv_exactly(self.sock, LENGTH.size, self.name))
        if n > max_frame:
            raise FrameTooLarge(f"a frame of {n} bytes on {self.name}; at most {max_frame}")
        return recv_exactly(self.sock, n, self.name)

    def close(self) -> None:
        fdpass.shut(self.sock)  # wakes the thread blocked reading it


def read_deadline(sock: socket.socket, seconds: float | None) -> None:
    """Reads of `sock` fail (BlockingIOError) after `seconds` without a byte; None: they wait.
    A kernel option (SO_RCVTIMEO), so the socket stays blocking and sends keep their own."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", 0, 0) if seconds is None else _timeval(seconds))


def _timeval(seconds: float) -> bytes:
    """SO_SNDTIMEO's struct timeval; never 0 (which means no timeout at all)."""
    us = max(1, int(seconds * 1e6))
    return struct.pack("ll", us // 1_000_000, us % 1_000_000)
