"""Shared memory another process on the same host can map: allocation and lookup.

``shared_zeros`` gives a torch tensor whose pages live in a memfd (anonymous, freed with
the last mapping or descriptor: nothing is left behind when a process is killed). Its
descriptor stays open exactly as long as the tensor's memory (a peer opens the memfd through
it) and is closed when the last tensor over that memory is collected, so a process that
allocates and drops pools (tests, device checks) does not pile up descriptors. The
messenger mode allocates KV pools with it, so that a same-host peer can write straight
into them (the ``shmem`` transfer backend) and one process can map every rank's pool.

``locate(addr, length)`` finds the file that backs a range of this process's memory and
says how another process opens it: a path (a /dev/shm file) or /proc/<pid>/fd/<n> (a
memfd, opened through this process's descriptor while it lives).

A file is named by its device AND inode, and a memfd also by its name, which is unique
per allocation. An inode number alone names nothing: /dev/shm and the kernel's memfd mount
are separate tmpfs superblocks that count inodes independently, so a process holding
SGLang's /dev/shm/sglang_loads_* file (inode 3, say) next to a KV memfd with inode 3 had
its KV descriptor point at the load file, and a peer checking only the inode would have
written KV into it (it was refused only because that file was smaller than one layer).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import weakref
from dataclasses import dataclass
from typing import Any



class SharedMemoryError(RuntimeError):
    pass


def shared_zeros(shape: tuple[int, ...], dtype: Any, name: str = "sglang-disagg-kv") -> Any:
    import torch

    numel = 1
    for n in shape:
        numel *= n
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    # A name of its own per allocation: a peer checks it, so no other memfd passes for this one.
    fd = os.memfd_create(f"{name}-{secrets.token_hex(8)}", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)  # a fresh memfd reads as zeros
    buf = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # The tensor's storage holds `buf`; when the last tensor over it goes, so do the mapping and
    # (here) the descriptor.
    weakref.finalize(buf, os.close, fd)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


@dataclass(frozen=True, slots=True)
class Backing:
    path: str    # what a peer on this host opens
    offset: int  # file offset of the range's first byte
    inode: int
    dev: int     # st_dev of the file: with the inode, its identity
    target: str  # what /proc/<pid>/fd/<n> links to ("/memfd:NAME (deleted)", "/dev/shm/NAME")


def locate(addr: int, length: int, pid: int | None = None) -> Backing:
    """The shared file behind [addr, addr + length) of this process."""
    pid = os.getpid() if pid is None else pid
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if not lo <= addr < hi:
                continue
            if addr + length > hi:
                raise SharedMemoryError(f"range {addr:#x}+{length} spans more than one mapping")
            perms, offset, inode = parts[1], int(parts[2], 16), int(parts[4])
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            dev = os.makedev(major, minor)
            path = parts[5].strip() if len(parts) > 5 else ""
            if "s" not in perms or inode == 0 or not path:
                raise SharedMemoryError(f"range {addr:#x}+{length} is not shared file memory ({perms} {path!r})")
            where = offset + addr - lo
            if path.startswith("/dev/shm/"):
                return Backing(path, where, inode, dev, path)
            if path.startswith("/memfd:"):
                return Backing(f"/proc/{pid}/fd/{_fd_of(dev, inode, path)}", where, inode, dev, path)
            raise SharedMemoryError(f"range {addr:#x}+{length} is backed by {path}, not shared memory")
    raise SharedMemoryError(f"address {addr:#x} is not mapped in this process")


def _fd_of(dev: int, inode: int, target: str) -> int:
    """This process's descriptor of the file (dev, inode), which links to `target`."""
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
            if (st.st_dev, st.st_ino) == (dev, inode) and os.readlink(f"/proc/self/fd/{name}") == target:
                return int(name)
        except OSError:
            continue
    raise SharedMemoryError(f"no open descriptor for {target} (device {dev:#x}, inode {inode})")


_PEER_PATH = re.compile(r"^(/dev/shm/[^/]+|/proc/[0-9]+/fd/[0-9]+)$")


class Mapping:
    """A peer's shared range mapped into this process. Only shared memory is ever mapped:
    a path a peer names must be a /dev/shm file or a process's memfd descriptor, and what
    it opens must be one, so a descriptor cannot point a writer at an ordinary file."""

    def __init__(self, backing: Backing, length: int) -> None:
        backing_path, offset = backing.path, backing.offset
        if not _PEER_PATH.match(backing_path) or offset < 0 or length <= 0:
            raise SharedMemoryError(f"refusing to map {backing_path!r}: not a shared-memory object")
        try:
            fd = os.open(backing_path, os.O_RDWR | os.O_NOFOLLOW if backing_path.startswith("/dev/shm/") else os.O_RDWR)
        except OSError as e:
            raise SharedMemoryError(f"cannot open the peer's memory {backing_path}: {e}") from e
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not (target.startswith("/memfd:") or target.startswith("/dev/shm/")):
                raise SharedMemoryError(f"refusing to map {backing_path}: it is {target}, not shared memory")
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, target) != (backing.dev, backing.inode, backing.target):
                raise SharedMemoryError(
                    f"{backing_path} is {target} (device {st.st_dev:#x}, inode {st.st_ino}), not the peer's "
                    f"memory {backing.target} (device {backing.dev:#x}, inode {backing.inode})")
            if offset + length > st.st_size:
                raise SharedMemoryError(f"range {offset}+{length} exceeds the peer's memory object")
            start = offset - offset % mmap.PAGESIZE
            self._map = mmap.mmap(fd, length + offset - start, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        except BaseException:
            os.close(fd)
            raise
        # Kept open: this mapping may itself be registered with a backend, whose lookup
        # (locate) names the memfd through a descriptor of this process.
        self._fd = fd
        import ctypes

        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map)) + offset - start
        self.length = length

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a ctypes view still exists: the mapping goes with the process
            pass
        with contextlib.suppress(OSError):
            os.close(self._fd)
