"""cumem.py across processes, as one messenger per server uses it on GPU: a "rank" process
allocates exportable KV memory and fills it; the "leader" imports it through
pidfd_getfd + cuMemImportFromShareableHandle, reads the rank's bytes and writes its own,
which the rank then sees. Also: a copy between two imported buffers (what a transfer
backend does with registered memory) and a clear error for a descriptor that is gone."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from sglang_disagg import cumem

SHAPE = (64, 4096)  # 1 MiB of bf16: several allocation granules on most GPUs


def _rank(conn, value: float) -> None:
    t = cumem.exportable_zeros(SHAPE, torch.bfloat16, "cuda:0")
    t.fill_(value)
    torch.cuda.synchronize()
    conn.send(cumem.export(t))
    assert conn.recv() == "written"
    torch.cuda.synchronize()
    conn.send((float(t[0, 0]), float(t[-1, -1]), float(t[1, 0])))
    conn.recv()  # keep the memory alive until the leader unmapped it


def _view(imported: cumem.Imported) -> torch.Tensor:
    n = SHAPE[0] * SHAPE[1] * 2
    raw = torch.as_tensor(cumem._CudaArray(imported.ptr, (n,), "|u1"), device="cuda:0")
    return raw.view(torch.bfloat16).view(SHAPE)


def test_leader_reads_and_writes_a_rank_processes_kv():
    ctx = mp.get_context("spawn")
    ends = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(child, v)) for (_, child), v in zip(ends, (3.0, 7.0))]
    for p in procs:
        p.start()
    try:
        exports = [parent.recv() for parent, _ in ends]
        assert exports[0].pid != exports[1].pid
        imported = [cumem.Imported(e) for e in exports]
        a, b = (_view(i) for i in imported)
        assert float(a.float().mean()) == 3.0 and float(b.float().mean()) == 7.0
        b[0].copy_(a[0])          # device-to-device between two other processes' pools
        a[1].fill_(5.0)
        torch.cuda.synchronize()
        for parent, _ in ends:
            parent.send("written")
        seen = [parent.recv() for parent, _ in ends]
        assert seen[0] == (3.0, 3.0, 5.0)
        assert seen[1] == (3.0, 7.0, 7.0)
        for i in imported:
            i.close()
    finally:
        for parent, _ in ends:
            parent.send("bye")
        for p in procs:
            p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)


def test_importing_from_a_process_that_is_gone_is_a_clear_error():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_rank, args=(child, 1.0))
    p.start()
    exp = parent.recv()
    parent.send("written")
    parent.recv()
    parent.send("bye")
    p.join(timeout=30)
    with pytest.raises((cumem.CuMemError, ProcessLookupError, OSError)):
        cumem.Imported(exp)
