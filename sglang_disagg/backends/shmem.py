"""Same-host backend: the writer copies straight into a mapping of the peer's memory.

Between two processes on one host, libfabric's shm provider moves data with
process_vm_writev (one copy, but through the kernel: ~0.6x memcpy here). When the
receiver's memory is shared (a memfd or /dev/shm file; the messenger allocates KV pools
so), the writer can map it and copy with memcpy. Same contract as every backend:

- regions: ``register`` finds the file behind the range (sglang_disagg.ipc.shm.locate); the
  descriptor names it, its device and inode and what it links to, all checked before the
  writer maps it. Memory that is not shared is refused with a DescriptorError.
- same host: decided at first contact by whether the peer's memory can be reached (reach.py:
  each side maps a probe memfd the other names in its HELLO and reads its bytes back), not
  by boot_id alone, which namespaces share; a peer elsewhere is refused with "not on this
  host" and why. A peer with another /dev/shm (mount namespace) may still be reached
  through its memfds; its /dev/shm-backed regions are refused when it names them.
- immediates: after a batch's copies the writer sends NOTIFY(tag, count) on the control
  channel; the data is in the receiver's memory before the notification is read.
- failures: peer loss comes from the control channel, as for every backend.
- batches are copied in order on one worker thread (ctypes.memmove releases the GIL).
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

from ..ipc import shm
from . import reach
from .base import TransferBackend
from .errors import BackendUnavailable, DescriptorError, TransferError, UnsupportedMemory
from .peers import Peer
from .regions import Memory, MemoryKind, MemoryRegion, NativeRegistration, PageWrite, RegionDescriptor, RemoteRegion
from ..threads import Thread as NamedThread


def _shm_dir() -> list[int]:
    st = os.stat("/dev/shm")
    return [st.st_dev, st.st_ino]



class ShmemBackend(TransferBackend):
    name = "shmem"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            reach.boot_id("shmem")
        except BackendUnavailable as e:
            return False, str(e)
        return True, "same-host peers, shared memory (memfd / /dev/shm)"

    def _provider_label(self) -> str:
        return "memfd"

    def _native_open(self) -> None:
        self._host = reach.boot_id("shmem")
        self._probe = reach.Probe()
        self._shm_dir = _shm_dir() if os.path.isdir("/dev/shm") else None
        self._foreign_shm: set[str] = set()  # peers (ids) whose /dev/shm is not ours
        self._maps: dict[tuple, shm.Mapping] = {}  # (peer id, region id, what it names) -> mapping
        self._maps_lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._worker = NamedThread(target=self._work, name="shmem-copy", daemon=True)
        self._worker.start()

    def _endpoint_info(self) -> dict[str, Any]:
        return {"boot_id": self._host, "probe": self._probe.info, "shm_dir": self._shm_dir}

    def _native_connect(self, peer: Peer) -> None:
        e = peer.endpoint
        if e.get("boot_id") != self._host:
            raise TransferError(f"shmem: peer {peer.address} {reach.NOT_HERE}: its kernel's boot id differs from "
                                "ours; between hosts use libfabric tcp, nixl or mooncake")
        reach.check("shmem", peer.address, e.get("probe"))
        if e.get("shm_dir") != self._shm_dir:
            self._foreign_shm.add(peer.id)
        peer.native = peer.id

    def _native_disconnect(self, peer: Peer) -> None:
        peer.native = None
        with self._maps_lock:
            gone = [self._maps.pop(k) for k in [k for k in self._maps if k[0] == peer.id]]
        # The copy thread may be writing through these mappings: it unmaps them after the
        # copies queued before this point (unmapping now would fault it).
        self._jobs.put(("unmap", gone))

    def _native_register(self, addr: int, length: int, memory: Memory) -> NativeRegistration:
        if memory.kind is not MemoryKind.HOST:
            # memcpy through a mapping of a file: device memory has neither.
            raise UnsupportedMemory(f"shmem: cannot register {memory}: this backend copies between host "
                                    "mappings only; for CUDA memory on one host use the cudaipc backend, or nixl "
                                    "(VRAM)")
        try:
            b = shm.locate(addr, length)
        except shm.SharedMemoryError as e:
            raise DescriptorError(f"shmem can only register shared memory: {e}") from e
        return NativeRegistration((addr, length), 0, 0, {"path": b.path, "offset": b.offset, "inode": b.inode,
                                                         "dev": b.dev, "target": b.target})

    def _native_deregister(self, reg: NativeRegistration) -> None:
        pass  # the memory belongs to its allocator; peers keep their own mappings

    def _check_remote(self, peer: Peer, d: RegionDescriptor) -> None:
        extra = d.extra
        if not all(isinstance(extra.get(k), str) for k in ("path", "target")) or not all(
                isinstance(extra.get(k), int) and not isinstance(extra.get(k), bool) for k in ("offset", "inode", "dev")):
            raise DescriptorError("shmem descriptor lacks path/offset/inode/dev/target")
        if peer.id in self._foreign_shm and extra["path"].startswith("/dev/shm/"):
            raise DescriptorError(f"shmem: peer {peer.address} names {extra['path']}, but its /dev/shm is not ours "
                                  "(another mount namespace): only its memfds can be reached from here")

    def _mapping(self, dst: RemoteRegion) -> shm.Mapping:
        """The peer's region mapped here, on first use."""
        d = dst.descriptor
        # The whole descriptor: a peer that says Hello again may name other memory under the same region id.
        key = (dst.peer, d.region, d.length, tuple(sorted(d.extra.items())))
        with self._maps_lock:
            m = self._maps.get(key)
            if m is None:
                try:
                    x = d.extra
                    m = shm.Mapping(shm.Backing(x["path"], x["offset"], x["inode"], x["dev"], x["target"]), d.length)
                except shm.SharedMemoryError as e:
                    raise TransferError(f"shmem: {e}") from e
                self._maps[key] = m
        return m

    def _native_post(self, peer: Peer, batch_id: int, writes: Sequence[PageWrite], imm: int) -> None:
        copies = [(self._mapping(w.dst).addr + w.dst_offset, w.src.addr + w.src_offset, w.length) for w in writes]
        self._enqueue(peer, batch_id, copies, imm)

    def _native_post_uniform(self, peer: Peer, batch_id: int, src: MemoryRegion, src_offsets: Sequence[int],
                             dst: RemoteRegion, dst_offsets: Sequence[int], length: int, imm: int) -> None:
        base = self._mapping(dst).addr
        copies = [(base + d, src.addr + s, length) for s, d in zip(src_offsets, dst_offsets)]
        self._enqueue(peer, batch_id, copies, imm)

    def _enqueue(self, peer: Peer, batch_id: int, copies: list, imm: int) -> None:
        self._jobs.put((peer, batch_id, copies, imm))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job[0] == "unmap":
                for m in job[1]:
                    m.close()
                continue
            peer, batch_id, copies, imm = job
            error = None
            try:
                if peer.native is None:
                    raise TransferError(f"peer {peer.address} is {peer.state.value}")
                for dst, src, n in copies:
                    ctypes.memmove(dst, src, n)
                peer.notify(imm, len(copies))
            except TransferError as e:
                error = str(e)
            self._complete_batch(batch_id, error, lost=peer.native is None)

    def _native_stats(self) -> dict[str, int]:
        return {"native_batches": self._jobs.qsize(), "mappings": len(self._maps)}

    def _native_close(self) -> None:
        self._jobs.put(None)
        if threading.current_thread() is not self._worker:  # close() from a completion callback
            self._worker.join(timeout=5.0)
        with self._maps_lock:
            maps, self._maps = list(self._maps.values()), {}
        for m in maps:
            m.close()
        self._probe.close()
