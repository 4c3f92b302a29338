"""cumem.py + handover.py across processes, as one messenger per server uses them on GPU:
"rank" processes allocate exportable KV memory (K and V as the two halves of one
allocation) and fill it; they hand the allocations' descriptors to the "leader" over
SCM_RIGHTS (no ptrace rights needed); the leader imports them, finds V at its offset,
reads the ranks' bytes and writes its own, which the ranks then see. Also: a copy between
two imported buffers (what a transfer backend does), the leader thread's CUDA context is
the same before and after, and memory handed over outlives the rank that sent it.
"""

from __future__ import annotations

import multiprocessing as mp

import torch

from sglang_disagg.ipc import cuda_driver as cu
from sglang_disagg.ipc import cumem, handover

SHAPE = (2, 64, 4096)  # K and V, 512 KiB of bf16 each: several allocation granules on most GPUs
HALF = SHAPE[1] * SHAPE[2] * 2


def _rank(conn, rank: int, value: float) -> None:
    kv = cumem.exportable_zeros(SHAPE, torch.bfloat16, "cuda:0")
    kv[0].fill_(value)
    kv[1].fill_(value + 1)
    torch.cuda.synchronize()
    exports = [cumem.export(kv[0]), cumem.export(kv[1])]
    conn.send(exports)
    address = conn.recv()                        # the leader's inbox (the TP gather, in a server)
    handover.give(address, rank, exports)
    if conn.recv() == "exit-now":
        return                                   # the leader reads after we are gone
    torch.cuda.synchronize()
    conn.send((float(kv[0, 0, 0]), float(kv[1, -1, -1]), float(kv[1, 1, 0])))
    conn.recv()  # keep the process alive until the leader unmapped


def _view(ptr: int) -> torch.Tensor:
    raw = torch.as_tensor(cumem._CudaArray(ptr, (HALF,), "|u1"), device="cuda:0")
    return raw.view(torch.bfloat16).view(SHAPE[1:])


def _start(values: tuple[float, ...]):
    ctx = mp.get_context("spawn")
    ends = [ctx.Pipe() for _ in values]
    procs = [ctx.Process(target=_rank, args=(child, r + 1, v)) for r, ((_, child), v) in enumerate(zip(ends, values))]
    for p in procs:
        p.start()
    inbox = handover.Inbox()
    exports = {r + 1: parent.recv() for r, (parent, _) in enumerate(ends)}
    for parent, _ in ends:
        parent.send(inbox.address)
    try:
        fds = inbox.collect(exports)
    finally:
        inbox.close()
    return ends, procs, exports, fds


def _import(exports, fds) -> tuple[dict[int, list[int]], list[cumem.Imported]]:
    """rank -> [K pointer, V pointer] in this process (one mapping per allocation), and the mappings."""
    out, mapped = {}, []
    for r, (k, v) in exports.items():
        assert k.key == v.key and v.offset == HALF        # V: the second half of the same allocation
        m = cumem.Imported(k, fds[r].pop(k.key))
        mapped.append(m)
        out[r] = [m.base + k.offset, m.base + v.offset]
    return out, mapped


def test_leader_reads_and_writes_the_ranks_kv_with_its_context_kept():
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")              # torch's context is current on this thread
    before = cu.current_device()
    ends, procs, exports, fds = _start((3.0, 7.0))
    try:
        ptrs, mapped = _import(exports, fds)
        assert cu.current_device() == before == 0
        (ak, av), (bk, bv) = ([_view(p) for p in ptrs[r]] for r in (1, 2))
        assert float(ak.float().mean()) == 3.0 and float(av.float().mean()) == 4.0
        assert float(bk.float().mean()) == 7.0 and float(bv.float().mean()) == 8.0
        bk[0].copy_(ak[0])           # device to device between two other processes' pools
        av[1].fill_(5.0)
        torch.cuda.synchronize()
        for parent, _ in ends:
            parent.send("written")
        seen = [parent.recv() for parent, _ in ends]
        assert seen[0] == (3.0, 4.0, 5.0)
        assert seen[1] == (3.0, 8.0, 8.0)
        for m in mapped:
            m.close()
        assert cu.current_device() == 0
    finally:
        for parent, _ in ends:
            parent.send("bye")
        for p in procs:
            p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)


def test_memory_handed_over_outlives_the_rank_that_sent_it():
    ends, procs, exports, fds = _start((2.0,))
    ends[0][0].send("exit-now")
    procs[0].join(timeout=30)
    assert procs[0].exitcode == 0
    ptrs, mapped = _import(exports, fds)
    try:
        k, v = (_view(p) for p in ptrs[1])
        assert float(k.float().mean()) == 2.0 and float(v.float().mean()) == 3.0
    finally:
        for m in mapped:
            m.close()
