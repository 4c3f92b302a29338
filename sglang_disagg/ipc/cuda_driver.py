"""The CUDA driver API (libcuda) through ctypes: loading, errors, contexts, streams, events.

Everything CUDA in this package that is not torch goes through here (cumem.py, the cudaipc
backend), so there is one place that turns a CUresult into an exception: every call other
than CUDA_SUCCESS raises CudaError naming the call and the driver's error name; a machine
without a driver (or without a GPU) raises CudaUnavailable at the first call.

Contexts: driver calls act on the calling thread's current context. Code that runs on a
thread it does not own (the scheduler's, the messenger leader's) uses ``on_device(d)``,
which makes device d's primary context (the one torch uses) current and restores whatever
was current before, so torch on that thread never finds its context switched under it.

Names are the versioned symbols the CUDA headers map to (cuMemcpyDtoDAsync_v2 and so on):
the unversioned ones are the 32-bit-pointer ABI kept for old binaries.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import threading
from collections.abc import Iterator
from typing import Any

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
CU_STREAM_NON_BLOCKING = 1
CU_EVENT_BLOCKING_SYNC = 1   # the waiting thread sleeps instead of spinning a core
CU_EVENT_DISABLE_TIMING = 2


class CudaUnavailable(RuntimeError):
    """No CUDA driver on this machine (or it cannot be initialised, or it sees no GPU)."""


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


class Location(ctypes.Structure):
    """CUmemLocation."""
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    """CUmemAllocationProp."""
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


_lib: Any = None
_lib_lock = threading.Lock()
_ctx_lock = threading.Lock()
_primary: dict[int, ctypes.c_void_p] = {}  # device ordinal -> its retained primary context


def driver() -> Any:
    """libcuda, initialised (CudaUnavailable if there is none or cuInit fails)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            name = ctypes.util.find_library("cuda") or "libcuda.so.1"
            try:
                lib = ctypes.CDLL(name)
            except OSError as e:
                raise CudaUnavailable(f"no CUDA driver library ({name}): {e}") from None
            rc = lib.cuInit(0)
            if rc != 0:
                raise CudaUnavailable(f"cuInit failed with CUresult {rc} ({error_name(lib, rc)})")
            _lib = lib
    return _lib


def error_name(lib: Any, rc: int) -> str:
    s = ctypes.c_char_p()
    if lib.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
        return s.value.decode()
    return "unknown"


def check(call: str, *args: Any) -> None:
    lib = driver()
    rc = getattr(lib, call)(*args)
    if rc != 0:
        raise CudaError(f"{call} failed: {error_name(lib, rc)} (CUresult {rc})")


def device_count() -> int:
    n = ctypes.c_int()
    check("cuDeviceGetCount", ctypes.byref(n))
    return n.value


def primary_context(device: int) -> ctypes.c_void_p:
    """Device `device`'s primary context, retained once per process (torch shares it)."""
    with _ctx_lock:
        ctx = _primary.get(device)
    if ctx is None:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        check("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(device))
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        with _ctx_lock:
            if device in _primary:  # another thread retained it first: keep one reference
                driver().cuDevicePrimaryCtxRelease_v2(dev)
                ctx = _primary[device]
            else:
                _primary[device] = ctx
    return ctx


def current_device() -> int | None:
    """The device of this thread's current context, or None when it has none."""
    ctx = ctypes.c_void_p()
    check("cuCtxGetCurrent", ctypes.byref(ctx))
    if not ctx.value:
        return None
    dev = ctypes.c_int()
    check("cuCtxGetDevice", ctypes.byref(dev))
    return dev.value


@contextlib.contextmanager
def on_device(device: int) -> Iterator[None]:
    """Run the block with `device`'s primary context current; restore the previous one."""
    target = primary_context(device)
    prev = ctypes.c_void_p()
    check("cuCtxGetCurrent", ctypes.byref(prev))
    switch = prev.value != target.value
    if switch:
        check("cuCtxSetCurrent", target)
    try:
        yield
    finally:
        if switch:
            check("cuCtxSetCurrent", prev)


def attribute(attr: int, device: int) -> int:
    value, dev = ctypes.c_int(), ctypes.c_int()
    check("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(device))
    check("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(attr), dev)
    return value.value


class Stream:
    """A non-blocking stream of its own (no implicit sync with torch's default stream)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.handle = ctypes.c_void_p()
        with on_device(device):
            check("cuStreamCreate", ctypes.byref(self.handle), ctypes.c_uint(CU_STREAM_NON_BLOCKING))

    def copy(self, dst: int, src: int, n: int) -> None:
        """Enqueue a device-to-device copy (any two addresses mapped for this device)."""
        check("cuMemcpyDtoDAsync_v2", ctypes.c_ulonglong(dst), ctypes.c_ulonglong(src), ctypes.c_size_t(n),
              self.handle)

    def record(self) -> Event:
        ev = Event()
        check("cuEventRecord", ev.handle, self.handle)
        return ev

    def synchronize(self) -> None:
        with on_device(self.device):
            check("cuStreamSynchronize", self.handle)

    def destroy(self) -> None:
        if self.handle.value:
            with on_device(self.device):
                check("cuStreamDestroy_v2", self.handle)
            self.handle = ctypes.c_void_p()


class Event:
    """A completion marker; wait() blocks the calling thread (sleeping, not spinning).
    Made (by Stream.record) in the current context: call that under on_device."""

    def __init__(self) -> None:
        self.handle = ctypes.c_void_p()
        check("cuEventCreate", ctypes.byref(self.handle), ctypes.c_uint(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING))

    def wait(self) -> None:
        check("cuEventSynchronize", self.handle)

    def destroy(self) -> None:
        if self.handle.value:
            driver().cuEventDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()
