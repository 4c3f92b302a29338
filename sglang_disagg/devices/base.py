"""The interface every device twin implements (cpu.py, cuda.py).

Contract of a `LayerWord` (one 64-bit word, written by device work, read by a host thread):
- `bump()` is called by the forward (a hook after each attention layer's o_proj). It issues
  *device work* that adds one to the word in stream order, after that layer's kernels: a
  CUDA graph captured with it replays the increment; Python side effects of the hook do
  not replay, so nothing the streamer relies on may happen in Python at hook time.
- `arm(base)` is called by the scheduler before a forward it announces: it issues device
  work, in the same stream order, setting the word to `base`. Bases grow by `STRIDE` per
  armed forward, so a value left over from an earlier forward (or written by a forward no
  one announced, e.g. a warm-up) is always below the current base: the streamer never
  mistakes an old forward's progress for the current one's.
- `read()` returns the word as the device last wrote it, from host memory the device writes
  (never a Python mirror bumped at enqueue time).
- `wait_at_least(target, timeout_s)` blocks the calling host thread until `read() >= target`
  or the timeout: on CPU without spinning (the 2-core machine would show it), on CUDA by
  polling (a dedicated thread may busy-poll a GPU host's core).

A `Fence` is a point in the forward's stream: `record()` at the forward's end (scheduler
thread), `wait(timeout_s)` from any thread returns True once all device work before the
record has finished. On CPU forwards are synchronous: record and wait cost nothing. The
prefill messenger records one after each forward and waits on it before posting what the
forward's end proves (`--no-stream`'s pages, other TP ranks' last layer).

Decoder side: a request is handed to the scheduler when the expected count of immediates
arrived, and each backend sends or raises an immediate only once its write's data is in
the decoder's memory: cudaipc sends the immediates of a batch after the CUDA event
recorded behind its copies completed; NIXL/UCX notifies after the transfer completed;
libfabric raises the remote CQ data completion at the target after the data was placed.
The decoder's kernels, issued after the hand-off, then read complete KV. (With GPUDirect
RDMA into GPU memory some NICs need a flush for ordering; not verified on a GPU.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

STRIDE = 1 << 32  # per armed forward; far more than any number of layer bumps in between


class LayerWord(ABC):
    @abstractmethod
    def bump(self) -> None: ...
    @abstractmethod
    def arm(self, base: int) -> None: ...
    @abstractmethod
    def read(self) -> int: ...
    @abstractmethod
    def wait_at_least(self, target: int, timeout_s: float) -> bool: ...

    def close(self) -> None:
        """Wake any waiter (it then re-reads the word and times out or returns)."""


class Fence(ABC):
    @abstractmethod
    def record(self) -> None: ...
    @abstractmethod
    def wait(self, timeout_s: float) -> bool: ...


class Device(ABC):
    """One device's twins."""

    name: str

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @abstractmethod
    def layer_word(self) -> LayerWord: ...
    @abstractmethod
    def fence(self) -> Fence: ...
    @abstractmethod
    def memory(self) -> Any:
        """The backends' `Memory` for KV pool buffers on this device."""
