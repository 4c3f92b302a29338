"""GPU KV memory another process on the same host can map: the cuMem analogue of shm.py.

The messenger drives every TP rank's KV from one process (the leader). On CPU the ranks'
pools are memfd shared memory (shm.py); on GPU they are allocated here with the CUDA
driver's virtual memory API so they can be handed over as POSIX file descriptors:

    rank r:  exportable_zeros()  cuMemCreate(POSIX_FD) -> reserve -> map -> set access
             export(tensor)      -> Export(pid, key, size, offset, length, device)
             fd(key)             the allocation's descriptor, sent over a Unix socket
                                 (fdpass.py, SCM_RIGHTS: no ptrace rights needed)
    leader:  Imported(exp, fd)   cuMemImportFromShareableHandle -> reserve -> map the WHOLE
                                 allocation -> set access; ``ptr`` = mapping + exp.offset

One allocation may hold several tensors (K and V of a layer are its halves), so export()
finds the allocation *containing* an address (a table of live ranges, bisected by base;
``locate`` is that lookup, a pure function) and says where in it the tensor starts.
Imported mappings enter the same table, so the leader can hand a rank's memory on (the
cudaipc backend serves the descriptor it keeps).

Access is granted to the device the memory lives on and to the importer's device, when
they differ (the leader on GPU 0 copies from rank r's GPU r). Allocations are made
GPUDirect-RDMA capable where the device supports it with cuMem (so an RDMA NIC can
register them). Calls from a thread we do not own save and restore its CUDA context
(cuda_driver.on_device). Every driver error is a CudaError naming the call and the
driver's error name (CuMemError here); no driver: CuMemUnavailable at the first call.

Status: the previous version (pidfd_getfd, data_ptr lookup) ran on an NVIDIA H200 (driver
580.159.04, CUDA 13, torch 2.11) on 2026-11-30 (tests/gpu/test_cumem_ipc.py). This version
(offsets, SCM_RIGHTS, context restore, two-device access, RDMA flag) has not run on a GPU.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import cuda_driver as cu
from .cuda_driver import AccessDesc, AllocationProp  # noqa: F401 - the driver structs, re-exported

CuMemUnavailable = cu.CudaUnavailable
CuMemError = cu.CudaError


@dataclass(frozen=True, slots=True)
class Export:
    """Where one tensor lives inside an exportable allocation (picklable: it travels through
    the TP group; the allocation's descriptor travels separately, over a Unix socket)."""
    pid: int      # the process that holds the allocation (checked against SO_PEERCRED)
    key: int      # the allocation, in that process (see fd())
    size: int     # the allocation's mapped size (granularity-rounded)
    offset: int   # where the tensor starts in it
    length: int   # the tensor's bytes
    device: int   # the device the memory lives on


@dataclass(frozen=True, slots=True)
class _Live:
    base: int
    size: int
    key: int
    device: int
    owner: Any  # the Allocation or Imported behind the range


_table: list[_Live] = []          # sorted by base; ranges never overlap (one address space)
_by_key: dict[int, _Live] = {}
_table_lock = threading.Lock()
_keys = itertools.count(1)


def locate(spans: Sequence[tuple[int, int]], ptr: int, length: int) -> tuple[int, int]:
    """(index, offset) of the span (base, size) holding [ptr, ptr + length); `spans` sorted
    by base, not overlapping. CuMemError when no span holds the whole range."""
    i = bisect.bisect_right(spans, ptr, key=lambda s: s[0]) - 1
    if i < 0 or ptr >= spans[i][0] + spans[i][1]:
        raise CuMemError(f"address {ptr:#x} is not in any exportable cuMem allocation of this process: this memory "
                         "was not allocated by cumem.exportable_zeros (in messenger mode the KV pool is allocated "
                         "through sglang_disagg.hooks.kv_zeros) nor imported with cumem.Imported")
    base, size = spans[i]
    if length <= 0 or ptr + length > base + size:
        raise CuMemError(f"range {ptr:#x}+{length} leaves its cuMem allocation {base:#x}+{size}")
    return i, ptr - base


def _add(base: int, size: int, device: int, owner: Any) -> int:
    with _table_lock:
        live = _Live(base, size, next(_keys), device, owner)
        _table.insert(bisect.bisect_right(_table, base, key=lambda e: e.base), live)
        _by_key[live.key] = live
    return live.key


def _remove(key: int) -> None:
    with _table_lock:
        live = _by_key.pop(key, None)
        if live is not None:
            _table.remove(live)


def export_range(ptr: int, length: int) -> Export:
    with _table_lock:
        i, offset = locate([(e.base, e.size) for e in _table], ptr, length)
        live = _table[i]
    return Export(os.getpid(), live.key, live.size, offset, length, live.device)


def export(tensor: Any) -> Export:
    """The export of a tensor made by exportable_zeros (the KV pool's buffers), or of any
    part of one: a view at an offset inside its allocation (the V half) is found too."""
    return export_range(tensor.data_ptr(), max(1, tensor.numel() * tensor.element_size()))


def fd(key: int) -> int:
    """The descriptor of allocation `key` of this process (stays open; send a copy)."""
    with _table_lock:
        live = _by_key.get(key)
    if live is None:
        raise CuMemError(f"no live cuMem allocation {key} in this process")
    return live.owner.fd()


_rdma: dict[int, bool] = {}


def _prop(device: int) -> AllocationProp:
    prop = AllocationProp()
    prop.type = cu.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = cu.Location(cu.CU_MEM_LOCATION_TYPE_DEVICE, device)
    if device not in _rdma:
        _rdma[device] = bool(cu.attribute(cu.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, device))
    # Without it an RDMA NIC cannot register the memory (the flag is refused where unsupported).
    prop.allocFlags.gpuDirectRDMACapable = int(_rdma[device])
    return prop


def access_descs(devices: Sequence[int]) -> ctypes.Array:
    """Read-write access for each distinct device, in order."""
    unique = list(dict.fromkeys(devices))
    descs = (AccessDesc * len(unique))()
    for i, d in enumerate(unique):
        descs[i] = AccessDesc(cu.Location(cu.CU_MEM_LOCATION_TYPE_DEVICE, d), cu.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return descs


def _round_up(n: int, device: int) -> int:
    gran = ctypes.c_size_t()
    prop = _prop(device)
    cu.check("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop),
             ctypes.c_int(cu.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
    g = gran.value
    return max(g, (n + g - 1) // g * g)


def _map(handle: ctypes.c_ulonglong, size: int, devices: Sequence[int]) -> int:
    ptr = ctypes.c_ulonglong()
    cu.check("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
             ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
    try:
        cu.check("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
        descs = access_descs(devices)
        try:
            cu.check("cuMemSetAccess", ptr, ctypes.c_size_t(size), descs, ctypes.c_size_t(len(descs)))
        except CuMemError:
            cu.driver().cuMemUnmap(ptr, ctypes.c_size_t(size))
            raise
    except CuMemError:
        cu.driver().cuMemAddressFree(ptr, ctypes.c_size_t(size))
        raise
    return ptr.value


class Allocation:
    """Exportable device memory owned by this process: cuMemCreate'd, mapped, zeroed."""

    def __init__(self, nbytes: int, device: int) -> None:
        self.device = device
        with cu.on_device(device):
            self.size = _round_up(nbytes, device)
            self.handle = ctypes.c_ulonglong()
            prop = _prop(device)
            cu.check("cuMemCreate", ctypes.byref(self.handle), ctypes.c_size_t(self.size), ctypes.byref(prop),
                     ctypes.c_ulonglong(0))
            self.ptr = _map(self.handle, self.size, [device])
            cu.check("cuMemsetD8_v2", ctypes.c_ulonglong(self.ptr), ctypes.c_ubyte(0), ctypes.c_size_t(self.size))
        self._fd = -1
        self._lock = threading.Lock()
        self.key = _add(self.ptr, self.size, device, self)

    def fd(self) -> int:
        with self._lock:
            if self._fd < 0:
                out = ctypes.c_int(-1)
                cu.check("cuMemExportToShareableHandle", ctypes.byref(out), self.handle,
                         ctypes.c_int(cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), ctypes.c_ulonglong(0))
                self._fd = out.value
            return self._fd

    def export(self) -> Export:
        return Export(os.getpid(), self.key, self.size, 0, self.size, self.device)


class Imported:
    """Another process's allocation mapped whole into this one (the messenger leader, or a
    same-host peer). Takes ownership of `fd` (kept open so this process can hand the memory
    on; closed by close()). ``ptr`` is where the exported tensor starts; ``base`` the mapping."""

    def __init__(self, exp: Export, fd: int, device: int | None = None) -> None:
        try:
            if device is None:
                device = cu.current_device()
            self.importer = exp.device if device is None else device
            self.device, self.size, self._fd = exp.device, exp.size, fd
            self.handle = ctypes.c_ulonglong()
            with cu.on_device(self.importer):
                cu.check("cuMemImportFromShareableHandle", ctypes.byref(self.handle), ctypes.c_void_p(fd),
                         ctypes.c_int(cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
                try:
                    self.base = _map(self.handle, self.size, [exp.device, self.importer])
                except BaseException:
                    cu.driver().cuMemRelease(self.handle)
                    raise
        except BaseException:
            os.close(fd)
            raise
        self.ptr = self.base + exp.offset
        self.key = _add(self.base, self.size, self.device, self)
        self._closed = False

    def fd(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _remove(self.key)
        lib = cu.driver()
        with cu.on_device(self.importer):
            lib.cuMemUnmap(ctypes.c_ulonglong(self.base), ctypes.c_size_t(self.size))
            lib.cuMemAddressFree(ctypes.c_ulonglong(self.base), ctypes.c_size_t(self.size))
            lib.cuMemRelease(self.handle)
        os.close(self._fd)


class _CudaArray:
    """Just enough __cuda_array_interface__ for torch.as_tensor to wrap a device pointer."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3}


def exportable_zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
    """A zeroed torch tensor on `device` whose memory export() can hand to another process.
    The allocation lives as long as the process (the KV pool's does)."""
    import torch

    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    alloc = Allocation(max(1, numel * itemsize), index)
    # Wrapped as raw bytes, then viewed as `dtype`: typestr cannot name bfloat16.
    raw = torch.as_tensor(_CudaArray(alloc.ptr, (numel * itemsize,), "|u1"), device=dev)
    return raw.view(dtype).view(shape)
