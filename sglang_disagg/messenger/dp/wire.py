"""Versioned messages between a DP group's messenger and its server's owner, one typed message
per operation, over the framed stream of ipc/stream.py.

One server runs one transfer backend, in the owner (the leader of DP group 0). Every other
group's leader reaches it through these messages, decoded by the same strict codec as the
messages between servers (fields.py): exact fields, every type and bound checked.

    group -> owner  Join                  first message: which group this is
    owner -> group  Joined                the backend's identity (name, provider, address, instance)
    group -> owner  Register, Connect,    calls with an answer: `id` pairs the answer (Registered,
                    AddRemote, IsRetired, Connected, Added, Answer, Counters) or Failed (the error's
                    Landed, Stats         backends.errors class and message, and its cause)
    group -> owner  WritePages, Expect    their completion comes as Done(`future`)
    group -> owner  Send, Retire, Forget, no answer (a failure is logged at the owner)
                    ClosePeer, OrderDone
    owner -> group  Delivery              a peer's control message the owner gave to this group
    owner -> group  PeerState             a peer this group uses changed state (lost, closed)

A frame (ipc/stream.py) is the header's length (4 bytes, big-endian), the JSON header, then
the message's payload: the raw bytes of a control message (Send, Delivery), which cross as
they are, decoded once by the messenger that takes them, never as a string inside JSON.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import ClassVar

from ...backends.regions import PeerState as State
from ...ipc import stream
from ..fields import Codec
from ..wire import MAX_MESSAGE_BYTES, MAX_PAGES

GROUP_WIRE_VERSION = 3  # 2: one message per operation, payload beside the header; 3: Landed
MAX_FRAME = 64 << 20    # a Delivery carries a control message: the longest order (1 Mi tokens) fits
HEADER = struct.Struct(">I")


class GroupWireError(ValueError):
    """A group-channel message that is not what this build sends: the connection is dropped."""


@dataclass(frozen=True, slots=True)
class Message:
    TYPE: ClassVar[str] = ""


def _message(cls: type) -> type:
    return dataclass(frozen=True, slots=True)(cls)


# ----- group -> owner ----------------------------------------------------------------------------
@_message
class Join(Message):
    TYPE: ClassVar[str] = "join"
    group: int


@_message
class Register(Message):  # a shared-memory range of the group: map it, register it
    TYPE: ClassVar[str] = "register"
    id: int
    path: str
    offset: int
    inode: int
    dev: int
    target: str
    length: int


@_message
class Connect(Message):  # a connection of the group's own (decode: one per prefill server)
    TYPE: ClassVar[str] = "connect"
    id: int
    address: str
    timeout_s: float | None


@_message
class Send(Message):  # a control message on one of the group's peers
    TYPE: ClassVar[str] = "send"
    peer: int
    data: bytes


@_message
class AddRemote(Message):  # a peer's region descriptor
    TYPE: ClassVar[str] = "add_remote"
    id: int
    peer: int
    descriptor: str


@_message
class WritePages(Message):  # a paged write from one of the group's regions
    TYPE: ClassVar[str] = "write_pages"
    future: int
    peer: int
    src: int
    src_pages: tuple[int, ...]
    src_stride: int
    dst: int
    dst_pages: tuple[int, ...]
    dst_stride: int
    length: int
    imm: int
    src_offset: int
    dst_offset: int


@_message
class Expect(Message):  # count writes carrying `tag` into the group's pages
    TYPE: ClassVar[str] = "expect"
    future: int
    tag: int
    count: int
    timeout_s: float
    peers: tuple[str, ...] | None


@_message
class Retire(Message):
    TYPE: ClassVar[str] = "retire"
    tag: int
    reason: str


@_message
class Forget(Message):
    TYPE: ClassVar[str] = "forget"
    tag: int


@_message
class IsRetired(Message):
    TYPE: ClassVar[str] = "is_retired"
    id: int
    tag: int


@_message
class Landed(Message):
    TYPE: ClassVar[str] = "landed"
    id: int
    tag: int


@_message
class Stats(Message):
    TYPE: ClassVar[str] = "stats"
    id: int


@_message
class ClosePeer(Message):
    TYPE: ClassVar[str] = "close_peer"
    peer: int


@_message
class OrderDone(Message):  # prefill: the group finished an order (its load, for the dispatch)
    TYPE: ClassVar[str] = "order_done"
    instance: str  # the decoder's backend instance: with its tag, the order (tags are unique per instance)
    tag: int


# ----- owner -> group ----------------------------------------------------------------------------
@_message
class Joined(Message):
    TYPE: ClassVar[str] = "joined"
    name: str
    provider: str
    address: str
    instance: str


@_message
class Registered(Message):
    TYPE: ClassVar[str] = "registered"
    id: int
    region: int
    descriptor: str


@_message
class Connected(Message):
    TYPE: ClassVar[str] = "connected"
    id: int
    peer: int
    instance: str
    address: str


@_message
class Added(Message):
    TYPE: ClassVar[str] = "added"
    id: int
    remote: int


@_message
class Answer(Message):
    TYPE: ClassVar[str] = "answer"
    id: int
    yes: bool


@_message
class Counters(Message):
    TYPE: ClassVar[str] = "counters"
    id: int
    counters: dict[str, int]


@_message
class Failed(Message):  # a call with an answer failed
    TYPE: ClassVar[str] = "failed"
    id: int
    error: str
    error_type: str  # the backends.errors class name
    cause: str = ""  # the class name of the error's cause (ConnectionRefusedError: the port is closed)


@_message
class Done(Message):
    TYPE: ClassVar[str] = "done"
    future: int
    error: str = ""
    error_type: str = ""


@_message
class Delivery(Message):
    TYPE: ClassVar[str] = "delivery"
    peer: int
    instance: str
    address: str
    data: bytes


@_message
class PeerState(Message):
    TYPE: ClassVar[str] = "peer_state"
    peer: int
    state: State


CALLS = (Join, Register, Connect, Send, AddRemote, WritePages, Expect, Retire, Forget, IsRetired, Landed, Stats,
         ClosePeer, OrderDone)
ANSWERS = (Joined, Registered, Connected, Added, Answer, Counters, Failed, Done, Delivery, PeerState)
MESSAGES = {c.TYPE: c for c in CALLS + ANSWERS}
_MOST = {"WritePages.src_pages": MAX_PAGES, "WritePages.dst_pages": MAX_PAGES, "Registered.descriptor": MAX_FRAME,
         "AddRemote.descriptor": MAX_FRAME, "Expect.peers": 1 << 16, "Counters.counters": 1 << 10}
CODEC = Codec("group wire", GROUP_WIRE_VERSION, MESSAGES, GroupWireError, MAX_FRAME, _MOST)
assert MAX_MESSAGE_BYTES < MAX_FRAME  # a control message fits a Delivery


def parts(msg: Message) -> tuple[bytes, bytes, bytes]:
    """`msg` as the parts of one frame: header length, header, payload."""
    header, payload = CODEC.encode_parts(msg)
    return HEADER.pack(len(header)), header, payload


def encode(msg: Message) -> bytes:
    return b"".join(parts(msg))


def decode(frame: bytes) -> Message:
    """The message in one frame: anything wrong with it (its layout, JSON, nesting, version,
    type, a field's name, type, bound or value) raises GroupWireError."""
    if len(frame) < HEADER.size:
        raise GroupWireError(f"a frame of {len(frame)} bytes has no header")
    (n,) = HEADER.unpack_from(frame)
    if n > len(frame) - HEADER.size:
        raise GroupWireError(f"a header of {n} bytes in a frame of {len(frame)}")
    return CODEC.decode_parts(frame[HEADER.size:HEADER.size + n], frame[HEADER.size + n:])


class Channel(stream.Channel):
    """A group's channel: messages of this module over ipc/stream.py's framed stream."""

    def __init__(self, sock, send_timeout_s: float | None = None) -> None:
        super().__init__(sock, send_timeout_s, "the DP group channel")

    def send(self, msg: Message) -> None:  # type: ignore[override]
        super().send(*parts(msg))

    def read(self) -> Message:  # type: ignore[override]
        """The next message; EOFError when the other end closed or died."""
        try:
            return decode(super().read(MAX_FRAME))
        except stream.FrameTooLarge as e:
            raise GroupWireError(str(e)) from None


def socket_name(key: str, secret: bytes | None = None) -> str:
    """The abstract socket of a server's owner (nothing on disk: gone with the process).
    `key` names the server on its host (role and HTTP port). An abstract name has no
    permissions and anyone can bind one first, so with the deployment's secret the name is
    an HMAC of the key under it: a local user without the secret cannot tell the name in
    advance (a squatter stops the owner, "is taken", and could receive a group's calls), and
    every group of the server derives the same one. Without a secret (library use), the
    key itself. Both ends check each other's user anyway (owner.py, proxy.py)."""
    if secret is None:
        return f"sglang-disagg-dp/{key}"
    digest = hmac.new(secret, b"sglang-disagg dp owner socket v1|" + key.encode(), hashlib.sha256).hexdigest()
    return f"sglang-disagg-dp/{digest[:32]}"
