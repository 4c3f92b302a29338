"""Part `bandwidth` of the device check: the same-host backend's write rate into another
process against a plain copy of the same bytes inside this process (the physical limit the
backend is compared with), measured in the same run."""

from __future__ import annotations

import time

from ..devices import for_device
from . import memory
from .streaming import Receiver

SIZES = {"cpu": (64 << 20, 1 << 20), "cuda": (512 << 20, 2 << 20)}  # total bytes, page bytes
REPEATS = 5


def run(device: str, secret: bytes) -> dict:
    import torch

    total, page = SIZES[memory.kind(device)]
    pages = list(range(total // page))
    src = memory.zeros(device, total)
    src.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    local = memory.zeros(device, total)
    receiver = Receiver(device, total, secret)
    be = memory.backend(device, secret)
    try:
        region, _ = be.register(src.data_ptr(), total, for_device(device).memory())
        peer = be.connect(receiver.hello["address"], 10.0)
        dst = peer.add_remote_region(receiver.hello["desc"].encode())
        backend_s, copy_s, equal = [], [], True
        for i in range(REPEATS):
            receiver.ask(1000 + i, len(pages), 60.0)
            t0 = time.monotonic()
            be.write_pages(peer, region, pages, page, dst, pages, page, page, 1000 + i).wait(60.0)
            backend_s.append(time.monotonic() - t0)
            equal &= bool(receiver.answer().get("ok"))
            memory.synchronize(device)
            t0 = time.monotonic()
            local.copy_(src)
            memory.synchronize(device)
            copy_s.append(time.monotonic() - t0)
        equal &= bool(torch.equal(local, src))
    finally:
        be.close()
        receiver.close()
    best_backend, best_copy = min(backend_s), min(copy_s)
    return {"ok": equal, "bytes": total, "page_bytes": page, "repeats": REPEATS,
            "backend": memory.BACKENDS[memory.kind(device)],
            "backend_gbps": total / best_backend / 1e9, "copy_gbps": total / best_copy / 1e9,
            "ratio_to_copy": best_copy / best_backend, "backend_s": backend_s, "copy_s": copy_s}
