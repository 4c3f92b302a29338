"""GPU KV memory another process on the same host can map: the cuMem analogue of shm.py.

The messenger drives every TP rank's KV from one process (the leader). On CPU the ranks'
pools are memfd shared memory (shm.py); on GPU they are allocated here with the CUDA
driver's virtual memory API so they can be exported as POSIX file descriptors:

    rank r:  exportable_zeros()  cuMemCreate(POSIX_FD) -> reserve -> map -> set access
             export(ptr)         -> Export(pid, fd, size, device)   (fd stays open in rank r)
    leader:  Imported(export)    pidfd_getfd(pid, fd) -> cuMemImportFromShareableHandle
                                 -> reserve -> map -> set access: a device pointer into
                                 rank r's pool that the leader's backend can register.

Everything goes through the driver library (libcuda) with ctypes; every CUresult other
than CUDA_SUCCESS raises CuMemError naming the call and the driver's error name. On a
machine without a GPU driver, CuMemUnavailable says so at the first call.

Status: run on an NVIDIA H200 (driver 580.159.04, CUDA 13 torch 2.11, kernel 6.18) on
2026-11-30: tests/unit/test_cumem.py and tests/gpu/test_cumem_ipc.py (two rank processes
exported, imported by a third, read, written, copied device to device) passed. The
SGLang server path on GPU (KV pool through hooks.kv_zeros) has not run on a GPU yet.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass
from typing import Any

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
SYS_PIDFD_GETFD = 438  # x86_64 and aarch64


class CuMemUnavailable(RuntimeError):
    """No CUDA driver on this machine (or it cannot be initialised)."""


class CuMemError(RuntimeError):
    """A CUDA driver call failed."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    """CUmemAllocationProp."""
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class AccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib: Any = None
_lib_lock = threading.Lock()


def _driver() -> Any:
    global _lib
    with _lib_lock:
        if _lib is None:
            name = ctypes.util.find_library("cuda") or "libcuda.so.1"
            try:
                lib = ctypes.CDLL(name)
            except OSError as e:
                raise CuMemUnavailable(f"no CUDA driver library ({name}): {e}") from None
            rc = lib.cuInit(0)
            if rc != 0:
                raise CuMemUnavailable(f"cuInit failed with CUresult {rc} ({_name(lib, rc)})")
            _lib = lib
    return _lib


def _name(lib: Any, rc: int) -> str:
    s = ctypes.c_char_p()
    if lib.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
        return s.value.decode()
    return "unknown"


def _check(call: str, *args: Any) -> None:
    lib = _driver()
    rc = getattr(lib, call)(*args)
    if rc != 0:
        raise CuMemError(f"{call} failed: {_name(lib, rc)} (CUresult {rc})")


def _use_device(device: int) -> None:
    """Make the device's primary context current (the one torch uses), so driver calls
    made from any thread act on the same context as the KV tensors."""
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(device))
    _check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    _check("cuCtxSetCurrent", ctx)


def _prop(device: int) -> AllocationProp:
    prop = AllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, device)
    return prop


def _round_up(n: int, device: int) -> int:
    gran = ctypes.c_size_t()
    prop = _prop(device)
    _check("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop),
           ctypes.c_int(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
    g = gran.value
    return max(g, (n + g - 1) // g * g)


def _map(handle: ctypes.c_ulonglong, size: int, device: int) -> int:
    ptr = ctypes.c_ulonglong()
    _check("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
           ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
    try:
        _check("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
        access = AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, device), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        _check("cuMemSetAccess", ptr, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1))
    except CuMemError:
        _driver().cuMemAddressFree(ptr, ctypes.c_size_t(size))
        raise
    return ptr.value


@dataclass(frozen=True, slots=True)
class Export:
    """How the leader imports one rank's allocation (picklable: sent through the TP group)."""
    pid: int
    fd: int      # a descriptor number in `pid`
    size: int    # the mapped size (granularity-rounded)
    device: int  # the device the memory lives on


class Allocation:
    """Exportable device memory owned by this process: cuMemCreate'd, mapped, zeroed."""

    def __init__(self, nbytes: int, device: int) -> None:
        _use_device(device)
        self.device, self.size = device, _round_up(nbytes, device)
        self.handle = ctypes.c_ulonglong()
        prop = _prop(device)
        _check("cuMemCreate", ctypes.byref(self.handle), ctypes.c_size_t(self.size), ctypes.byref(prop),
               ctypes.c_ulonglong(0))
        self.ptr = _map(self.handle, self.size, device)
        _check("cuMemsetD8_v2", ctypes.c_ulonglong(self.ptr), ctypes.c_ubyte(0), ctypes.c_size_t(self.size))
        self._fd = -1

    def export(self) -> Export:
        if self._fd < 0:
            fd = ctypes.c_int(-1)
            _check("cuMemExportToShareableHandle", ctypes.byref(fd), self.handle,
                   ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), ctypes.c_ulonglong(0))
            self._fd = fd.value
        return Export(os.getpid(), self._fd, self.size, self.device)


class Imported:
    """Another process's allocation mapped into this one (the messenger leader)."""

    def __init__(self, exp: Export, device: int | None = None) -> None:
        device = exp.device if device is None else device
        _use_device(device)
        fd = _take_fd(exp.pid, exp.fd)
        self.handle = ctypes.c_ulonglong()
        try:
            _check("cuMemImportFromShareableHandle", ctypes.byref(self.handle), ctypes.c_void_p(fd),
                   ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        finally:
            os.close(fd)  # the handle holds the memory now
        self.size = exp.size
        self.ptr = _map(self.handle, self.size, device)

    def close(self) -> None:
        lib = _driver()
        lib.cuMemUnmap(ctypes.c_ulonglong(self.ptr), ctypes.c_size_t(self.size))
        lib.cuMemAddressFree(ctypes.c_ulonglong(self.ptr), ctypes.c_size_t(self.size))
        lib.cuMemRelease(self.handle)


def _take_fd(pid: int, fd: int) -> int:
    """A duplicate of descriptor `fd` of process `pid` (same host, same user, Linux >= 5.6)."""
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        got = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise CuMemError(f"pidfd_getfd({pid}, {fd}) failed: {os.strerror(err)} (ptrace access to the rank "
                             "process is needed: same user, and kernel.yama.ptrace_scope <= 1)")
        return got
    finally:
        os.close(pidfd)


_keep: dict[int, Allocation] = {}  # data_ptr -> the allocation behind an exportable tensor


class _CudaArray:
    """Just enough __cuda_array_interface__ for torch.as_tensor to wrap a device pointer."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3}


def exportable_zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
    """A zeroed torch tensor on `device` whose memory export() can hand to another process."""
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
    tensor = raw.view(dtype).view(shape)
    _keep[tensor.data_ptr()] = alloc
    return tensor


def export(tensor: Any) -> Export:
    """The export of a tensor made by exportable_zeros (the KV pool's buffers)."""
    alloc = _keep.get(tensor.data_ptr())
    if alloc is None:
        raise CuMemError("this tensor was not allocated by cumem.exportable_zeros, so it cannot be exported "
                         "(in messenger mode the KV pool is allocated through sglang_disagg.hooks.kv_zeros)")
    return alloc.export()
