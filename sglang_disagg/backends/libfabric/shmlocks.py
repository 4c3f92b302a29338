"""libfabric shm's spinlocks in shared memory, and the shim's guards against a dead holder.

libfabric 1.17 shm keeps each endpoint's queues in a region, /dev/shm/<pid>:<uid>:<ep>, guarded
by a pthread spinlock inside it (struct smr_region in include/ofi_shm.h): a post takes the
peer's, progress (fi_cq_read) takes our own. A process killed inside such a critical section
leaves the lock held for good, and a thread of ours waiting for it inside the provider would spin
forever, holding our endpoint. So the shim looks at the lock words itself (read-only mappings,
shim_guard_self / shim_guard_peer) and waits outside the provider, where it also watches the
peer's process (a pidfd: posts to a peer whose process exited fail at once) and the bounds.
The look and the provider's own lock are two steps, so a writer can still end up waiting inside
for a peer that died holding its lock: the watchdog releases such a lock (shmwatch.c).

Where the lock is, is read off the region rather than a struct copied here: the region header
records `base_addr`, the address its owner mapped it at, and the lock is the next field. Only
the owner knows that address (/proc/self/maps), so the offset comes from our own region, and
the shim checks that the word there is a free spinlock before trusting it; a peer's region is
only read if its version byte matches ours. Anything unexpected: no lock guard (logged), and the
bounded waits of the shim (SHIM_ESTUCK) still apply.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import struct
import threading
from typing import Any

from ..errors import PeerLostError
from .native import ESTUCK, EndpointStuck, Errbuf, lib

log = logging.getLogger(__name__)

_ADDR = re.compile(rb"fi_shm://((\d+):\d+:\d+)\0")  # what smr_endpoint_name makes: pid:uid:index
_HEADER = 256
_found: dict[str, int] = {}
_found_lock = threading.Lock()


def region_of(raw: bytes) -> tuple[int, str] | None:
    """(pid, region name) of an shm address (fi_getname's, or a peer's from its hello), else None."""
    m = _ADDR.fullmatch(raw)
    return (int(m.group(2)), m.group(1).decode()) if m else None


def lock_offset(region: str) -> int | None:
    """Offset of the spinlock in regions of this libfabric build, found from `region`, one that
    this process opened (None if its header holds no field equal to where we mapped it)."""
    with _found_lock:
        if "lock" in _found:
            return _found["lock"]
        path = f"/dev/shm/{region}"
        try:
            with open("/proc/self/maps") as f:
                starts = {int(line.split("-", 1)[0], 16) for line in f if line.rstrip().endswith(" " + path)}
            with open(path, "rb") as f:
                head = f.read(_HEADER)
        except OSError as e:
            log.info("libfabric shm: cannot read %s (%s): its lock is not guarded", path, e)
            return None
        hits = [o for o in range(0, len(head) - 8, 8) if struct.unpack_from("=Q", head, o)[0] in starts]
        if len(hits) != 1:
            log.info("libfabric shm: no base_addr in %s's header (%d candidates): its lock is not guarded",
                     path, len(hits))
            return None
        _found["lock"] = hits[0] + 8  # base_addr is a pointer; the lock follows it
        return _found["lock"]


def owns_region(pid: int, region: str) -> bool:
    """Whether process `pid`, as this process sees pids, is the one that mapped `region` (a peer
    in another pid namespace names itself with a pid that means another process here)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(line.rstrip().endswith(f" /dev/shm/{region}") for line in f)
    except OSError:
        return False


def guard_self(ep: Any, raw: bytes, look: bool = True) -> int:
    """Watch our own region's lock (before the first poll); returns the lock offset, -1 if none.
    look=False: not looked at before each poll, only released should a peer die holding it (tests)."""
    who = region_of(raw)
    off = lock_offset(who[1]) if who else None
    if off is None:
        return -1
    err = Errbuf()
    if lib.shim_guard_self(ep, who[1].encode(), off, 0 if look else lib.SHIM_GUARD_NO_LOOK, err.buf, 256):
        log.warning("libfabric shm: our region's lock is not guarded: %s", err)
        return -1
    if str(err):
        log.warning("libfabric shm: %s", err)
    return off


def guard_peer(ep: Any, fi_addr: int, raw: bytes, lock_off: int, address: str, look: bool = True) -> None:
    """Watch a peer's process and its region's lock (look=False: the lock is not looked at before
    posting, only released should its process die holding it; for tests). PeerLostError: its
    process is gone already; EndpointStuck from the shim as it comes; anything else only costs
    the guard (logged)."""
    who = region_of(raw)
    if who is None:
        return
    pid, region = who
    if not owns_region(pid, region):
        log.info("libfabric shm: peer %s: pid %d here is not the process of region %s: its exit is seen "
                 "by the control channel only", address, pid, region)
        pid = 0
    err = Errbuf()
    flags = 0 if look else lib.SHIM_GUARD_NO_LOOK
    ret = lib.shim_guard_peer(ep, fi_addr, pid, region.encode(), lock_off, flags, err.buf, 256)
    if ret == -errno.ECONNRESET:
        raise PeerLostError(f"libfabric shm: peer {address}: {err}")
    if ret == -ESTUCK:
        raise EndpointStuck(f"libfabric shm: {err}")
    if ret or str(err):
        log.warning("libfabric shm: peer %s: %s", address, err)


def unlink_region(raw: bytes) -> None:
    """Remove an abandoned endpoint's region file: libfabric does at fi_close, which never comes for
    it. The mapping, its memory, stays until the process exits; no new peer can open it."""
    who = region_of(raw)
    if who is not None:
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{who[1]}")
