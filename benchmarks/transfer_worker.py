"""One benchmark endpoint in its own process, driven by JSON lines (see transfer.py).

Timed loops run here, next to the backend, so the driver's IPC never enters a figure.
Leaves by os._exit: NIXL crashes at interpreter exit.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transfer_workloads import Workload, batches  # noqa: E402

from sglang_disagg.backends import BackendConfig, create_backend  # noqa: E402
from jsonl_worker import serve  # noqa: E402


class Bench:
    def __init__(self) -> None:
        self.be = None
        self.peer = None
        self.mem: dict[int, tuple[mmap.mmap, object]] = {}

    def init(self, backend: str, provider: str | None) -> dict:
        self.be = create_backend(backend, BackendConfig(provider=provider))
        return {"address": self.be.address}

    def connect(self, address: str) -> dict:
        self.peer = self.be.connect(address)
        return {}

    def accept(self) -> dict:
        self.peer = self.be.wait_peer(10.0)
        return {}

    def alloc(self, size: int) -> dict:
        fd = os.memfd_create("transfer-bench")  # shared memory, as KV pools in messenger mode
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        os.close(fd)
        m.write(b"\x5a" * size)  # fault every page in before timing
        region, desc = self.be.register(ctypes.addressof(ctypes.c_char.from_buffer(m)), size)
        self.mem[region.id] = (m, region)
        return {"region": region.id, "desc": desc.decode()}

    def free(self, region: int) -> dict:
        _, r = self.mem.pop(region)
        self.be.deregister(r)
        return {}

    def run(self, spec: dict, region: int, desc: str, mode: str, budget_s: float, min_iters: int,
            max_iters: int) -> dict:
        w = Workload(**spec)
        remote = self.peer.add_remote_region(desc.encode())
        src = self.mem[region][1]
        plan = [[(src, s, remote, d, n) for s, d, n in b] for b in batches(w)]
        per_req_bytes = sum(n for b in plan for *_, n in b)
        per_req_writes = sum(len(b) for b in plan)

        # Equal-length batches (pages, HND slices) go through write_uniform, the API the KV
        # messenger uses; ragged ones through write().
        uniform = [([s for _, s, _, _, _ in b], [d for _, _, _, d, _ in b], b[0][4])
                   if len({w[4] for w in b}) == 1 else None for b in plan]

        def python_request(tag: int) -> None:
            futs = [self.be.write_uniform(self.peer, src, u[0], remote, u[1], u[2], tag) if u else
                    self.be.write(self.peer, b, tag) for b, u in zip(plan, uniform)]
            for f in futs:
                f.wait(120)

        def raw_request(tag: int) -> float:
            _, ns = self.be.raw_c_loop(self.peer, plan[0], tag, 1)
            return ns[0] / 1e9

        def timed_python(tag: int) -> float:
            t1 = time.perf_counter()
            python_request(tag)
            return time.perf_counter() - t1

        # "both" alternates Python and raw-C requests so that load from other processes
        # on this shared machine hits both sides of the comparison alike.
        runners = {"python": [timed_python], "raw": [raw_request], "both": [timed_python, raw_request]}[mode]
        if mode != "python" and len(plan) != 1:
            raise ValueError("the raw C loop runs single-batch workloads")
        lats: list[list[float]] = [[] for _ in runners]
        for run in runners:  # warm-up
            run(0)
        t0 = time.perf_counter()
        while len(lats[0]) < max_iters and (len(lats[0]) < min_iters or time.perf_counter() - t0 < budget_s):
            for i, run in enumerate(runners):
                lats[i].append(run(len(lats[0]) + 1))
        lat = lats[0]
        return {"lat": lat, "lat_raw": lats[1] if len(lats) > 1 else lats[0] if mode == "raw" else None, "bytes": per_req_bytes, "writes": per_req_writes, "batches": len(plan)}


def main() -> None:
    serve(Bench(), lambda e: {"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
