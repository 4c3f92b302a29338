"""A backend in its own process, driven by JSON lines on stdin (one reply line per request).

Used by the conformance suite so that every transfer crosses a real process boundary,
and so that NIXL's crash at interpreter exit never reaches pytest (we leave by os._exit).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import random
import threading
import time
import sys
import traceback
from pathlib import Path

from sglang_disagg.backends import BackendConfig, TransferError, create_backend

# The JSON-lines loop is shared with the transfer benchmark's worker.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from jsonl_worker import serve  # noqa: E402


def pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


class Worker:
    def __init__(self) -> None:
        self.be = None
        self.bufs: dict[int, mmap.mmap] = {}
        self.regions: dict[int, object] = {}
        self.peers: dict[str, object] = {}
        self.remotes: dict[int, object] = {}
        self.futs: dict[int, object] = {}
        self.n = 0
        self.stream_error: dict | None = None

    def _id(self) -> int:
        self.n += 1
        return self.n

    def init(self, backend: str, provider: str | None = None) -> dict:
        self.be = create_backend(backend, BackendConfig(provider=provider))
        return {"address": self.be.address}

    def alloc(self, size: int, seed: int | None = None) -> dict:
        # Shared memory (a memfd), as the messenger allocates KV pools: every backend can
        # register it, and the shmem backend needs it (a peer maps it to write).
        fd = os.memfd_create("transfer-worker")
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        os.close(fd)  # the mapping keeps its own descriptor
        if seed is not None:
            m[:] = pattern(seed, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        region, desc = self.be.register(addr, size)
        self.bufs[region.id], self.regions[region.id] = m, region
        return {"region": region.id, "desc": desc.decode()}

    def connect(self, address: str, name: str | None = None) -> dict:
        """`name`: a key of our own for a second connection to one peer instance."""
        p = self.be.connect(address)
        self.peers[name or p.id] = p
        return {"peer": name or p.id}

    def accept(self, timeout: float = 5.0, name: str | None = None) -> dict:
        p = self.be.wait_peer(timeout)
        self.peers[name or p.id] = p
        return {"peer": name or p.id}

    def add_remote(self, peer: str, desc: str) -> dict:
        r = self.peers[peer].add_remote_region(desc.encode())
        rid = self._id()
        self.remotes[rid] = r
        return {"remote": rid}

    def _writes(self, region: int, remote: int, writes: list) -> list:
        src, dst = self.regions[region], self.remotes[remote]
        return [(src, s, dst, d, n) for s, d, n in writes]

    def write(self, peer: str, region: int, remote: int, writes: list, imm: int, wait: float | None = 10.0) -> dict:
        fut = self.be.write(self.peers[peer], self._writes(region, remote, writes), imm)
        if wait is None:
            fid = self._id()
            self.futs[fid] = fut
            return {"future": fid}
        fut.wait(wait)
        return {}

    def write_uniform(self, peer: str, region: int, remote: int, src_offsets: list, dst_offsets: list,
                      length: int, imm: int, wait: float = 10.0) -> dict:
        self.be.write_uniform(self.peers[peer], self.regions[region], src_offsets, self.remotes[remote],
                              dst_offsets, length, imm).wait(wait)
        return {}

    def expect(self, tag: int, count: int, timeout: float, peer: str | None = None, wait: bool = True) -> dict:
        t0 = time.monotonic()
        fut = self.be.expect(tag, count, timeout, self.peers[peer] if peer else None)
        if not wait:
            fid = self._id()
            self.futs[fid] = fut
            return {"future": fid}
        fut.wait(timeout + 5)
        return {"elapsed": time.monotonic() - t0}

    def wait(self, future: int, timeout: float) -> dict:
        fut = self.futs.pop(future)
        try:
            fut.wait(timeout)
        except TransferError:
            self.futs[future] = fut if not fut.done() else None
            raise
        return {"t": time.time()}

    def failed_at(self, future: int, timeout: float) -> dict:
        """Wait for a future that must fail; report the error and when it was seen."""
        fut = self.futs.pop(future)
        try:
            fut.wait(timeout)
        except TransferError as e:
            return {"type": type(e).__name__, "msg": str(e), "t": time.time()}
        return {"type": None, "t": time.time()}

    def stream(self, peer: str, region: int, remote: int, writes: list, imm: int) -> dict:
        """Write the same batch back to back until something fails (for kill tests)."""
        batch = self._writes(region, remote, writes)
        p = self.peers[peer]

        def run() -> None:
            while True:
                try:
                    self.be.write(p, batch, imm).wait(30)
                except TransferError as e:
                    self.stream_error = {"type": type(e).__name__, "msg": str(e), "t": time.time()}
                    return
        threading.Thread(target=run, daemon=True).start()
        return {}

    def stream_result(self, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while self.stream_error is None and time.monotonic() < end:
            time.sleep(0.005)
        return self.stream_error or {"type": None}

    def digest(self, region: int, ranges: list) -> dict:
        m = self.bufs[region]
        return {"sha": [hashlib.sha256(m[o:o + n]).hexdigest() for o, n in ranges]}

    def arrived(self, tag: int) -> dict:
        return {"count": self.be._tracker.arrived(tag)}

    def send(self, peer: str, data: str) -> dict:
        self.peers[peer].send(data.encode())
        return {}

    def recv(self, timeout: float) -> dict:
        p, data = self.be.recv(timeout)
        return {"peer": p.id, "data": data.decode()}

    def stats(self) -> dict:
        return self.be.stats()

    def stacks(self) -> dict:
        """Every thread's stack (a failing kill test says where the sender is stuck)."""
        names = {t.ident: t.name for t in threading.enumerate()}
        return {"stacks": {names.get(i, str(i)): "".join(traceback.format_stack(f))
                           for i, f in sys._current_frames().items()}}

    def close_peer(self, peer: str) -> dict:
        self.peers.pop(peer).close()
        return {}

    def close(self) -> dict:
        self.be.close()
        return {"threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())}


def main() -> None:
    serve(Worker(), lambda e: {"type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()})


if __name__ == "__main__":
    main()
