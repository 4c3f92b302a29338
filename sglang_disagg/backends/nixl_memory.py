"""NIXL memory types for the contract's memory kinds, in registrations and transfer lists.

NIXL names a segment's memory "DRAM" (host) or "VRAM" (CUDA device memory) and every
descriptor carries a device id: the CUDA ordinal for VRAM, 0 for DRAM. With UCX, VRAM on
one node goes over cuda_ipc / cuda_copy (nixl-cu13 ships UCX's CUDA transports).
- A region descriptor carries its segment in `extra` ("mem", "dev"): the writer builds the
  remote list with the peer's type, which it cannot know otherwise.
- A NIXL transfer list has one memory type: a batch whose sources (or destinations) mix
  host and device regions is refused before anything is posted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import DescriptorError
from .regions import Memory, MemoryKind, PageWrite

DRAM, VRAM = "DRAM", "VRAM"


def segment(memory: Memory) -> tuple[str, int]:
    """(NIXL memory type, device id) for a region of `memory`."""
    return (DRAM, 0) if memory.kind is MemoryKind.HOST else (VRAM, memory.device)


def descriptor_fields(memory: Memory) -> dict[str, Any]:
    mem, dev = segment(memory)
    return {"mem": mem, "dev": dev}


def remote_segment(extra: Mapping[str, Any]) -> tuple[str, int]:
    """The segment a peer's descriptor names, validated (it came from the network)."""
    mem, dev = extra.get("mem"), extra.get("dev")
    if mem not in (DRAM, VRAM) or not isinstance(dev, int) or isinstance(dev, bool) or dev < 0 \
            or (mem == DRAM and dev != 0):
        raise DescriptorError(f"NIXL descriptor names memory {mem!r} device {dev!r}; "
                              "need DRAM with device 0 or VRAM with a CUDA ordinal")
    return mem, dev


def _one_type(side: str, types: set[str]) -> str:
    if len(types) != 1:
        raise DescriptorError(f"NIXL batch mixes {' and '.join(sorted(types))} {side} regions; "
                              "one transfer has one memory type per side: post them as separate batches")
    return types.pop()


def transfer_lists(writes: Sequence[PageWrite], addr_of: Mapping[int, int]) -> tuple[list, str, list, str]:
    """(local list, local type, remote list, remote type) for one NIXL WRITE transfer;
    `addr_of` maps a local region id to its address."""
    src = {w.src.id: segment(w.src.memory) for w in writes}
    dst = {id(w.dst): remote_segment(w.dst.descriptor.extra) for w in writes}
    local_type = _one_type("source", {m for m, _ in src.values()})
    remote_type = _one_type("destination", {m for m, _ in dst.values()})
    local = [(addr_of[w.src.id] + w.src_offset, w.length, src[w.src.id][1]) for w in writes]
    remote = [(w.dst.descriptor.base + w.dst_offset, w.length, dst[id(w.dst)][1]) for w in writes]
    return local, local_type, remote, remote_type
