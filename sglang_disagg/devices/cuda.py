"""CUDA twin: the word lives in pinned, device-mapped host memory; the forward's kernels write it.

`bump()` and `arm()` are torch kernels (`add_`, `fill_`) on a CUDA tensor whose storage is
that host word: they run in stream order after the layer's o_proj kernels, and a CUDA graph
captured with the hook records them as kernel nodes, so every replay increments the word
(a Python hook's own side effects would not replay: that is why nothing else happens at
hook time). The host reads the word with a plain load; x86 snoops PCIe writes into host
memory, so a value the host sees was written by a kernel that ran after every kernel
before it in the stream had finished, i.e. after the layer's K and V were in the pool.
This follows the production design (4 KiB of host-mapped pinned memory written by the
GPU, polled by a host thread) and pplx-garden's scalar watcher.

Pinned memory from cudaHostAlloc is mapped into the device's address space at the same
virtual address under unified addressing (every 64-bit CUDA platform), so the device view
is the host pointer wrapped through `__cuda_array_interface__`; torch checks that the
pointer is registered with CUDA (cudaPointerGetAttributes) and refuses it otherwise.

The poller is a Python thread: a pure spin would hold the GIL the scheduler needs, so it
sleeps POLL_S between reads (Linux sleeps ~60 us for that). A native pinned poller, as in
the production system, would cut that latency; it has not been needed for correctness.

Status: not run on a GPU yet (docs/gpu.md); the device check exercises it.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

from ..backends.regions import Memory, cuda
from .base import Device, Fence, LayerWord

POLL_S = 20e-6


class _DeviceView:
    """The minimal __cuda_array_interface__ (v3) of one int64 at a device-visible address."""

    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": "<i8", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


class CudaWord(LayerWord):
    def __init__(self, index: int) -> None:
        import torch

        self._host = torch.zeros(8, dtype=torch.int64, pin_memory=True)  # 64 bytes: its own cache line
        ptr = self._host.data_ptr()
        self.tensor = torch.as_tensor(_DeviceView(ptr), device=f"cuda:{index}")
        if self.tensor.data_ptr() != ptr:
            raise RuntimeError(f"cuda:{index}: the pinned word's device address differs from its host address "
                               "(no unified addressing?); the layer counter cannot be mapped")
        self._word = ctypes.c_int64.from_address(ptr)
        self._closed = False

    def bump(self) -> None:
        self.tensor.add_(1)

    def arm(self, base: int) -> None:
        self.tensor.fill_(base)

    def read(self) -> int:
        return self._word.value

    def wait_at_least(self, target: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._word.value < target:
            if self._closed or time.monotonic() > deadline:
                return self._word.value >= target
            time.sleep(POLL_S)
        return True

    def close(self) -> None:
        self._closed = True


class CudaFence(Fence):
    def __init__(self, index: int) -> None:
        import torch

        self._torch, self._index = torch, index
        self._event: Any = None

    def record(self) -> None:
        torch = self._torch
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self._index))

    def wait(self, timeout_s: float) -> bool:
        if self._event is None:
            return True
        deadline = time.monotonic() + timeout_s
        while not self._event.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True


class CudaDevice(Device):
    name = "cuda"

    def layer_word(self) -> LayerWord:
        return CudaWord(self.index)

    def fence(self) -> Fence:
        return CudaFence(self.index)

    def memory(self) -> Memory:
        return cuda(self.index)
