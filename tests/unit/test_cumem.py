"""cumem.py, the GPU path of one messenger per server.

Without a GPU: the driver structs match the CUDA 12/13 ABI; the allocation lookup (a pure
function) finds a tensor inside its allocation at an offset (the V half of a K|V
allocation); what cumem hands the driver for device memory - access for the owner's and
the importer's device, the GPUDirect RDMA flag, the caller's context restored - is checked
against an isolated recorder of the driver calls (no GPU here; the real thing runs in
tests/gpu). With a GPU driver, an exported buffer imported again is the same memory;
without one the first call says so clearly.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from sglang_disagg.ipc import cuda_driver as cu
from sglang_disagg.ipc import cumem


def test_driver_structs_have_the_cuda_12_layout():
    assert ctypes.sizeof(cumem.AllocationProp) == 32  # int, int, CUmemLocation, void*, allocFlags
    assert cumem.AllocationProp.win32HandleMetaData.offset == 16
    assert cu.AllocFlags.gpuDirectRDMACapable.offset == 1
    assert ctypes.sizeof(cumem.AccessDesc) == 12


# ----- the lookup: which allocation holds a range, and where -----------------------------
SPANS = [(0x10000, 0x4000), (0x20000, 0x2000), (0x30000, 0x8000)]  # (base, size), sorted


@pytest.mark.parametrize("ptr,length,expected", [
    (0x10000, 0x2000, (0, 0)),          # K: the first half of an allocation
    (0x12000, 0x2000, (0, 0x2000)),     # V: the second half, found by address, not by data_ptr
    (0x21fff, 1, (1, 0x1fff)),          # last byte
    (0x34000, 0x4000, (2, 0x4000)),
])
def test_a_range_is_found_inside_its_allocation_at_its_offset(ptr, length, expected):
    assert cumem.locate(SPANS, ptr, length) == expected


@pytest.mark.parametrize("ptr,length,why", [
    (0x0fff, 1, "not in any"),            # before the first allocation
    (0x14000, 1, "not in any"),           # in the gap after one
    (0x40000, 16, "not in any"),          # past the last
    (0x12000, 0x2001, "leaves its cuMem allocation"),  # runs past the end of its allocation
    (0x10000, 0, "leaves its cuMem allocation"),
])
def test_a_range_outside_every_allocation_is_refused(ptr, length, why):
    with pytest.raises(cumem.CuMemError, match=why):
        cumem.locate(SPANS, ptr, length)


def test_nothing_is_found_in_an_empty_table():
    with pytest.raises(cumem.CuMemError, match="exportable_zeros"):
        cumem.locate([], 0x1000, 1)


def test_a_tensor_not_allocated_here_cannot_be_exported():
    with pytest.raises(cumem.CuMemError, match="not allocated by cumem"):
        cumem.export(torch.zeros(4))


def test_access_is_granted_once_per_distinct_device():
    descs = cumem.access_descs([3, 0])
    assert [(d.location.type, d.location.id, d.flags) for d in descs] == [(1, 3, 3), (1, 0, 3)]
    assert len(cumem.access_descs([2, 2])) == 1


# ----- what cumem passes the driver (isolated recorder of libcuda; no GPU here) ----------
class _Recorder:
    """Answers libcuda calls as a driver with `devices` GPUs would, and records them.
    Primary context of device d: 0x1000 + d; `current` is the calling thread's context."""

    def __init__(self, current: int, rdma: bool) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.current, self.rdma = current, rdma

    def __getattr__(self, name: str):
        def call(*args):
            self.calls.append((name, args))
            out = getattr(args[0], "_obj", None) if args else None
            if name == "cuDeviceGet":
                out.value = args[1].value
            elif name == "cuDevicePrimaryCtxRetain":
                out.value = 0x1000 + args[1].value
            elif name == "cuCtxGetCurrent":
                out.value = self.current
            elif name == "cuCtxSetCurrent":
                self.current = args[0].value or 0
            elif name == "cuCtxGetDevice":
                out.value = self.current - 0x1000
            elif name == "cuDeviceGetAttribute":
                out.value = int(self.rdma)
            elif name == "cuMemGetAllocationGranularity":
                out.value = 2 << 20
            elif name == "cuMemAddressReserve":
                out.value = 0x7f0000000000
            return 0
        return call

    def named(self, name: str) -> list[tuple]:
        return [args for n, args in self.calls if n == name]


