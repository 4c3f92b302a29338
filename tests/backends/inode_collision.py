"""Make a /dev/shm file whose inode number equals a live memfd's (test helper).

/dev/shm and the kernel's internal mount behind memfd_create are two tmpfs superblocks,
each numbering its inodes from 1 with a counter of its own, so equal numbers on both are
normal: in the CI run of issue 19 a decoder's scheduler held SGLang's
/dev/shm/sglang_loads_* file (inherited from its server process) and a KV memfd with the
same inode number. Both counters only grow (/dev/shm: by one per new file; memfds: by one
per allocation within a per-CPU batch of 1024, hence the pinning), so the collision is made
by advancing the lower one to the other's next value.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any

SHM_DIR = "/dev/shm"
MAX_STEPS = 5_000_000


@contextlib.contextmanager
def one_cpu():
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _next_shm_inode() -> int:
    path = f"{SHM_DIR}/inode-probe-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)
        os.unlink(path)


def _next_memfd_inode() -> int:
    fd = os.memfd_create("inode-probe")
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def memfd_descriptor(tensor: Any) -> int:
    """This process's descriptor of the memfd behind a shared_zeros tensor (held as long as the
    tensor lives), found by the mapping's name, which is unique per allocation."""
    addr = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) > 5:
                name = parts[5].strip()
                break
        else:
            raise AssertionError(f"{addr:#x} is not mapped")
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == name:
                return int(fd)
    raise AssertionError(f"no descriptor of {name} is open")


def memfd_tensor_and_colliding_file(nbytes: int) -> tuple[Any, int, str]:
    """A KV-like shared tensor (sglang_disagg.ipc.shm.shared_zeros, a memfd) and an open /dev/shm
    file of at least its size whose inode number is the memfd's. Returns (tensor, file fd, path)."""
    import torch

    from sglang_disagg.ipc import shm

    # A descriptor slot below the memfd's, for the colliding file: a lookup that scans the
    # process's descriptors in order meets the file first, as in the CI run (fd 56 < 61).
    reserved = os.open("/dev/null", os.O_RDONLY)
    with one_cpu():
        steps = 0
        # Memfds first: the tensor's inode must be ahead of /dev/shm's counter.
        shm_next = _next_shm_inode() + 1
        while _next_memfd_inode() < shm_next:
            steps += 1
            assert steps < MAX_STEPS, "could not advance the memfd inode counter"
        kv = shm.shared_zeros((nbytes,), torch.uint8, name="collision-kv")
        kv_fd = memfd_descriptor(kv)
        target = os.fstat(kv_fd).st_ino
    os.close(reserved)
    while True:
        path = f"{SHM_DIR}/collision-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        ino = os.fstat(fd).st_ino
        if ino == target:
            os.ftruncate(fd, nbytes)
            assert fd < kv_fd, (fd, kv_fd)
            return kv, fd, path
        os.close(fd)
        os.unlink(path)
        assert ino < target, f"/dev/shm's inode counter passed {target} (another process creating files?)"
        steps += 1
        assert steps < MAX_STEPS, "could not advance the /dev/shm inode counter"

