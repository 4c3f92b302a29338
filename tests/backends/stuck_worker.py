"""fault_worker.FaultWorker plus what the stuck-endpoint tests need: where this process's shm
region and its spinlock are, and a child that keeps this process's sockets open after it dies.

Also a second entry point, `stuck_worker.py lock NAME OFFSET`: map the shm region /dev/shm/NAME,
take the spinlock at OFFSET with glibc's pthread_spin_lock, say so, and die by SIGKILL while
holding it, as a peer killed inside libfabric shm's critical section leaves it.

Run as a process by test_libfabric_stuck.StuckProc, like fault_worker.py.
"""

from __future__ import annotations

import base64
import ctypes
import mmap
import os
import signal
import struct
import sys
import traceback

from fault_worker import FaultWorker
from jsonl_worker import serve


def shm_region_layout(name: str) -> dict:
    """Where libfabric shm keeps this process's region /dev/shm/NAME and its lock, found from the
    region itself rather than from a struct copied out of a header: the region header records
    `base_addr`, the address its owner's provider mapped it at (libfabric 1.17 include/ofi_shm.h, struct
    smr_region: version, resv, flags, pid, cma caps, max_sar_buf_per_peer, base_addr, lock),
    and the spinlock is the next field, 8 bytes on. Only the owner can read base_addr's value
    off /proc/self/maps, so this runs in the process that opened the endpoint."""
    path = f"/dev/shm/{name}"
    with open("/proc/self/maps") as f:
        starts = [int(line.split("-", 1)[0], 16) for line in f if line.rstrip().endswith(" " + path)]
    with open(path, "rb") as f:
        head = f.read(256)
    hits = [o for o in range(0, len(head) - 8, 8) if struct.unpack_from("=Q", head, o)[0] in starts]
    if len(hits) != 1:  # (the shim's guard maps it too, read-only)
        raise RuntimeError(f"{path}: mapped at {starts}, base_addr candidates at {hits}")
    return {"name": name, "base_addr_offset": hits[0], "lock_offset": hits[0] + 8,
            "lock_word": struct.unpack_from("=i", head, hits[0] + 8)[0]}


class StuckWorker(FaultWorker):
    def shm_region(self) -> dict:
        raw = base64.b64decode(self.be._endpoint_info()["fi_addr"])
        return shm_region_layout(raw.rstrip(b"\0").decode().split("://", 1)[1])

    def take_lock(self, name: str, offset: int) -> dict:
        """Take the spinlock at `offset` of /dev/shm/NAME here and keep it (until this process is
        killed), as a peer inside libfabric shm's critical section holds another's."""
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        self._held = mmap.mmap(fd, mmap.PAGESIZE)
        os.close(fd)
        word = ctypes.addressof(ctypes.c_char.from_buffer(self._held)) + offset
        if ctypes.CDLL(None).pthread_spin_lock(ctypes.c_void_p(word)) != 0:
            raise RuntimeError("pthread_spin_lock failed")
        return {"word": struct.unpack_from("=i", self._held, offset)[0]}

    def fork_holder(self) -> dict:
        """A child that holds every descriptor of ours, the control sockets too: once we are
        killed our peers see no EOF, only our process gone (and silence, at peer_timeout_s)."""
        pid = os.fork()
        if pid == 0:
            try:
                while True:
                    signal.pause()
            finally:
                os._exit(0)
        return {"pid": pid}


def hold_lock_and_die(name: str, offset: int) -> None:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    m = mmap.mmap(fd, mmap.PAGESIZE)
    os.close(fd)
    word = ctypes.addressof(ctypes.c_char.from_buffer(m)) + offset
    libc = ctypes.CDLL(None)
    if libc.pthread_spin_lock(ctypes.c_void_p(word)) != 0:
        sys.exit("pthread_spin_lock failed")
    print("locked", struct.unpack_from("=i", m, offset)[0], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    if sys.argv[1:2] == ["lock"]:
        hold_lock_and_die(sys.argv[2], int(sys.argv[3]))
    else:
        serve(StuckWorker(), lambda e: {"type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()})
