"""The transfer-backend contract, shaped for KV pages.

Usage (decode side receives, prefill side writes)::

    be = get_backend("libfabric")(BackendConfig(provider="tcp"))
    region, desc = be.register(addr, length)      # desc: bytes, send it to the writer
    peer = be.connect("127.0.0.1:40123")          # or accepted: be.wait_peer(timeout)
    remote = peer.add_remote_region(desc_from_peer)   # validated, bound to that peer
    fut = be.write(peer, [(region, src_off, remote, dst_off, length), ...], imm=tag)
    fut.wait(timeout)                             # local completion of the whole batch
    be.expect(tag, n, timeout_s, peer).wait()     # receiver: n writes tagged `tag` landed
    peer.send(b"..."); peer2, data = be.recv(timeout)
    be.close()

Guarantees:
- Every request is validated in Python (descriptor fields, ownership, bounds, imm range)
  before anything is posted; violations raise DescriptorError and post nothing.
- A batch's future completes once, after every write of it completed locally; it fails
  with TransferError (library text) or PeerLostError.
- expect() fires once when `count` writes with that immediate landed; it fails with
  DeadlineExceeded at the deadline and with PeerLostError when the peer is lost.
- Peer loss is noticed through the control channel within milliseconds (EOF), not only
  on the next write; all of the peer's batches and expectations then fail.
- close() fails whatever is pending, deregisters memory and joins every thread.
- No integer return code escapes: errors are the exceptions in errors.py.

- A batch not complete `batch_timeout_s` after posting fails with DeadlineExceeded and
  leaves the batch table (`_native_expire` lets the backend forget its native side).

A backend implements the `_native_*` hooks; the shared code here owns validation, batch
bookkeeping and deadlines and the expected-count tracker; peers.py owns the control
channel and the peers (through the callbacks given to its PeerTable), native_share.py which
connections share a peer instance's native state, notifications.py which notifications count.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, ClassVar

from .. import threads
from . import control
from .config import BackendConfig
from .errors import DeadlineExceeded, DescriptorError, PeerLostError, TransferError, UnsupportedMemory
from .expect import ExpectTracker
from .future import TransferFuture
from .native_share import NativeShares
from .notifications import NotifDrops, accept_notification
from .peers import Peer, PeerTable
from .regions import (DESCRIPTOR_VERSION, HOST, Memory, MemoryKind, MemoryRegion, NativeRegistration, PageWrite, PeerState,
                      RegionDescriptor, RemoteRegion)
from .validate import check_uniform, check_write

log = logging.getLogger("sglang_disagg.backends")

__all__ = ["BackendConfig", "MemoryRegion", "PageWrite", "Peer", "PeerState", "RegionDescriptor",
           "RemoteRegion", "TransferBackend", "TransferFuture"]


def host_only(backend: Any, memory: Memory) -> None:
    """For a backend (or a build of its library) that registers host memory only."""
    if memory.kind is not MemoryKind.HOST:
        raise UnsupportedMemory(f"{backend.name}: cannot register {memory}: this backend registers host memory only")


class TransferBackend(ABC):
    name: ClassVar[str] = "abstract"
    max_write_bytes: int = 1 << 40

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(usable here, why not): checked by `python -m sglang_disagg.backends`."""
        return True, ""

    def __init__(self, config: BackendConfig | None = None) -> None:
        self.config = config or BackendConfig()
        self._notif_drops = NotifDrops(self.name)
        self.instance = uuid.uuid4().hex
        self.provider = self._provider_label()
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[MemoryRegion, NativeRegistration]] = {}
        self._region_ids = itertools.count(1)
        self._batches: dict[int, tuple[Peer, TransferFuture]] = {}
        self._batch_ids = itertools.count(1)
        self._posted = [0, 0]  # writes, bytes posted since start (every backend: one "rail" unless it has rails)
        self._tracker = ExpectTracker(f"{self.name}-expect")
        # Lambdas, not bound methods: the hooks are looked up when they run, as a method would.
        self._shares = NativeShares(self.config, connect=lambda peer: self._native_connect(peer),
                                    disconnect=lambda peer: self._native_disconnect(peer),
                                    expire=lambda bid: self._native_expire(bid))
        self._table = PeerTable(self.config, self._lock, self.instance, hello=self._hello, check=self._check_hello,
                                add_remote=self.add_remote_region,
                                attach=self._shares.attach, detach=self._detach_peer, credit=self._tracker.add)
        self._closed = False
        try:
            # threads the library starts now (UCX's, Mooncake's, a provider's) are ours
            with threads.native_scope(f"{self.name}-lib"):
                self._native_open()
        except BaseException:
            self._tracker.close("open failed")
            raise
        try:
            self._server = control.ControlServer(self.config.host, self._table.on_accept, self.config.port,
                                                 self.config.max_connections)
        except BaseException:
            self._tracker.close("open failed")
            self._native_close()
            raise

    # ----- hooks for concrete backends -------------------------------------------------
    def _provider_label(self) -> str:
        return self.config.provider or ""

    @abstractmethod
    def _native_open(self) -> None: ...
    @abstractmethod
    def _endpoint_info(self) -> dict[str, Any]: ...
    @abstractmethod
    def _native_connect(self, peer: Peer) -> None: ...
    @abstractmethod
    def _native_disconnect(self, peer: Peer) -> None: ...
    @abstractmethod
    def _native_register(self, addr: int, length: int, memory: Memory) -> NativeRegistration:
        """Register [addr, addr+length) of `memory`'s kind; raise UnsupportedMemory for a kind
        this backend cannot register (never fall back to treating device memory as host)."""
    @abstractmethod
    def _native_deregister(self, reg: NativeRegistration) -> None: ...
    @abstractmethod
    def _native_post(self, peer: Peer, batch_id: int, writes: Sequence[PageWrite], imm: int) -> None: ...
    @abstractmethod
    def _native_close(self) -> None: ...

    def _kick(self) -> None:
        """A write was posted or an expectation set: a backend whose progress thread sleeps
        while nothing can arrive (idle.IdleGate) wakes it here."""

    def _native_stats(self) -> dict[str, int]:
        return {}

    def _native_expire(self, batch_id: int) -> None:
        """Forget the native side of a batch that passed its deadline (its completion may still come)."""

    # ----- peers -----------------------------------------------------------------------
    def connect(self, address: str, timeout_s: float | None = None) -> Peer:
        """Authenticate to the backend listening at `address` and exchange HELLOs."""
        self._check_open()
        return self._table.connect(address, timeout_s if timeout_s is not None else self.config.connect_timeout_s)

    def wait_peer(self, timeout_s: float) -> Peer:
        """Next peer that connected to us."""
        return self._table.wait_peer(timeout_s)

    def peers(self) -> list[Peer]:
        return self._table.all()

    def _lose_peer(self, peer: Peer, reason: str) -> None:
        """For backends whose native layer noticed the peer is gone (or misbehaves)."""
        self._table.drop(peer, PeerState.LOST, reason)

    def _hello(self) -> dict[str, Any]:
        return {"v": DESCRIPTOR_VERSION, "backend": self.name, "provider": self.provider,
                "instance": self.instance, "address": self.address, "endpoint": self._endpoint_info()}

    def _check_hello(self, hello: dict[str, Any]) -> None:
        if (hello["v"], hello["backend"], hello["provider"]) != (DESCRIPTOR_VERSION, self.name, self.provider):
            raise TransferError(f"peer runs {hello['backend']}/{hello['provider']} v{hello['v']}, "
                                f"we run {self.name}/{self.provider} v{DESCRIPTOR_VERSION}")

    def _detach_peer(self, peer: Peer, state: PeerState, reason: str) -> None:
        """The peer is gone (its state already says so): fail its batches and expectations.
        The instance's native state goes with this connection unless a fresh connection to
        the same instance still uses it (native_share.py)."""
        with self._lock:
            # By connection, not instance id: two connections to one peer instance (each
            # side dialed the other) fail independently.
            failed = [(bid, fut) for bid, (p, fut) in self._batches.items() if p is peer]
            for bid, _ in failed:
                del self._batches[bid]
        try:
            self._shares.detach(peer, [bid for bid, _ in failed])
        finally:
            err = PeerLostError(f"peer {peer.address} ({peer.id[:8]}) {state.value}: {reason}")
            for _, fut in failed:
                fut.set_exception(err)
            self._tracker.peer_lost(peer.id, reason)

    # ----- memory ----------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Where peers connect (host:port of the control channel)."""
        return self._server.address

    def register(self, addr: int, length: int, memory: Memory = HOST) -> tuple[MemoryRegion, bytes]:
        """Register local memory for peers to write into (and for our writes to read from);
        `memory` says whether it is host or CUDA device memory, and which device."""
        self._check_open()
        if not isinstance(addr, int) or not isinstance(length, int) or addr <= 0 or length <= 0:
            raise DescriptorError(f"register: need addr > 0 and length > 0, got addr={addr!r} length={length!r}")
        if not isinstance(memory, Memory):
            raise DescriptorError(f"register: memory must be a Memory, got {memory!r}")
        reg = self._native_register(addr, length, memory)
        region = MemoryRegion(next(self._region_ids), addr, length, self.instance, memory)
        with self._lock:
            self._regions[region.id] = (region, reg)
        return region, self.descriptor(region)

    def descriptor(self, region: MemoryRegion) -> bytes:
        _, reg = self._regions[region.id]
        return RegionDescriptor(DESCRIPTOR_VERSION, self.name, self.provider, self.instance, region.id,
                                region.length, reg.base, reg.key, dict(reg.extra)).to_bytes()

    def deregister(self, region: MemoryRegion) -> None:
        with self._lock:
            entry = self._regions.pop(region.id, None)
        if entry is None:
            raise DescriptorError(f"region {region.id} is not registered here")
        self._native_deregister(entry[1])

    def add_remote_region(self, peer: Peer, raw: bytes | str) -> RemoteRegion:
        d = RegionDescriptor.from_bytes(raw)
        if (d.backend, d.provider) != (self.name, self.provider):
            raise DescriptorError(f"descriptor is for {d.backend}/{d.provider or '-'}, this backend is "
                                  f"{self.name}/{self.provider or '-'}")
        if d.owner != peer.id:
            raise DescriptorError(f"descriptor belongs to instance {d.owner}, not to peer {peer.id}")
        self._check_remote(peer, d)
        return RemoteRegion(peer.id, d)

    def _check_remote(self, peer: Peer, d: RegionDescriptor) -> None:
        """Backend-specific descriptor checks (e.g. required `extra` fields)."""

    # ----- data path -------------------------------------------------------------------
    def write(self, peer: Peer, writes: Iterable[PageWrite | tuple], imm: int) -> TransferFuture:
        """Post a batch of writes, each carrying immediate `imm`; the future completes when all did."""
        self._check_submit(peer, imm)
        checked = [check_write(self._regions, peer.id, self.max_write_bytes, w, i) for i, w in enumerate(writes)]
        return self._submit(peer, len(checked), lambda bid: self._native_post(peer, bid, checked, imm),
                            sum(w.length for w in checked))

    def write_uniform(self, peer: Peer, src: MemoryRegion, src_offsets: Sequence[int], dst: RemoteRegion,
                      dst_offsets: Sequence[int], length: int, imm: int) -> TransferFuture:
        """Fast form for one region pair and equal lengths (a layer's KV pages): write i copies
        `length` bytes from src+src_offsets[i] to dst+dst_offsets[i]. Bounds are checked on
        the whole lists at once, so Python costs far less per write than in write()."""
        self._check_submit(peer, imm)
        check_uniform(self._regions, peer.id, self.max_write_bytes, src, src_offsets, dst, dst_offsets, length)
        return self._submit(peer, len(src_offsets), lambda bid: self._native_post_uniform(
            peer, bid, src, src_offsets, dst, dst_offsets, length, imm), len(src_offsets) * length)

    def write_pages(self, peer: Peer, src: MemoryRegion, src_pages: Sequence[int], src_stride: int,
                    dst: RemoteRegion, dst_pages: Sequence[int], dst_stride: int, length: int, imm: int,
                    src_offset: int = 0, dst_offset: int = 0) -> TransferFuture:
        """Paged form: page i goes from src_pages[i]*src_stride+src_offset to the same in dst."""
        if len(src_pages) != len(dst_pages):
            raise DescriptorError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
        return self.write_uniform(peer, src, [p * src_stride + src_offset for p in src_pages], dst,
                                  [p * dst_stride + dst_offset for p in dst_pages], length, imm)

    def _native_post_uniform(self, peer: Peer, batch_id: int, src: MemoryRegion, src_offsets: Sequence[int],
                             dst: RemoteRegion, dst_offsets: Sequence[int], length: int, imm: int) -> None:
        """Backends may override with a cheaper path; this one reuses _native_post."""
        self._native_post(peer, batch_id, [PageWrite(src, s, dst, d, length)
                                           for s, d in zip(src_offsets, dst_offsets)], imm)

    def _check_submit(self, peer: Peer, imm: int) -> None:
        self._check_open()
        if peer.state is not PeerState.CONNECTED:
            raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
        if isinstance(imm, bool) or not isinstance(imm, int) or not 0 <= imm < 2**32:
            raise DescriptorError(f"immediate {imm!r} is not a 32-bit unsigned integer")

    def _submit(self, peer: Peer, n: int, post: Callable[[int], None], nbytes: int) -> TransferFuture:
        fut = TransferFuture(f"{self.name} batch to {peer.address}")
        if n == 0:
            fut.set_result(0)
            return fut
        batch_id = next(self._batch_ids)
        with self._lock:  # same lock as _drop_peer: either we see the loss or it sees us
            if peer.state is not PeerState.CONNECTED:
                raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
            self._batches[batch_id] = (peer, fut)
        try:
            post(batch_id)
        except BaseException:
            with self._lock:
                self._batches.pop(batch_id, None)
            raise
        with self._lock:
            self._posted[0] += n
            self._posted[1] += nbytes
        self._kick()
        if not fut.done():  # its own deadline, on the tracker's timer thread
            key = ("batch", batch_id)
            self._tracker.watch(key, time.monotonic() + self.config.batch_timeout_s, lambda: self._expire(batch_id))
            fut.add_done_callback(lambda _f: self._tracker.unwatch(key))
        return fut

    def _expire(self, batch_id: int) -> None:
        with self._lock:
            entry = self._batches.pop(batch_id, None)
        if entry is None:
            return
        try:
            self._native_expire(batch_id)
        finally:
            entry[1].set_exception(DeadlineExceeded(f"{entry[1].label or 'batch'}: not complete "
                                                    f"{self.config.batch_timeout_s} s after posting"))

    def _complete_batch(self, batch_id: int, error: str | None = None, lost: bool = False) -> None:
        """Called by backends' progress code; unknown ids (already failed) are ignored."""
        with self._lock:
            entry = self._batches.pop(batch_id, None)
        if entry is None:
            return
        if error is None:
            entry[1].set_result(None)
        else:
            entry[1].set_exception((PeerLostError if lost else TransferError)(error))

    def expect(self, tag: int, count: int, timeout_s: float,
               peer: Peer | Collection[str] | None = None) -> TransferFuture:
        """`peer`: the Peer, or the instance ids of the peers, whose loss fails this
        expectation (None: any peer's). Ids of peers not connected yet are allowed:
        a writer may connect after the expectation is set."""
        self._check_open()
        if isinstance(peer, Peer):
            if peer.state is not PeerState.CONNECTED:
                fut = TransferFuture()
                fut.set_exception(PeerLostError(f"peer {peer.address} is {peer.state.value}"))
                return fut
            peer = peer.id
        fut = self._tracker.expect(tag, count, timeout_s, peer)
        self._kick()
        return fut

    def forget(self, tag: int) -> None:
        self._tracker.forget(tag)

    def retire(self, tag: int, reason: str = "cancelled") -> None:
        """Stop counting `tag`: its pending expectation fails, late writes are discarded."""
        self._tracker.retire(tag, reason)

    def is_retired(self, tag: int) -> bool:
        return self._tracker.is_retired(tag)

    def landed(self, tag: int) -> int:
        return self._tracker.landed(tag)

    # ----- messages, stats, close ------------------------------------------------------
    def recv(self, timeout_s: float) -> tuple[Peer, bytes]:
        return self._table.recv(timeout_s)

    def _on_notification(self, msg: object) -> bool:
        """One batch notification as NIXL or Mooncake delivered it (their stand-in for immediate
        data): credited if notifications.accept_notification takes it, else dropped and counted,
        no peer failed or blamed (anyone can send one). True when something was credited."""
        got = accept_notification(msg, self._table.live, self._notif_drops)
        if got is None:
            return False
        self._tracker.add(got.tag, got.count, source=got.sender)  # the MAC proved who sent it
        return True

    def stats(self) -> dict[str, int]:
        peers = len(self._table.all())
        with self._lock:
            base = {"peers": peers, "batches": len(self._batches), "regions": len(self._regions),
                    # what a connection flood cost the control port (control_server.ControlServer)
                    "connections_evicted": self._server.evicted, "connections_refused": self._server.refused,
                    "writes_posted": self._posted[0], "bytes_posted": self._posted[1]}
        return base | self._tracker.counters() | self._notif_drops.stats() | self._native_stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._table.close()
        self._server.close()
        for peer in self.peers():
            peer.close()
        with self._lock:
            batches, self._batches = list(self._batches.values()), {}
            regions, self._regions = list(self._regions.values()), {}
        for _, fut in batches:
            fut.set_exception(TransferError("backend closed"))
        self._tracker.close("backend closed")
        try:
            for _, reg in regions:
                self._native_deregister(reg)
        finally:
            self._native_close()

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name} backend is closed")
