"""CPU twin: the word is a CPU tensor the forward's op writes; a waiter blocks on a condition.

CPU ops run synchronously in the thread that issues them, so `bump()` has written the word
when it returns; it then wakes the waiters, which re-read the word (the wake-up is a hint,
never the value). No graphs exist on CPU, so the Python wake-up at hook time is sound here;
the value the streamer acts on is still the word the op wrote, as on CUDA.
"""

from __future__ import annotations

import threading

import torch

from ..backends.regions import HOST, Memory
from .base import Device, Fence, LayerWord


class CpuWord(LayerWord):
    def __init__(self) -> None:
        self.tensor = torch.zeros(1, dtype=torch.int64)
        self._view = self.tensor.numpy()  # the same memory: a read without the torch dispatcher
        self._cv = threading.Condition()

    def bump(self) -> None:
        self.tensor.add_(1)
        with self._cv:
            self._cv.notify_all()

    def arm(self, base: int) -> None:
        self.tensor.fill_(base)

    def read(self) -> int:
        return int(self._view[0])

    def wait_at_least(self, target: int, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.read() >= target, timeout_s)

    def close(self) -> None:
        with self._cv:
            self._cv.notify_all()


class CpuFence(Fence):
    def record(self) -> None:
        pass

    def wait(self, timeout_s: float) -> bool:
        return True


class CpuDevice(Device):
    name = "cpu"

    def layer_word(self) -> LayerWord:
        return CpuWord()

    def fence(self) -> Fence:
        return CpuFence()

    def memory(self) -> Memory:
        return HOST
