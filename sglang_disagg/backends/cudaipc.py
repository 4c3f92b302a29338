"""Same-host GPU backend: the writer copies into its own mapping of the peer's cuMem memory.

The CUDA twin of ``shmem``. Between two processes of one host, a receiver's KV pool (cuMem
memory, sglang_disagg.ipc.cumem) is imported into the writer, which copies into it with the
GPU's copy engines. Same contract as every backend:

- regions: ``register`` takes CUDA memory inside a cuMem allocation of this process (made
  by cumem.exportable_zeros, or imported with cumem.Imported: the messenger leader hands
  its ranks' pools on); host memory is UnsupportedMemory (shmem is the host twin). The
  descriptor names the allocation (``alloc`` key, ``size``, ``device``) and where the region
  starts in it (``offset``).
- importing: file descriptors cannot travel in JSON, so each backend serves its
  allocations' descriptors on an abstract Unix socket (fdpass.py, SCM_RIGHTS), named in its
  HELLO with its pid. It answers only a process of our uid whose pid (SO_PEERCRED) is that
  of a peer connected on the control channel - a peer that proved the deployment's secret
  there - and only for allocations behind a registered region. The importer checks the
  socket is held by the pid the peer's HELLO names. add_remote_region imports at once
  (cached per peer and allocation), so a peer on another host, in another network or pid
  namespace, or whose memory this GPU cannot map fails there: "peer not on this host /
  cannot import its CUDA memory: <why>".
- writes: cuMemcpyDtoDAsync on one stream of our own (non-blocking: no implicit sync with
  torch's streams; the caller orders its writes after the kernels that produced the data),
  one event recorded per batch; a completion thread waits for the events in order, then
  sends NOTIFY(tag, count) on the control channel, as shmem does after its memcpy: the data
  is in the receiver's memory before the notification is read.
- failures: peer loss comes from the control channel. A peer's mappings are unmapped only
  after every copy posted before its loss finished (a copy into an unmapped range would be
  a GPU fault, fatal to the whole CUDA context).
- contexts: calls made on a caller's thread save and restore its current context.

All copies run on one device, the copy device: that of the first CUDA region registered
(the leader's own GPU in messenger mode); imported memory is mapped for it and for the
device the memory lives on. Status: written against the driver API, not run on a GPU yet
(tests/gpu/test_cudaipc.py holds it to the conformance suite where a GPU is present).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..ipc import cuda_driver as cu
from ..ipc import cumem, fdpass
from . import reach
from .base import TransferBackend
from .errors import BackendUnavailable, DescriptorError, PeerLostError, TransferError, UnsupportedMemory
from .peers import Peer
from .regions import Memory, MemoryKind, MemoryRegion, NativeRegistration, PageWrite, RegionDescriptor, RemoteRegion
from ..threads import Thread as NamedThread

logger = logging.getLogger("sglang_disagg.backends.cudaipc")
REQUEST, GRANT, REFUSE = "cudaipc-request", "cudaipc-grant", "cudaipc-refuse"
_FIELDS = ("alloc", "size", "offset", "device")



def _probe() -> None:
    try:
        if cu.device_count() == 0:
            raise cu.CudaUnavailable("the CUDA driver sees no device")
    except (cu.CudaUnavailable, cu.CudaError) as e:
        raise BackendUnavailable(f"cudaipc needs a CUDA GPU and its driver on this host (shmem is its "
                                 f"host-memory twin): {e}") from None


class _PeerState:
    def __init__(self) -> None:
        self.imports: dict[int, cumem.Imported] = {}  # the peer's allocation key -> our mapping of it


class CudaIpcBackend(TransferBackend):
    name = "cudaipc"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            _probe()
            reach.boot_id("cudaipc")
        except BackendUnavailable as e:
            return False, str(e)
        return True, "same-host peers, CUDA device memory (cuMem allocations, descriptors over SCM_RIGHTS)"

    def _provider_label(self) -> str:
        return "cumem"

    def _native_open(self) -> None:
        _probe()
        self._host = reach.boot_id("cudaipc")
        self._device: int | None = None      # the copy device, fixed by the first CUDA region
        self._stream: cu.Stream | None = None
        self._served: dict[int, list[int]] = {}  # our allocation key -> [regions on it, size, device]
        self._post_lock = threading.Lock()   # posts, and a peer's loss, happen in one order
        self._jobs: queue.Queue = queue.Queue()
        self._listener = fdpass.Listener("cudaipc")
        self._completer = NamedThread(target=self._complete, name="cudaipc-complete", daemon=True)
        self._server = NamedThread(target=self._serve, name="cudaipc-fds", daemon=True)
        self._completer.start()
        self._server.start()

    def _endpoint_info(self) -> dict[str, Any]:
        return {"boot_id": self._host, "pid": os.getpid(), "fds": self._listener.name}

    def _native_connect(self, peer: Peer) -> None:
        e = peer.endpoint
        if e.get("boot_id") != self._host:
            raise TransferError("cudaipc peers must share a host (boot ids differ); use libfabric or nixl across hosts")
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("fds"), str):
            raise TransferError("cudaipc peer's hello lacks its pid or descriptor socket")
        peer.native = _PeerState()

    def _native_disconnect(self, peer: Peer) -> None:
        with self._post_lock:
            state, peer.native = peer.native, None
        if state is not None and state.imports:
            # Behind every batch posted before this point (same lock): unmapped once they finished.
            self._jobs.put(("unmap", list(state.imports.values())))

    # ----- memory ---------------------------------------------------------------------
    def _native_register(self, addr: int, length: int, memory: Memory) -> NativeRegistration:
        if memory.kind is not MemoryKind.CUDA:
            raise UnsupportedMemory(f"cudaipc: cannot register {memory}: this backend registers CUDA device memory "
                                    "only (shmem is its host-memory twin)")
        try:
            exp = cumem.export_range(addr, length)
        except cumem.CuMemError as e:
            raise DescriptorError(f"cudaipc: {e}") from e
        if exp.device != memory.device:
            raise DescriptorError(f"cudaipc: the range {addr:#x}+{length} lives on cuda:{exp.device}, "
                                  f"registered as {memory}")
        with self._post_lock:
            self._use_device(memory.device)
            self._served.setdefault(exp.key, [0, exp.size, exp.device])[0] += 1
        return NativeRegistration(exp, 0, 0, {"alloc": exp.key, "size": exp.size, "offset": exp.offset,
                                              "device": exp.device})

    def _use_device(self, device: int) -> None:
        if self._device is None:
            self._stream = cu.Stream(device)
            self._device = device

    def _native_deregister(self, reg: NativeRegistration) -> None:
        with self._post_lock:
            entry = self._served.get(reg.handle.key)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    del self._served[reg.handle.key]

    def _check_remote(self, peer: Peer, d: RegionDescriptor) -> None:
        x = d.extra
        if not all(isinstance(x.get(k), int) and not isinstance(x.get(k), bool) and x[k] >= 0 for k in _FIELDS):
            raise DescriptorError("cudaipc descriptor lacks alloc/size/offset/device")
        if x["offset"] + d.length > x["size"]:
            raise DescriptorError(f"cudaipc descriptor: region {x['offset']}+{d.length} leaves its allocation "
                                  f"of {x['size']} bytes")
        self._imported(peer, d)

    def _imported(self, peer: Peer, d: RegionDescriptor) -> cumem.Imported:
        """Our mapping of the allocation behind the peer's region, imported on first use."""
        x, state = d.extra, peer.native
        if state is None:
            raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
        m = state.imports.get(x["alloc"])
        if m is not None:
            if m.size != x["size"] or m.device != x["device"]:
                raise DescriptorError(f"cudaipc descriptor names allocation {x['alloc']} with another size/device")
            return m
        try:
            m = self._import(peer, x)
        except (fdpass.FdPassError, cu.CudaError, cu.CudaUnavailable) as e:
            raise TransferError(f"cudaipc: peer {peer.address} not on this host / cannot import its CUDA memory: "
                                f"{e}") from e
        with self._post_lock:
            if peer.native is state and x["alloc"] not in state.imports:
                state.imports[x["alloc"]] = m
                return m
            kept = state.imports.get(x["alloc"]) if peer.native is state else None
        m.close()  # another thread imported it first, or the peer went meanwhile
        if kept is None:
            raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
        return kept

    def _import(self, peer: Peer, x: dict) -> cumem.Imported:
        with fdpass.connect(peer.endpoint["fds"], self.config.connect_timeout_s) as conn:
            conn.expect_peer(peer.endpoint["pid"], f"cudaipc peer {peer.address}")
            conn.send(REQUEST, {"instance": self.instance, "alloc": x["alloc"]})
            msg = conn.recv(self.config.connect_timeout_s)
        if msg.kind == REFUSE:
            msg.close_fds()
            raise fdpass.FdPassError(f"the peer refused: {msg.body.get('reason')}")
        if msg.kind != GRANT or len(msg.fds) != 1 or msg.body != {k: x[k] for k in ("alloc", "size", "device")}:
            msg.close_fds()
            raise fdpass.FdPassError(f"unexpected answer {msg.kind!r} {msg.body!r:.200} to a request for "
                                     f"allocation {x['alloc']}")
        with self._post_lock:
            self._use_device(x["device"])  # nothing registered yet: copy on the memory's own device
        exp = cumem.Export(peer.endpoint["pid"], x["alloc"], x["size"], 0, x["size"], x["device"])
        return cumem.Imported(exp, msg.fds[0], device=self._device)

    def _serve(self) -> None:
        """Answer descriptor requests, one connection at a time, until close."""
        while True:
            try:
                conn = self._listener.accept(None)
            except fdpass.FdPassError:
                return
            with conn:
                try:
                    self._answer(conn)
                except (fdpass.FdPassError, cu.CudaError) as e:
                    logger.warning("cudaipc: descriptor request from pid %d failed: %s", conn.cred.pid, e)

    def _answer(self, conn: fdpass.Conn) -> None:
        msg = conn.recv(5.0)
        msg.close_fds()
        key = msg.body.get("alloc")
        # A peer that just dialed us may ask before our side of the handshake listed it.
        deadline = time.monotonic() + 1.0
        while (conn.cred.pid not in (pids := {p.endpoint.get("pid") for p in self.peers() if p.native is not None})
               and time.monotonic() < deadline and not self._closed):
            time.sleep(0.01)
        with self._post_lock:
            entry = self._served.get(key) if isinstance(key, int) else None
        if msg.kind != REQUEST:
            reason = f"not a {REQUEST}"
        elif conn.cred.uid != os.getuid() or conn.cred.pid not in pids:
            reason = f"pid {conn.cred.pid} uid {conn.cred.uid} is not a peer connected to this cudaipc backend"
        elif entry is None:
            reason = f"allocation {key!r} is behind no region registered here"
        else:
            with cu.on_device(entry[2]):
                f = cumem.fd(key)
            conn.send(GRANT, {"alloc": key, "size": entry[1], "device": entry[2]}, [f])
            return
        conn.send(REFUSE, {"reason": reason})

    # ----- data path ------------------------------------------------------------------
    def _native_post(self, peer: Peer, batch_id: int, writes: Sequence[PageWrite], imm: int) -> None:
        dsts = {id(w.dst): w.dst for w in writes}
        maps = {k: (r, self._imported(peer, r.descriptor)) for k, r in dsts.items()}
        self._post(peer, batch_id, imm, maps, [(id(w.dst), w.dst_offset, w.src.addr + w.src_offset, w.length)
                                                for w in writes])

    def _native_post_uniform(self, peer: Peer, batch_id: int, src: MemoryRegion, src_offsets: Sequence[int],
                             dst: RemoteRegion, dst_offsets: Sequence[int], length: int, imm: int) -> None:
        maps = {id(dst): (dst, self._imported(peer, dst.descriptor))}
        base = src.addr
        self._post(peer, batch_id, imm, maps, [(id(dst), d, base + s, length) for s, d in zip(src_offsets, dst_offsets)])

    def _post(self, peer: Peer, batch_id: int, imm: int, maps: dict[int, tuple[RemoteRegion, cumem.Imported]],
              copies: list[tuple[int, int, int, int]]) -> None:
        """Enqueue `copies` (destination key in `maps`, offset, source address, bytes) and
        the batch's event, under the lock a peer's loss takes: its mappings are still ours."""
        with self._post_lock:
            state = peer.native
            if state is None or any(state.imports.get(r.descriptor.extra["alloc"]) is not m for r, m in maps.values()):
                raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
            ptrs = {k: m.ptr for k, (_, m) in maps.items()}
            try:
                with cu.on_device(self._device):
                    for k, off, src, n in copies:
                        self._stream.copy(ptrs[k] + off, src, n)
                    event = self._stream.record()
            except cu.CudaError as e:
                raise TransferError(f"cudaipc: {e}") from e
            self._jobs.put((peer, batch_id, event, imm, len(copies)))

    def _complete(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job[0] == "unmap":
                for m in job[1]:
                    m.close()
                continue
            peer, batch_id, event, imm, n = job
            error = None
            try:
                try:
                    with cu.on_device(self._device):
                        event.wait()
                finally:
                    event.destroy()
                if peer.native is None:
                    raise TransferError(f"peer {peer.address} is {peer.state.value}")
                peer.notify(imm, n)
            except (TransferError, cu.CudaError) as e:
                error = str(e)
            self._complete_batch(batch_id, error, lost=peer.native is None)

    def _native_stats(self) -> dict[str, int]:
        return {"native_batches": self._jobs.qsize(), "served_allocations": len(self._served)}

    def _native_close(self) -> None:
        self._listener.close()
        if threading.current_thread() is not self._server:
            self._server.join(timeout=5.0)
        self._jobs.put(None)
        if threading.current_thread() is not self._completer:  # close() from a completion callback
            self._completer.join(timeout=5.0)
        if self._stream is not None:
            # Before anything is unmapped: a copy still running into it would fault the context.
            self._stream.synchronize()
            self._stream.destroy()
