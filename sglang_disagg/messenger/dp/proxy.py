"""The transfer backend as a DP group other than the owner's sees it: the server's one
backend, in the owner process (owner.py), reached over the group's channel (wire.py).

A group's messenger (prefill.py / decode.py, unchanged) calls what it calls on a real
backend: register, connect, recv, write_pages, expect, retire, is_retired, stats, close, and
on peers send, add_remote_region, close, state. Each becomes its message of wire.py. Writes and
expectations return a TransferFuture at once, completed by the owner's Done; peers' control
messages the owner gives this group arrive as Delivery and are read by recv(). Errors keep
their backends.errors class (and a refused connection its cause), so the messenger tells a
lost peer from a refused one as it does with a real backend.

The owner gone (its process died, or it dropped this group for not taking its messages in
time, e.g. a stopped process that wakes up): every pending call and future fails with
PeerLostError, every peer is LOST and recv() raises, so the group's requests fail with the
reason at once and the server reports unhealthy (Node.health).

Before sending anything the group checks who listens on the owner's socket: a process of
another user (one that took the name first) is refused, naming its uid. Sends to the owner
are bounded by CALL_TIMEOUT_S; an owner that takes nothing for that long is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from typing import Any

from ...backends import errors
from ...backends.errors import DeadlineExceeded, PeerLostError, TransferError
from ...backends.future import TransferFuture
from ...backends.regions import HOST, MemoryKind, PeerState
from ...ipc import fdpass, shm
from ...threads import Thread as NamedThread
from . import wire as gw

logger = logging.getLogger("sglang_disagg.messenger")
CALL_TIMEOUT_S = 30.0  # an owner that answers nothing in this long is as good as gone


class ProxyPeer:
    """A peer connection of the owner's backend, as this group uses it."""

    def __init__(self, backend: ProxyBackend, pid: int, instance: str, address: str) -> None:
        self._backend, self.pid = backend, pid
        self.id, self.address = instance, address
        self.state = PeerState.CONNECTED

    def send(self, data: bytes) -> None:
        if self.state is not PeerState.CONNECTED:
            raise PeerLostError(f"peer {self.address} is {self.state.value}")
        self._backend.tell(gw.Send(self.pid, bytes(data)))

    def add_remote_region(self, descriptor: bytes | str) -> int:
        raw = descriptor.decode() if isinstance(descriptor, bytes) else descriptor
        return self._backend.ask(gw.AddRemote, gw.Added, peer=self.pid, descriptor=raw).remote

    def close(self) -> None:
        self.state = PeerState.CLOSED
        self._backend.tell(gw.ClosePeer(self.pid))

    def __repr__(self) -> str:
        return f"ProxyPeer({self.address}, {self.id[:8]}, {self.state.value})"


