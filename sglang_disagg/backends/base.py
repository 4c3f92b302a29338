"""The transfer-backend contract, shaped for KV pages.

Usage (decode side receives, prefill side writes)::

    be = get_backend("libfabric")(BackendConfig(provider="shm"))
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

A backend implements the `_native_*` hooks; the shared code here and in peers.py owns the control channel,
peers, validation, batch bookkeeping and the expected-count tracker.
"""

from __future__ import annotations

import itertools
import queue
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, ClassVar

from . import control
from .errors import DeadlineExceeded, DescriptorError, PeerLostError, TransferError
from .expect import ExpectTracker
from .future import TransferFuture
from .peer import Peer
from .peers import PeerManager
from .regions import (DESCRIPTOR_VERSION, BackendConfig, MemoryRegion, NativeRegistration, PageWrite,
                      PeerState, RegionDescriptor, RemoteRegion)
from .validate import check_uniform, check_write

__all__ = ["BackendConfig", "MemoryRegion", "PageWrite", "Peer", "PeerState", "RegionDescriptor",
           "RemoteRegion", "TransferBackend", "TransferFuture"]


class TransferBackend(PeerManager, ABC):
    name: ClassVar[str] = "abstract"
    max_write_bytes: int = 1 << 40

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(usable here, why not): checked by `python -m sglang_disagg.backends`."""
        return True, ""

    def __init__(self, config: BackendConfig | None = None) -> None:
        self.config = config or BackendConfig()
        self.instance = uuid.uuid4().hex
        self.provider = self._provider_label()
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._conn_peer: dict[control.ControlConn, Peer] = {}
        self._handshakes: dict[control.ControlConn, queue.Queue] = {}
        self._regions: dict[int, tuple[MemoryRegion, NativeRegistration]] = {}
        self._region_ids = itertools.count(1)
        self._batches: dict[int, tuple[str, TransferFuture]] = {}
        self._batch_ids = itertools.count(1)
        self._tracker = ExpectTracker(f"{self.name}-expect")
        self._inbox: queue.Queue[tuple[Peer, bytes]] = queue.Queue()
        self._accepted: queue.Queue[Peer] = queue.Queue()
        self._closed = False
        try:
            self._native_open()
        except BaseException:
            self._tracker.close("open failed")
            raise
        try:
            self._server = control.ControlServer(self.config.host, self._on_accept, self.config.port)
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
    def _native_register(self, addr: int, length: int) -> NativeRegistration: ...
    @abstractmethod
    def _native_deregister(self, reg: NativeRegistration) -> None: ...
    @abstractmethod
    def _native_post(self, peer: Peer, batch_id: int, writes: Sequence[PageWrite], imm: int) -> None: ...
    @abstractmethod
    def _native_close(self) -> None: ...

    def _native_stats(self) -> dict[str, int]:
        return {}

    # ----- memory ----------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Where peers connect (host:port of the control channel)."""
        return self._server.address

    def register(self, addr: int, length: int) -> tuple[MemoryRegion, bytes]:
        self._check_open()
        if not isinstance(addr, int) or not isinstance(length, int) or addr <= 0 or length <= 0:
            raise DescriptorError(f"register: need addr > 0 and length > 0, got addr={addr!r} length={length!r}")
        reg = self._native_register(addr, length)
        region = MemoryRegion(next(self._region_ids), addr, length, self.instance)
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
        checked = [check_write(self, peer, w, i) for i, w in enumerate(writes)]
        return self._submit(peer, len(checked), lambda bid: self._native_post(peer, bid, checked, imm))

    def write_uniform(self, peer: Peer, src: MemoryRegion, src_offsets: Sequence[int], dst: RemoteRegion,
                      dst_offsets: Sequence[int], length: int, imm: int) -> TransferFuture:
        """Fast form for one region pair and equal lengths (a layer's KV pages): write i copies
        `length` bytes from src+src_offsets[i] to dst+dst_offsets[i]. Bounds are checked on
        the whole lists at once, so Python costs far less per write than in write()."""
        self._check_submit(peer, imm)
        check_uniform(self, peer, src, src_offsets, dst, dst_offsets, length)
        return self._submit(peer, len(src_offsets), lambda bid: self._native_post_uniform(
            peer, bid, src, src_offsets, dst, dst_offsets, length, imm))

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

    def _submit(self, peer: Peer, n: int, post: Callable[[int], None]) -> TransferFuture:
        fut = TransferFuture(f"{self.name} batch to {peer.address}")
        if n == 0:
            fut.set_result(0)
            return fut
        batch_id = next(self._batch_ids)
        with self._lock:  # same lock as _drop_peer: either we see the loss or it sees us
            if peer.state is not PeerState.CONNECTED:
                raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
            self._batches[batch_id] = (peer.id, fut)
        try:
            post(batch_id)
        except BaseException:
            with self._lock:
                self._batches.pop(batch_id, None)
            raise
        return fut

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
        return self._tracker.expect(tag, count, timeout_s, peer)

    def forget(self, tag: int) -> None:
        self._tracker.forget(tag)

    def retire(self, tag: int, reason: str = "cancelled") -> None:
        """Stop counting `tag`: its pending expectation fails, late writes are discarded."""
        self._tracker.retire(tag, reason)

    def is_retired(self, tag: int) -> bool:
        return self._tracker.is_retired(tag)

    # ----- messages, stats, close ------------------------------------------------------
    def recv(self, timeout_s: float) -> tuple[Peer, bytes]:
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise DeadlineExceeded(f"no control message within {timeout_s} s") from None

    def stats(self) -> dict[str, int]:
        with self._lock:
            base = {"peers": len(self._peers), "batches": len(self._batches), "regions": len(self._regions)}
        return base | {"expectations": self._tracker.pending(),
                       "late_writes_dropped": self._tracker.late_writes_dropped} | self._native_stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
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
