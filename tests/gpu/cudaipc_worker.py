"""The conformance suite's worker (tests/backends/fault_worker.py, a superset of
transfer_worker.py) with its buffers in CUDA memory: cuMem allocations on cuda:0 made by
cumem.exportable_zeros, registered as cuda(0); digests read the device memory back.
Run as a process by tests/gpu/test_cudaipc.py.
"""

from __future__ import annotations

import hashlib
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

import torch  # noqa: E402
from fault_worker import FaultWorker  # noqa: E402 - also puts benchmarks/ (jsonl_worker) on sys.path
from jsonl_worker import serve  # noqa: E402
from transfer_worker import pattern  # noqa: E402

from sglang_disagg.ipc import cumem  # noqa: E402
from sglang_disagg.backends.regions import cuda  # noqa: E402


class CudaWorker(FaultWorker):
    def alloc(self, size: int, seed: int | None = None) -> dict:
        t = cumem.exportable_zeros((size,), torch.uint8, "cuda:0")
        if seed is not None:
            t.copy_(torch.frombuffer(bytearray(pattern(seed, size)), dtype=torch.uint8))
        torch.cuda.synchronize()  # the backend's own stream does not wait for torch's
        region, desc = self.be.register(t.data_ptr(), size, cuda(0))
        self.bufs[region.id], self.regions[region.id] = t, region
        return {"region": region.id, "desc": desc.decode()}

    def digest(self, region: int, ranges: list) -> dict:
        data = self.bufs[region].cpu().numpy().tobytes()
        return {"sha": [hashlib.sha256(data[o:o + n]).hexdigest() for o, n in ranges]}


def main() -> None:
    serve(CudaWorker(), lambda e: {"type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()})


if __name__ == "__main__":
    main()
