"""Device twins: the few device-specific pieces of the messenger, behind one interface.

The messenger's logic is the same on every device; what differs is how a forward tells a
host thread that a layer is done (`LayerWord`), how the host learns that a forward has
finished on the device (`Fence`), and which memory kind the KV pool is (`memory()`). Each
device has one small module with those three; nothing else in the messenger asks which
device it runs on.

    from sglang_disagg.devices import for_device
    dev = for_device("cuda:0")      # or "cpu"
    word = dev.layer_word()         # bumped by the forward, read by the streamer
    fence = dev.fence()             # recorded at a forward's end, waited before posting

Modules are imported lazily (a CUDA twin imports nothing CUDA-specific on a CPU machine
until it is asked for).
"""

from __future__ import annotations

import importlib

from .base import Device, Fence, LayerWord

__all__ = ["Device", "Fence", "LayerWord", "for_device", "known_devices"]

_TWINS = {"cpu": "sglang_disagg.devices.cpu:CpuDevice", "cuda": "sglang_disagg.devices.cuda:CudaDevice"}


def known_devices() -> list[str]:
    return sorted(_TWINS)


def for_device(device: object) -> Device:
    """The twin for a torch device or its name ('cpu', 'cuda', 'cuda:1')."""
    name = str(device)
    kind, _, index = name.partition(":")
    if kind not in _TWINS:
        raise ValueError(f"no messenger device twin for {name!r}; known: {', '.join(known_devices())}")
    if index and not index.isdigit():
        raise ValueError(f"device {name!r}: the index after ':' must be a number")
    module, _, cls = _TWINS[kind].partition(":")
    return getattr(importlib.import_module(module), cls)(int(index) if index else 0)