class ProxyBackend:
    def __init__(self, name: str, group: int, deadline_s: float) -> None:
        self.group = group
        self._chan = gw.Channel(_connect(name, deadline_s).sock, CALL_TIMEOUT_S)
        self._chan.send(gw.Join(group))
        joined = self._chan.read()
        if not isinstance(joined, gw.Joined):
            raise TransferError(f"DP group {group}: the owner answered {type(joined).__name__}, not Joined")
        self.name, self.provider, self.address, self.instance = (joined.name, joined.provider, joined.address,
                                                                 joined.instance)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[threading.Event, list]] = {}
        self._futures: dict[int, TransferFuture] = {}
        self._peers: dict[int, ProxyPeer] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._closed = ""
        self._stats: dict[str, int] = {"late_writes_dropped": 0}
        self._reader = NamedThread(target=self._read, name=f"dp-proxy-{group}", daemon=True)
        self._reader.start()

    # ----- what the messenger calls ------------------------------------------------------
    def register(self, addr: int, length: int, memory: Any = HOST) -> tuple[int, bytes]:
        if memory.kind is not MemoryKind.HOST:
            raise errors.UnsupportedMemory("a DP group hands its KV to the owner as shared host memory; "
                                           f"{memory} is not (data parallelism is verified on CPU only)")
        b = shm.locate(addr, length)
        got = self.ask(gw.Register, gw.Registered, path=b.path, offset=b.offset, inode=b.inode, dev=b.dev,
                       target=b.target, length=length)
        return got.region, got.descriptor.encode()

    def connect(self, address: str, timeout_s: float | None = None) -> ProxyPeer:
        got = self.ask(gw.Connect, gw.Connected, timeout=(timeout_s or 5.0) + CALL_TIMEOUT_S, address=address,
                       timeout_s=timeout_s)
        return self._peer(got.peer, got.instance, got.address)

    def recv(self, timeout_s: float) -> tuple[ProxyPeer, bytes]:
        if self._closed:
            raise TransferError(self._closed)
        try:
            item = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise DeadlineExceeded(f"no control message within {timeout_s} s") from None
        if item is None:
            raise TransferError(self._closed)
        return item

    def write_pages(self, peer: ProxyPeer, src: Any, src_pages: Any, src_stride: int, dst: Any, dst_pages: Any,
                    dst_stride: int, length: int, imm: int, src_offset: int = 0, dst_offset: int = 0) -> TransferFuture:
        if peer.state is not PeerState.CONNECTED:
            raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
        return self._future(f"write to {peer.address}", lambda fid: gw.WritePages(
            fid, peer.pid, src, tuple(src_pages), src_stride, dst, tuple(dst_pages), dst_stride, length, imm,
            src_offset, dst_offset))

    def expect(self, tag: int, count: int, timeout_s: float, peer: Any = None) -> TransferFuture:
        peers = None if peer is None else tuple(sorted(peer))
        return self._future(f"expectation {tag}", lambda fid: gw.Expect(fid, tag, count, float(timeout_s), peers))

    def retire(self, tag: int, reason: str = "cancelled") -> None:
        self.tell(gw.Retire(tag, reason))

    def forget(self, tag: int) -> None:
        self.tell(gw.Forget(tag))

    def is_retired(self, tag: int) -> bool:
        return self.ask(gw.IsRetired, gw.Answer, tag=tag).yes

    def landed(self, tag: int) -> int:
        return self.ask(gw.Landed, gw.Counters, tag=tag).counters["landed"]

    def stats(self) -> dict[str, int]:
        """The owner's backend counters (the last ones read, once the owner is gone)."""
        with contextlib.suppress(PeerLostError):
            self._stats = self.ask(gw.Stats, gw.Counters).counters
        return self._stats

    def close(self) -> None:
        self._fail_all("closed")
        self._chan.close()

    # ----- the channel ----------------------------------------------------------------------
    def tell(self, msg: gw.Message) -> None:
        """A message with no answer (a failure at the owner is logged there); nothing to do
        at an owner that is gone (the reader noticed, or will)."""
        if self._closed:
            return
        with contextlib.suppress(PeerLostError):
            self._send(msg)

    def ask(self, call: type, answer: type, timeout: float = CALL_TIMEOUT_S, **fields: Any) -> Any:
        """Send `call` (its `id` added) and wait for its `answer`; the owner's Failed raises
        the error its backend raised."""
        if self._closed:
            raise PeerLostError(self._closed)
        cid, slot = next(self._ids), []
        done = threading.Event()
        with self._lock:
            self._calls[cid] = (done, slot)
        self._send(call(id=cid, **fields))
        if not done.wait(timeout):
            with self._lock:
                self._calls.pop(cid, None)
            raise DeadlineExceeded(f"the server's messenger owner did not answer {call.TYPE} in {timeout:.0f} s")
        r = slot[0]
        if isinstance(r, BaseException):
            raise r
        if isinstance(r, gw.Failed):
            raise _error(r.error_type, r.error, r.cause)
        if not isinstance(r, answer):
            raise TransferError(f"the server's messenger owner answered {call.TYPE} with {r.TYPE}, not {answer.TYPE}")
        return r

    def _future(self, label: str, make: Any) -> TransferFuture:
        fut, fid = TransferFuture(label), next(self._ids)
        with self._lock:
            if self._closed:
                fut.set_exception(PeerLostError(self._closed))
                return fut
            self._futures[fid] = fut
        self._send(make(fid))
        return fut

    def _send(self, msg: gw.Message) -> None:
        try:
            self._chan.send(msg)
        except gw.stream.SendTimeout as e:  # the stream is cut mid-frame: nothing more can go or come
            why = f"the server's messenger owner (DP group 0) took nothing for {CALL_TIMEOUT_S:.0f} s: {e}"
            self._fail_all(why)
            self._chan.close()
            raise PeerLostError(why) from e
        except OSError as e:
            why = f"the server's messenger owner (DP group 0) is gone: {e}"
            self._fail_all(why)  # now, not when the reader notices: `gone` must say it to the step
            raise PeerLostError(why) from e

    def _peer(self, pid: int, instance: str, address: str) -> ProxyPeer:
        with self._lock:
            peer = self._peers.get(pid)
            if peer is None:
                peer = self._peers[pid] = ProxyPeer(self, pid, instance, address)
            return peer

    def _read(self) -> None:
        while True:
            try:
                self._take(self._chan.read())
            except (EOFError, OSError, gw.GroupWireError) as e:
                self._fail_all(f"the server's messenger owner (DP group 0) is gone: {e}")
                return
            except Exception as e:  # noqa: BLE001 - never a silent death: the group fails what it holds
                logger.exception("messenger: DP group %d: a message from the owner failed", self.group)
                self._fail_all(f"the server's messenger owner (DP group 0) sent what this group cannot take: "
                               f"{type(e).__name__}: {e}")
                self._chan.close()
                return

    def _take(self, msg: gw.Message) -> None:
        if isinstance(msg, (gw.Registered, gw.Connected, gw.Added, gw.Answer, gw.Counters, gw.Failed)):
            with self._lock:
                waiting = self._calls.pop(msg.id, None)
            if waiting is not None:
                waiting[1].append(msg)
                waiting[0].set()
        elif isinstance(msg, gw.Done):
            with self._lock:
                fut = self._futures.pop(msg.future, None)
            if fut is not None:
                if msg.error:
                    fut.set_exception(_error(msg.error_type, msg.error))
                else:
                    fut.set_result(None)
        elif isinstance(msg, gw.Delivery):
            self._inbox.put((self._peer(msg.peer, msg.instance, msg.address), msg.data))
        elif isinstance(msg, gw.PeerState):
            peer = self._peers.get(msg.peer)
            if peer is not None:
                peer.state = msg.state
        else:
            raise gw.GroupWireError(f"{msg.TYPE} is not a message the owner sends")

    def _fail_all(self, why: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = why
            calls, self._calls = self._calls, {}
            futures, self._futures = self._futures, {}
            peers = list(self._peers.values())
        for peer in peers:
            if peer.state is PeerState.CONNECTED:
                peer.state = PeerState.LOST
        for done, slot in calls.values():
            slot.append(PeerLostError(why))
            done.set()
        for fut in futures.values():
            fut.set_exception(PeerLostError(why))
        self._inbox.put(None)
        if why != "closed":
            logger.error("messenger: DP group %d: %s", self.group, why)

    @property
    def gone(self) -> str:
        """Why this group lost the server's backend ("" while the owner lives)."""
        return "" if self._closed == "closed" else self._closed


def _error(type_name: str, message: str, cause: str = "") -> TransferError:
    cls = getattr(errors, type_name, TransferError)
    if not (isinstance(cls, type) and issubclass(cls, TransferError)):
        cls = TransferError
    err = cls(message)
    if cause == "ConnectionRefusedError":  # Links: a lost server whose port refuses is GONE
        err.__cause__ = ConnectionRefusedError(message)
    return err


def _connect(name: str, deadline_s: float) -> fdpass.Conn:
    """The owner starts in another process at the same time: retry until it listens. The
    listener must be of our own user (an abstract name has no permissions: another user
    may have bound it first, to take the calls, prompts included): refused otherwise, before
    a byte is sent."""
    try:
        conn = fdpass.connect(name, deadline_s, stream=True)
    except fdpass.FdPassError as e:
        raise TransferError(f"no messenger owner (DP group 0) listening after {deadline_s:.0f} s: {e}") from e
    refused = conn.other_user()
    if refused:
        conn.close()
        raise TransferError(f"refused the DP owner socket @{name}: its listener is another user's ({refused}; "
                            "another user took the name; nothing was sent)")
    return conn
