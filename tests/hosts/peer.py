"""One transfer backend in a host, for the same-host-only refusal tests.

    python tests/hosts/peer.py listen BACKEND PROVIDER OWN_ADDR PORT DIR  # registers 64 KiB, writes DIR/desc, waits
    python tests/hosts/peer.py dial BACKEND PROVIDER OWN_ADDR HOST:PORT DIR  # connects, writes 4 pages into it

`dial` prints one JSON line: how long the first contact took, its error if refused, and
otherwise what writing through the connection did (left for the test to judge).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from sglang_disagg.ipc import shm
from sglang_disagg.backends import BackendConfig, TransferError, create_backend

NBYTES, PAGE = 1 << 16, 4096
SECRET = b"multi-host-refusal-test-secret!!"


def main() -> None:
    what, backend, provider, host, address, where = sys.argv[1:7]
    d = Path(where)
    buf = shm.shared_zeros((NBYTES,), torch.uint8)  # shmem registers shared memory only
    be = create_backend(backend, BackendConfig(provider=None if provider == "-" else provider, host=host,
                                               port=int(address) if what == "listen" else 0, secret=SECRET))
    region, desc = be.register(buf.data_ptr(), NBYTES)
    if what == "listen":
        (d / "desc").write_bytes(desc if isinstance(desc, bytes) else desc.encode())
        (d / "listening").write_text(be.address)
        landed = 0
        for _ in range(6000):  # each dialer's 4 pages of 7s that really landed here: DIR/landed counts them
            if bool((buf[: 4 * PAGE] == 7).all()):
                buf.zero_()
                landed += 1
                (d / "landed.tmp").write_text(str(landed))
                (d / "landed.tmp").rename(d / "landed")
            time.sleep(0.1)
        return
    buf.fill_(7)
    t0 = time.monotonic()
    out: dict = {}
    try:
        peer = be.connect(address, 5)
    except TransferError as e:
        out = {"refused": str(e), "seconds": time.monotonic() - t0}
    else:
        out = {"connected_s": time.monotonic() - t0}
        try:
            remote = peer.add_remote_region((d / "desc").read_bytes())
            be.write_pages(peer, region, [0, 1, 2, 3], PAGE, remote, [0, 1, 2, 3], PAGE, PAGE, imm=77).wait(10)
            out["write"] = "completed"
        except Exception as e:  # noqa: BLE001 - reported: the test judges
            out["write"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
    import os

    os._exit(0)


if __name__ == "__main__":
    main()
