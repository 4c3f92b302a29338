"""Versioned messages between a DP group's messenger and the server's owner (dpowner.py /
dpproxy.py), over a Unix stream socket: a 4-byte big-endian length, then one JSON object
with named fields plus ``"type"`` and ``"v"``, as wire.py does between servers.

One server runs one transfer backend, in the owner (the leader of DP group 0). Every other
group's leader reaches it through these messages:

    group -> owner  Join        first message: which group this is
    owner -> group  Joined      the backend's identity (name, provider, address, instance)
    group -> owner  Call        one backend operation (Op) with named arguments; `id` 0: no
                                reply wanted (retire, forget, writes and expectations, whose
                                completion comes as Done)
    owner -> group  Reply       the result of a Call, or its error (type name, message, cause)
    owner -> group  Done        a write batch or an expectation of the group completed
    owner -> group  Delivery    a peer's control message the owner gave to this group
    owner -> group  PeerState   a peer this group uses changed state (lost, closed)
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import reprlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar

from .. import untrusted
from ..backends import regions

GROUP_WIRE_VERSION = 1
MAX_FRAME = 64 << 20  # a Delivery carries a control message: the longest order (1 Mi tokens) fits


class GroupWireError(ValueError):
    """A group-channel message that is not what this build sends: the connection is dropped."""


class Op(enum.Enum):
    REGISTER = "register"        # a shared-memory range of the group: map it, register it
    CONNECT = "connect"          # a connection of the group's own (decode: one per prefill server)
    SEND = "send"                # a control message on one of the group's peers
    ADD_REMOTE = "add_remote"    # a peer's region descriptor
    WRITE_PAGES = "write_pages"  # a paged write from one of the group's regions
    EXPECT = "expect"            # count writes carrying a tag into the group's pages
    RETIRE = "retire"
    FORGET = "forget"
    IS_RETIRED = "is_retired"
    STATS = "stats"
    CLOSE_PEER = "close_peer"
    ORDER_DONE = "order_done"    # prefill: the group finished an order (its load for the dispatch)


@dataclass(frozen=True, slots=True)
class Message:
    TYPE: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Join(Message):
    TYPE: ClassVar[str] = "join"
    group: int


@dataclass(frozen=True, slots=True)
class Joined(Message):
    TYPE: ClassVar[str] = "joined"
    name: str
    provider: str
    address: str
    instance: str


@dataclass(frozen=True, slots=True)
class Call(Message):
    TYPE: ClassVar[str] = "call"
    id: int
    op: str
    args: dict


@dataclass(frozen=True, slots=True)
class Reply(Message):
    TYPE: ClassVar[str] = "reply"
    id: int
    result: Any
    error: str = ""
    error_type: str = ""  # the backends.errors class name ("" with no error)
    cause: str = ""       # the class name of the error's cause (ConnectionRefusedError: the port is closed)


@dataclass(frozen=True, slots=True)
class Done(Message):
    TYPE: ClassVar[str] = "done"
    future: int
    error: str = ""
    error_type: str = ""


@dataclass(frozen=True, slots=True)
class Delivery(Message):
    TYPE: ClassVar[str] = "delivery"
    peer: int
    instance: str
    address: str
    data: str


@dataclass(frozen=True, slots=True)
class PeerState(Message):
    TYPE: ClassVar[str] = "peer_state"
    peer: int
    state: str


MESSAGES = {c.TYPE: c for c in (Join, Joined, Call, Reply, Done, Delivery, PeerState)}


def encode(msg: Message) -> bytes:
    body = json.dumps({"type": msg.TYPE, "v": GROUP_WIRE_VERSION} | asdict(msg), separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body


def decode(raw: bytes) -> Message:
    """The message in `raw`: anything wrong with it (JSON, nesting, version, type, a field's
    name, type or value) raises GroupWireError."""
    try:
        obj = untrusted.loads(raw, MAX_FRAME)
    except untrusted.MalformedJSON as e:
        raise GroupWireError(f"unreadable message: {e}") from None
    if not isinstance(obj, dict) or obj.get("v") != GROUP_WIRE_VERSION:
        raise GroupWireError(f"group wire version {reprlib.repr(obj.get('v')) if isinstance(obj, dict) else '?'}, "
                             f"this build speaks {GROUP_WIRE_VERSION}")
    kind = obj.pop("type", None)
    obj.pop("v")
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise GroupWireError(f"unknown message type {reprlib.repr(kind)}")
    hints, required = _FIELDS[cls]
    if not set(obj) <= hints.keys() or not required <= set(obj):
        raise GroupWireError(f"{cls.TYPE}: fields {reprlib.repr(sorted(obj))}, expected {sorted(hints)}")
    for name, v in obj.items():
        if not _TYPES[hints[name]](v):
            raise GroupWireError(f"{cls.TYPE}.{name}: expected {hints[name]}, got {reprlib.repr(v)}")
        choices = _CHOICES.get((cls.TYPE, name))
        if choices is not None and v not in choices:
            raise GroupWireError(f"{cls.TYPE}.{name}: {reprlib.repr(v)} is not one of {sorted(choices)}")
    return cls(**obj)


# A field's type as written in its class (this module's annotations are strings) -> the check.
_TYPES: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: type(v) is int and 0 <= v < 1 << 63,
    "str": lambda v: isinstance(v, str),
    "dict": lambda v: isinstance(v, dict),
    "Any": lambda v: True,
}
# Fields whose value must be one of a few words (read back as an enum by the other end).
_CHOICES: dict[tuple[str, str], frozenset[str]] = {
    ("call", "op"): frozenset(o.value for o in Op),
    ("peer_state", "state"): frozenset(s.value for s in regions.PeerState),
}
# Each message's fields: name -> type as written, and the names without a default.
_FIELDS = {cls: ({f.name: f.type for f in fields(cls)}, {f.name for f in fields(cls) if f.default is MISSING})
           for cls in MESSAGES.values()}


class SendTimeout(TimeoutError):
    """The other end did not take a message within the channel's send timeout (stopped,
    or stuck): part of the frame may have gone, so the channel is of no further use."""


class Channel:
    """One end of a group's socket: framed sends from any thread, reads from one.

    With `send_timeout_s`, a send ends within that long of its call, the wait for another
    thread's send included: past it the send raises SendTimeout (an OSError) and every later
    send raises at once, the stream being cut mid-frame. The bound is per call, not per
    syscall (SO_SNDTIMEO is set to what is left before each one: a reader taking a byte now
    and then cannot stretch it). Reads stay blocking on their own thread."""

    def __init__(self, sock: socket.socket, send_timeout_s: float | None = None) -> None:
        self.sock = sock
        self.send_timeout_s = send_timeout_s
        self._send_lock = threading.Lock()
        self._broken = ""

    def send(self, msg: Message) -> None:
        data = encode(msg)
        if self.send_timeout_s is None:
            with self._send_lock:
                self.sock.sendall(data)
            return
        deadline = time.monotonic() + self.send_timeout_s
        if not self._send_lock.acquire(timeout=self.send_timeout_s):
            raise self._break(f"another send on the channel held it past {self.send_timeout_s:g} s")
        try:
            if self._broken:
                raise SendTimeout(self._broken)
            view = memoryview(data)
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._break(f"the other end took {len(data) - len(view)} of {len(data)} bytes "
                                      f"in {self.send_timeout_s:g} s")
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(left))
                try:
                    view = view[self.sock.send(view):]
                except BlockingIOError:  # SO_SNDTIMEO ran out with nothing taken
                    raise self._break(f"the other end took {len(data) - len(view)} of {len(data)} bytes "
                                      f"in {self.send_timeout_s:g} s") from None
        finally:
            self._send_lock.release()

    def _break(self, why: str) -> SendTimeout:
        self._broken = self._broken or f"a send timed out earlier: {why}"
        return SendTimeout(why)

    def read(self) -> Message:
        """The next message; EOFError when the other end closed or died."""
        (n,) = struct.unpack(">I", self._exactly(4))
        if n > MAX_FRAME:
            raise GroupWireError(f"frame of {n} bytes")
        return decode(self._exactly(n))

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the other end closed the group channel")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def socket_name(key: str, secret: bytes | None = None) -> str:
    """The abstract socket of a server's owner (nothing on disk: gone with the process).
    `key` names the server on its host (role and HTTP port). An abstract name has no
    permissions and anyone can bind one first, so with the deployment's secret the name is
    an HMAC of the key under it: a local user without the secret cannot tell the name in
    advance (a squatter stops the owner, "is taken", and could receive a group's calls), and
    every group of the server derives the same one. Without a secret (library use), the
    key itself (the caller says so in its log). Both ends check each other's user anyway
    (dpowner.admitted, dpproxy's connect)."""
    if secret is None:
        return f"\0sglang-disagg-dp/{key}"
    digest = hmac.new(secret, b"sglang-disagg dp owner socket v1|" + key.encode(), hashlib.sha256).hexdigest()
    return f"\0sglang-disagg-dp/{digest[:32]}"


def printable(name: str) -> str:
    """An abstract socket name as ss(8) and /proc/net/unix show it (@ for the NUL)."""
    return "@" + name[1:] if name.startswith("\0") else name


def _timeval(seconds: float) -> bytes:
    """SO_SNDTIMEO's struct timeval; never 0 (which means no timeout at all)."""
    us = max(1, int(seconds * 1e6))
    return struct.pack("ll", us // 1_000_000, us % 1_000_000)
