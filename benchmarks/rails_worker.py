"""One transfer backend inside a namespace host, for benchmarks/rails.py.

    python benchmarks/rails_worker.py listen BACKEND PROVIDER OWN_ADDR PORT DIR MIB
    python benchmarks/rails_worker.py dial BACKEND PROVIDER OWN_ADDR HOST:PORT DIR MIB ROUNDS

`listen` registers MIB MiB, writes DIR/desc and DIR/listening (its address) and waits to be
killed; `dial` connects, writes the whole region ROUNDS times in 64 KiB pages (one batch per
round, waited) and prints one JSON line: seconds per round and bytes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from sglang_disagg.backends import BackendConfig, create_backend  # noqa: E402
from sglang_disagg.ipc import shm  # noqa: E402
from sglang_disagg.rails import choose  # noqa: E402

PAGE = 1 << 16
BATCH = 16  # pages per write call: 1 MiB
SECRET = b"rails-benchmark-secret-32-bytes!"


def main() -> None:
    what, backend, provider, host, address, where, mib = sys.argv[1:8]
    d, nbytes = Path(where), int(mib) << 20
    buf = shm.shared_zeros((nbytes,), torch.uint8)
    rails = choose.resolve([choose.AUTO]) if provider.endswith("+rails") else ()  # every interface but lo
    provider = provider.removesuffix("+rails")
    be = create_backend(backend, BackendConfig(provider=None if provider == "-" else provider, host=host,
                                               port=int(address) if what == "listen" else 0, secret=SECRET,
                                               rails=rails))
    region, desc = be.register(buf.data_ptr(), nbytes)
    pages = list(range(nbytes // PAGE))
    if what == "listen":
        (d / "desc").write_bytes(desc if isinstance(desc, bytes) else desc.encode())
        (d / "listening").write_text(be.address)
        while True:
            time.sleep(1)
    rounds = int(sys.argv[8])
    buf.fill_(7)
    peer = be.connect(address, 10)
    remote = peer.add_remote_region((d / "desc").read_bytes())
    be.write_pages(peer, region, pages[:1], PAGE, remote, pages[:1], PAGE, PAGE, imm=1).wait(30)  # warm-up
    times = []
    for r in range(rounds):
        t0 = time.monotonic()
        # in batches of BATCH pages, as the messenger posts a layer's pages: a batch is what a rail carries
        futs = [be.write_pages(peer, region, pages[i:i + BATCH], PAGE, remote, pages[i:i + BATCH], PAGE, PAGE,
                               imm=2 + r) for i in range(0, len(pages), BATCH)]
        for f in futs:
            f.wait(300)
        times.append(time.monotonic() - t0)
    print(json.dumps({"round_s": times, "bytes_per_round": nbytes}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