@pytest.fixture
def driver(monkeypatch):
    def make(current: int, rdma: bool = True) -> _Recorder:
        rec = _Recorder(current, rdma)
        monkeypatch.setattr(cu, "_lib", rec)
        monkeypatch.setattr(cu, "_primary", {})
        monkeypatch.setattr(cumem, "_rdma", {})
        return rec
    return make


def _access(rec: _Recorder) -> list[int]:
    (ptr, size, descs, count), = rec.named("cuMemSetAccess")
    return [descs[i].location.id for i in range(count.value)]


def test_import_grants_the_owners_and_the_importers_device_and_keeps_the_context(driver):
    rec = driver(current=0x1000)  # the leader's thread: torch made cuda:0's primary context current
    r, w = os.pipe()
    os.close(w)
    exp = cumem.Export(pid=1, key=7, size=4 << 20, offset=2 << 20, length=2 << 20, device=3)
    m = cumem.Imported(exp, r)
    try:
        assert _access(rec) == [3, 0]                       # rank 3's GPU, and the leader's GPU 0
        assert m.base == 0x7f0000000000 and m.ptr == m.base + (2 << 20)  # the V half, not the K half
        assert rec.named("cuCtxSetCurrent") == []            # already current: never switched
        assert cumem.export_range(m.ptr, 2 << 20).offset == 2 << 20   # imported memory is exportable again
        assert cumem.fd(cumem.export_range(m.ptr, 1).key) == r
    finally:
        m.close()
    with pytest.raises(OSError):
        os.fstat(r)  # close() closed the descriptor it owned


def test_a_driver_call_from_a_foreign_thread_restores_its_context(driver):
    rec = driver(current=0x9999)  # some other context is current on this thread
    r, w = os.pipe()
    os.close(w)
    m = cumem.Imported(cumem.Export(1, 7, 2 << 20, 0, 2 << 20, 1), r, device=2)
    m.close()
    switches = [args[0].value for args in rec.named("cuCtxSetCurrent")]
    assert switches == [0x1002, 0x9999, 0x1002, 0x9999]  # import, then close: each put back
    assert _access(rec) == [1, 2]


@pytest.mark.parametrize("supported", [True, False])
def test_allocations_are_rdma_capable_where_the_device_supports_it(driver, supported):
    rec = driver(current=0, rdma=supported)
    a = cumem.Allocation(3 << 20, 0)
    try:
        (_, _, prop, _), = rec.named("cuMemCreate")
        assert prop._obj.allocFlags.gpuDirectRDMACapable == int(supported)
        assert a.size == 4 << 20 and _access(rec) == [0]
        assert cumem.export_range(a.ptr + (1 << 20), 4096) == cumem.Export(os.getpid(), a.key, 4 << 20, 1 << 20,
                                                                            4096, 0)
    finally:
        cumem._remove(a.key)


# ----- with a GPU driver: the real thing --------------------------------------------------
def _driver_present() -> bool:
    try:
        cu.driver()
        return torch.cuda.is_available()
    except cumem.CuMemUnavailable:
        return False


def test_an_exported_buffer_imported_again_is_the_same_memory_or_a_clear_error():
    if not _driver_present():
        with pytest.raises(cumem.CuMemUnavailable, match="CUDA driver|cuInit"):
            cumem.exportable_zeros((4, 256), torch.bfloat16, "cuda:0")
        return
    kv = cumem.exportable_zeros((2, 4, 256), torch.bfloat16, "cuda:0")  # K and V: halves of one allocation
    kv.fill_(3)
    kv[1].fill_(4)
    torch.cuda.synchronize()
    exp = cumem.export(kv[1])
    assert exp.offset == kv[1].data_ptr() - kv.data_ptr() and exp.length == 4 * 256 * 2
    imported = cumem.Imported(exp, os.dup(cumem.fd(exp.key)))
    try:
        view = torch.as_tensor(cumem._CudaArray(imported.ptr, (exp.length,), "|u1"), device=kv.device)
        view = view.view(torch.bfloat16).view(kv[1].shape)
        assert torch.equal(view, kv[1])
        view[1].fill_(5)
        torch.cuda.synchronize()
        assert int(kv[1, 1, 0]) == 5 and int(kv[1, 0, 0]) == 4 and int(kv[0, 1, 0]) == 3
    finally:
        imported.close()
