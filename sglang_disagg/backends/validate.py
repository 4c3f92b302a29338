"""Pure-Python checks of a write before anything reaches a native library.

They take what they check against as data (the backend's registrations, the peer's id, the
largest write), not the backend or the peer: this module then depends on neither, and the
backend's bookkeeping stays its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import DescriptorError
from .regions import MemoryRegion, PageWrite, RemoteRegion

# A backend's registrations: region id -> (the region, its native registration); only the
# region is read here.
Registered = Mapping[int, tuple[MemoryRegion, Any]]


def _uint(name: str, v: Any, i: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise DescriptorError(f"write {i}: {name}={v!r} must be a non-negative int")
    return v


def _check_source(registered: Registered, src: Any, where: str) -> None:
    entry = registered.get(getattr(src, "id", None))
    if entry is None or entry[0] is not src:
        raise DescriptorError(f"{where}source {src!r} is not a region registered with this backend")


def check_write(registered: Registered, peer_id: str, max_bytes: int, w: Any, i: int) -> PageWrite:
    try:
        src, src_off, dst, dst_off, length = w
    except (TypeError, ValueError):
        raise DescriptorError(f"write {i}: expected (src, src_offset, dst, dst_offset, length), got {w!r}") from None
    _check_source(registered, src, f"write {i}: ")
    if not isinstance(dst, RemoteRegion):
        raise DescriptorError(f"write {i}: destination must be a RemoteRegion from peer.add_remote_region()")
    if dst.peer != peer_id:
        raise DescriptorError(f"write {i}: destination region belongs to peer {dst.peer[:8]}, not {peer_id[:8]}")
    src_off, dst_off, length = _uint("src_offset", src_off, i), _uint("dst_offset", dst_off, i), _uint("length", length, i)
    if length == 0 or length > max_bytes:
        raise DescriptorError(f"write {i}: length {length} outside 1..{max_bytes}")
    if src_off + length > src.length:
        raise DescriptorError(f"write {i}: source range [{src_off}, {src_off + length}) exceeds region of {src.length} bytes")
    if dst_off + length > dst.length:
        raise DescriptorError(f"write {i}: destination range [{dst_off}, {dst_off + length}) exceeds remote region of {dst.length} bytes")
    return PageWrite(src, src_off, dst, dst_off, length)


def check_uniform(registered: Registered, peer_id: str, max_bytes: int, src: MemoryRegion,
                  src_offsets: Sequence[int], dst: RemoteRegion, dst_offsets: Sequence[int], length: int) -> None:
    """Whole-list checks for write_uniform: same guarantees as check_write, O(n) in C loops."""
    _check_source(registered, src, "")
    if not isinstance(dst, RemoteRegion) or dst.peer != peer_id:
        raise DescriptorError("destination must be a RemoteRegion of this peer (peer.add_remote_region())")
    if isinstance(length, bool) or not isinstance(length, int) or not 0 < length <= max_bytes:
        raise DescriptorError(f"length {length!r} outside 1..{max_bytes}")
    if len(src_offsets) != len(dst_offsets):
        raise DescriptorError(f"{len(src_offsets)} source offsets but {len(dst_offsets)} destination offsets")
    if not src_offsets:
        return
    for name, offs, limit in (("source", src_offsets, src.length), ("destination", dst_offsets, dst.length)):
        if any(type(o) is not int for o in offs):
            raise DescriptorError(f"{name} offsets must all be ints")
        lo, hi = min(offs), max(offs)
        if lo < 0 or hi + length > limit:
            raise DescriptorError(f"{name} range [{lo}, {hi + length}) exceeds region of {limit} bytes")
