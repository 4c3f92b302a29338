"""Pure-Python checks of a write before anything reaches a native library."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import DescriptorError
from .regions import MemoryRegion, PageWrite, RemoteRegion

if TYPE_CHECKING:
    from .base import TransferBackend
    from .peers import Peer


def _uint(name: str, v: Any, i: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise DescriptorError(f"write {i}: {name}={v!r} must be a non-negative int")
    return v


def check_write(backend: TransferBackend, peer: Peer, w: Any, i: int) -> PageWrite:
    try:
        src, src_off, dst, dst_off, length = w
    except (TypeError, ValueError):
        raise DescriptorError(f"write {i}: expected (src, src_offset, dst, dst_offset, length), got {w!r}") from None
    entry = backend._regions.get(getattr(src, "id", None))
    if entry is None or entry[0] is not src:
        raise DescriptorError(f"write {i}: source {src!r} is not a region registered with this backend")
    if not isinstance(dst, RemoteRegion):
        raise DescriptorError(f"write {i}: destination must be a RemoteRegion from peer.add_remote_region()")
    if dst.peer != peer.id:
        raise DescriptorError(f"write {i}: destination region belongs to peer {dst.peer[:8]}, not {peer.id[:8]}")
    src_off, dst_off, length = _uint("src_offset", src_off, i), _uint("dst_offset", dst_off, i), _uint("length", length, i)
    if length == 0 or length > backend.max_write_bytes:
        raise DescriptorError(f"write {i}: length {length} outside 1..{backend.max_write_bytes}")
    if src_off + length > src.length:
        raise DescriptorError(f"write {i}: source range [{src_off}, {src_off + length}) exceeds region of {src.length} bytes")
    if dst_off + length > dst.length:
        raise DescriptorError(f"write {i}: destination range [{dst_off}, {dst_off + length}) exceeds remote region of {dst.length} bytes")
    return PageWrite(src, src_off, dst, dst_off, length)


def check_uniform(backend: TransferBackend, peer: Peer, src: MemoryRegion, src_offsets: Sequence[int],
                  dst: RemoteRegion, dst_offsets: Sequence[int], length: int) -> None:
    """Whole-list checks for write_uniform: same guarantees as check_write, O(n) in C loops."""
    entry = backend._regions.get(getattr(src, "id", None))
    if entry is None or entry[0] is not src:
        raise DescriptorError(f"source {src!r} is not a region registered with this backend")
    if not isinstance(dst, RemoteRegion) or dst.peer != peer.id:
        raise DescriptorError("destination must be a RemoteRegion of this peer (peer.add_remote_region())")
    if isinstance(length, bool) or not isinstance(length, int) or not 0 < length <= backend.max_write_bytes:
        raise DescriptorError(f"length {length!r} outside 1..{backend.max_write_bytes}")
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
