"""File descriptors between processes of one host: AF_UNIX, SCM_RIGHTS, named messages.

Shared GPU memory (a cuMem allocation) and shared host memory (a memfd) are both handed
to another process as a file descriptor. Taking it from the owner with pidfd_getfd needs
ptrace rights over the owner, which Yama (kernel.yama.ptrace_scope = 1, the usual default)
refuses between sibling processes such as SGLang's TP ranks; a descriptor *sent* by its
owner over a Unix socket needs no rights beyond connecting to it.

Sockets: SOCK_SEQPACKET (one send is one message, never split or merged) in the abstract
namespace (no file to clean up; the name goes with the process), named
``sglang-disagg-<purpose>-<random>``. An abstract name is visible to every process of the
network namespace (/proc/net/unix), so it is not a secret: both ends learn the other's
kernel-reported credentials (SO_PEERCRED) and the caller decides whom it deals with
(``Conn.cred``; ``Conn.expect_peer`` checks a pid and our uid).

Message: a JSON header ``{"v": 1, "kind": str, "nfds": int, "body": {...}}`` with ``nfds``
descriptors attached; ``kind`` names what the body means (e.g. "cumem-handover"), and a
body that lists descriptors describes them in order (ids, sizes, offsets). A message that
is truncated, of another version, or whose descriptor count differs from its header is
refused, and every descriptor it brought is closed: none leaks on any error path.

Stream mode (``Listener(stream=True)``, ``connect(stream=True)``): the same names and the
same credential checks over SOCK_STREAM, for a channel whose frames exceed MAX_MESSAGE (a DP
group's channel to its server's owner, ipc/stream.py). Descriptors never ride the stream:
a process that must hand descriptors to another (a GPU DP group's cuMem allocations, for its
owner to register) opens a SEQPACKET connection beside it and sends them as messages above,
MAX_FDS per message, as handover.py does for a TP rank's allocations.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

VERSION = 1
MAX_FDS = 200          # per message; the kernel's limit (SCM_MAX_FD) is 253
MAX_MESSAGE = 1 << 18  # header bytes


class FdPassError(RuntimeError):
    """A descriptor could not be passed: socket error, refused peer, malformed message."""


@dataclass(frozen=True, slots=True)
class Cred:
    """The process at the other end of a Unix socket, as the kernel reports it."""
    pid: int
    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class Message:
    kind: str
    body: dict[str, Any]
    fds: tuple[int, ...] = ()  # owned by the receiver: close (or keep) every one

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)


def peer_cred(sock: socket.socket) -> Cred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Cred(*struct.unpack("3i", raw))


class Conn:
    """One connected socket and the credentials of the process at its other end."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.cred = peer_cred(sock)

    def other_user(self) -> str:
        """Why the process at the other end is refused when only our own user may be there
        ("" when it is of our user: that user can read our memory anyway)."""
        if self.cred.uid != os.getuid():
            return f"process {self.cred.pid} runs as uid {self.cred.uid}, this one as uid {os.getuid()}"
        return ""

    def expect_peer(self, pid: int, what: str) -> None:
        """Refuse a peer that is not process `pid` of our own user."""
        if self.cred.uid != os.getuid() or self.cred.pid != pid:
            raise FdPassError(f"{what}: the process at the other end is pid {self.cred.pid} uid {self.cred.uid}, "
                              f"expected pid {pid} uid {os.getuid()} (another process holds that socket name, or "
                              "the two processes are in different pid namespaces)")

    def send(self, kind: str, body: dict[str, Any], fds: tuple[int, ...] | list[int] = ()) -> None:
        if len(fds) > MAX_FDS:
            raise FdPassError(f"{len(fds)} descriptors in one message; at most {MAX_FDS}")
        data = json.dumps({"v": VERSION, "kind": kind, "nfds": len(fds), "body": body},
                          separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE:
            raise FdPassError(f"message header of {len(data)} bytes; at most {MAX_MESSAGE}")
        try:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.sendall(data)
        except OSError as e:
            raise FdPassError(f"sending {kind!r}: {e}") from e

    def recv(self, timeout_s: float) -> Message:
        self.sock.settimeout(max(timeout_s, 0.001))
        try:
            data, fds, flags, _ = socket.recv_fds(self.sock, MAX_MESSAGE + 1, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        except TimeoutError:
            raise FdPassError(f"no message within {timeout_s:.1f} s") from None
        except OSError as e:
            raise FdPassError(f"receiving: {e}") from e
        try:
            return _parse(data, fds, flags)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse(data: bytes, fds: list[int], flags: int) -> Message:
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        raise FdPassError("message truncated (too large, or more descriptors than allowed)")
    if not data:
        raise FdPassError("the other end closed the connection")
    try:
        head = json.loads(data)
    except ValueError as e:
        raise FdPassError(f"message header is not JSON: {e}") from None
    if not isinstance(head, dict) or set(head) != {"v", "kind", "nfds", "body"}:
        raise FdPassError(f"message header must have fields v, kind, nfds, body; got {head!r:.200}")
    if head["v"] != VERSION:
        raise FdPassError(f"message version {head['v']!r}; this build speaks {VERSION}")
    if not isinstance(head["kind"], str) or not isinstance(head["body"], dict):
        raise FdPassError("message kind must be a string and body an object")
    if head["nfds"] != len(fds):
        raise FdPassError(f"message {head['kind']!r} announces {head['nfds']!r} descriptors, {len(fds)} arrived")
    return Message(head["kind"], head["body"], tuple(fds))


class Listener:
    """A listening abstract-namespace socket; `name` is what a peer passes to connect().

    By default the name is fresh (purpose, pid, 64 random bits) and the socket SEQPACKET (the
    messages above). `name` binds a name the caller derived (a DP server's owner socket, known
    to every group of the server) and `stream` a SOCK_STREAM socket for a byte stream (a
    group's channel, ipc/stream.py: frames larger than MAX_MESSAGE). A name another process
    holds raises FdPassError caused by the OSError (EADDRINUSE)."""

    def __init__(self, purpose: str, backlog: int = 64, name: str | None = None, stream: bool = False) -> None:
        self.name = name or f"sglang-disagg-{purpose}-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, _kind(stream) | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind("\0" + self.name)
            self._sock.listen(backlog)
        except OSError as e:
            self._sock.close()
            raise FdPassError(f"cannot listen on abstract socket {self.name}: {e}") from e

    def accept(self, timeout_s: float | None) -> Conn:
        """The next connection (None: block until close() or a connection)."""
        try:  # settimeout too: a listener closed before we got here raises EBADF
            self._sock.settimeout(None if timeout_s is None else max(timeout_s, 0.001))
            sock, _ = self._sock.accept()
        except TimeoutError:
            raise FdPassError(f"no connection to {self.name} within {timeout_s:.1f} s") from None
        except OSError as e:
            raise FdPassError(f"accepting on {self.name}: {e}") from e
        sock.setblocking(True)
        try:
            return Conn(sock)
        except OSError as e:  # the peer went between accept and SO_PEERCRED
            sock.close()
            raise FdPassError(f"accepting on {self.name}: {e}") from e

    def close(self) -> None:
        shut(self._sock)


def shut(sock: socket.socket) -> None:
    """Close `sock` so that a thread blocked on it wakes: shutdown first (a blocked accept()
    or recv() returns), since close alone does not wake it on Linux."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _kind(stream: bool) -> int:
    return socket.SOCK_STREAM if stream else socket.SOCK_SEQPACKET


def connect(name: str, timeout_s: float, stream: bool = False) -> Conn:
    """Connect to Listener `name`, retrying while it is not listening yet (until timeout).
    The caller checks who listens (``Conn.cred``) before sending anything: an abstract name
    has no permissions, another process may hold it."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, _kind(stream) | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect("\0" + name)
            sock.setblocking(True)
            return Conn(sock)
        except (ConnectionRefusedError, FileNotFoundError) as e:
            sock.close()
            if time.monotonic() >= deadline:
                raise FdPassError(f"nobody listens on abstract socket {name} (not on this host, or in another "
                                  f"network namespace): {e}") from None
            time.sleep(0.02)
        except OSError as e:
            sock.close()
            raise FdPassError(f"connecting to abstract socket {name}: {e}") from e
