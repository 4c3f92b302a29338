"""The receiving process of the device check: registers a buffer, says where it is, counts
the writes by immediate, and answers with the hash of what arrived.

Protocol (JSON lines): it prints {"address", "desc"}; reads {"tag", "count", "timeout_s"}
and prints {"ok", "sha256", "elapsed_s"} (or {"ok": false, "error"}) per line; EOF ends it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

from ..devices import for_device
from . import memory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", required=True)
    ap.add_argument("--bytes", type=int, required=True)
    args = ap.parse_args()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # native libraries' prints go to stderr, replies to our copy of stdout
    secret = bytes.fromhex(os.environ["SGLANG_DISAGG_DEVCHECK_SECRET"])
    be = memory.backend(args.device, secret)
    buf = memory.zeros(args.device, args.bytes)
    _, desc = be.register(buf.data_ptr(), args.bytes, for_device(args.device).memory())
    out.write(json.dumps({"address": be.address, "desc": desc.decode()}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.monotonic()
        try:
            be.expect(req["tag"], req["count"], req["timeout_s"]).wait(req["timeout_s"] + 5)
            memory.synchronize(args.device)
            digest = hashlib.sha256(buf.cpu().numpy().tobytes()).hexdigest()
            reply = {"ok": True, "sha256": digest, "elapsed_s": time.monotonic() - t0}
            buf.zero_()  # the next run starts from zeros, as a fresh decoder page does
            memory.synchronize(args.device)
        except Exception as e:  # noqa: BLE001 - the driver reports it
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    be.close()
    os._exit(0)


if __name__ == "__main__":
    main()
