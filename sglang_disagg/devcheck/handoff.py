"""Part `fdpass` of the device check: memory exported at an offset inside its allocation
(the V half of a K|V pool) and imported by another process from a descriptor sent over
SCM_RIGHTS, as TP ranks hand their KV to the messenger leader. The importer reads what the
owner wrote at that offset and writes back; the owner sees the write in its own memory.

On CUDA the allocation is a cuMem allocation (cumem.py); on CPU a memfd (the CPU pools'
memory kind). The child process is this module run with --child.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import subprocess
import sys

from ..ipc import fdpass
from . import memory

HALF = 8 << 20  # bytes in each of the K and V halves
STAMP = b"written back by the importer"


def _pattern() -> bytes:
    return hashlib.shake_256(b"sglang-disagg devcheck").digest(HALF)


def _owner(device: str) -> tuple[object, int, dict]:
    """(keep-alive, descriptor, header) of a K|V allocation whose V half holds the pattern."""
    import torch

    if memory.kind(device) == "cuda":
        from ..ipc import cumem

        pool = cumem.exportable_zeros((2 * HALF,), torch.uint8, torch.device(device))
        v = pool[HALF:]
        v.copy_(torch.frombuffer(bytearray(_pattern()), dtype=torch.uint8).to(device))
        torch.cuda.synchronize()
        exp = cumem.export(v)
        return pool, cumem.fd(exp.key), {"export": {f: getattr(exp, f) for f in exp.__dataclass_fields__}}
    fd = os.memfd_create("sglang-disagg-devcheck-kv")
    os.ftruncate(fd, 2 * HALF)
    os.pwrite(fd, _pattern(), HALF)
    return None, fd, {"size": 2 * HALF, "offset": HALF, "length": HALF}


def _read_back(device: str, keep: object, fd: int) -> bytes:
    if memory.kind(device) == "cuda":
        import torch

        torch.cuda.synchronize()
        return keep[HALF:HALF + len(STAMP)].cpu().numpy().tobytes()
    return os.pread(fd, len(STAMP), HALF)


def child(device: str, name: str) -> dict:
    with fdpass.connect(name, 10.0) as conn:
        msg = conn.recv(10.0)
        (fd,) = msg.fds
        if memory.kind(device) == "cuda":
            import torch

            from ..ipc import cumem

            imp = cumem.Imported(cumem.Export(**msg.body["export"]), fd)
            n = imp.size - (imp.ptr - imp.base)
            view = torch.as_tensor(cumem._CudaArray(imp.ptr, (n,), "|u1"), device=device)[:HALF]
            digest = hashlib.sha256(view.cpu().numpy().tobytes()).hexdigest()
            view[:len(STAMP)].copy_(torch.frombuffer(bytearray(STAMP), dtype=torch.uint8).to(device))
            torch.cuda.synchronize()
        else:
            m = mmap.mmap(fd, msg.body["size"])
            os.close(fd)
            off = msg.body["offset"]
            digest = hashlib.sha256(m[off:off + msg.body["length"]]).hexdigest()
            m[off:off + len(STAMP)] = STAMP
            m.close()
        conn.send("done", {"sha256": digest})
        conn.recv(10.0)  # the owner has read our write back: only now unmap (process exit)
    return {}


def run(device: str, secret: bytes) -> dict:
    keep, fd, header = _owner(device)
    lst = fdpass.Listener("devcheck")
    p = subprocess.Popen([sys.executable, "-m", "sglang_disagg.devcheck.handoff", "--device", device,
                          "--name", lst.name])
    try:
        with lst.accept(20.0) as conn:
            conn.expect_peer(p.pid, "the importing process")
            conn.send("kv-half", header, [fd])
            reply = conn.recv(30.0)
            written = _read_back(device, keep, fd)
            conn.send("bye", {})
        rc = p.wait(20)
    finally:
        lst.close()
        if p.poll() is None:
            p.kill()
    want = hashlib.sha256(_pattern()).hexdigest()
    return {"ok": rc == 0 and reply.body.get("sha256") == want and written == STAMP,
            "importer_read_equal": reply.body.get("sha256") == want, "owner_sees_write": written == STAMP,
            "offset": HALF, "bytes": HALF, "memory": "cuMem" if memory.kind(device) == "cuda" else "memfd"}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", required=True)
    ap.add_argument("--name", required=True)
    a = ap.parse_args()
    child(a.device, a.name)
