"""Same host, decided by whether a peer's memory can actually be reached from here.

Backends that write straight into a peer's memory (shmem maps it) work only between
processes that see one another: one /proc (PID namespace) and one kernel. boot_id cannot
tell: network, PID and mount namespaces share it, and so would two containers on one
machine that cannot reach each other's memory. So each side's HELLO carries a probe
(``Probe().info``): a small memfd it holds, named as /proc/<pid>/fd/<n> with its device,
inode and name, and the random bytes written in it. ``check(address, info)`` maps that
path exactly as KV would be mapped (shm.Mapping: the same path rules and identity checks)
and reads the bytes back. Where the path is missing, names another process's file (PID
numbers repeat across PID namespaces) or holds other bytes, the peer is refused at first
contact with "<address> is not on this host" and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
from typing import Any

from ..ipc import shm
from .errors import BackendUnavailable, TransferError

NOT_HERE = "is not on this host"  # in every such refusal (tests and operators look for it)
PROBE_BYTES = 16


def boot_id(backend: str) -> str:
    """This kernel's boot id: a first, cheap same-host filter (namespaces share it, so the
    probe below decides)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError as e:
        raise BackendUnavailable(f"{backend} needs Linux /proc: {e}") from e


class Probe:
    """Our side: the memfd a peer maps to prove it can reach our memory. Close it with the backend."""

    def __init__(self) -> None:
        nonce = secrets.token_bytes(PROBE_BYTES)
        self.fd = os.memfd_create(f"sglang-disagg-probe-{secrets.token_hex(8)}", os.MFD_CLOEXEC)
        os.write(self.fd, nonce)
        st = os.fstat(self.fd)
        self.info: dict[str, Any] = {"path": f"/proc/{os.getpid()}/fd/{self.fd}", "dev": st.st_dev,
                                     "inode": st.st_ino, "target": os.readlink(f"/proc/self/fd/{self.fd}"),
                                     "nonce": nonce.hex()}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def check(backend: str, address: str, info: Any) -> None:
    """Raise TransferError naming why unless the peer's probe `info` is reachable memory here."""
    def not_here(why: str) -> TransferError:
        return TransferError(f"{backend}: peer {address} {NOT_HERE}: {why}; {backend} joins processes of one "
                             "host (one /proc, one kernel); between hosts use libfabric tcp, nixl or mooncake")

    if not isinstance(info, dict) or not all(isinstance(info.get(k), str) for k in ("path", "target", "nonce")) or \
            not all(isinstance(info.get(k), int) and not isinstance(info.get(k), bool) for k in ("dev", "inode")):
        raise TransferError(f"{backend}: peer {address} sent no valid memory probe (path/dev/inode/target/nonce)")
    try:
        m = shm.Mapping(shm.Backing(info["path"], 0, info["inode"], info["dev"], info["target"]), PROBE_BYTES)
    except shm.SharedMemoryError as e:
        raise not_here(f"its memory cannot be reached from here ({e})") from None
    try:
        seen = ctypes.string_at(m.addr, PROBE_BYTES).hex()
    finally:
        m.close()
    if seen != info["nonce"]:
        raise not_here(f"{info['path']} here holds other bytes than the peer wrote in its probe")
