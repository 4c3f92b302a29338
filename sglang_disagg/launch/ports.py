"""What a running stack listens on, and why: read from the kernel (psutil), not assumed.

The launcher prints this after start-up and writes it to ports.txt in the log dir, so an
operator sees every open port, including the ephemeral ones (the decoder messenger's
transfer endpoint, a transfer library's own listeners), and the address each is bound to.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True, slots=True)
class Listener:
    ip: str
    port: int
    process: str   # the stack process it belongs to (prefill, decode, router)
    purpose: str

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}  {self.process}: {self.purpose}"


def _tree(pid: int) -> set[int]:
    try:
        root = psutil.Process(pid)
        return {pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def listening(named: dict[int, str], processes: dict[int, str]) -> list[Listener]:
    """What the process trees of `processes` (pid -> name) listen on; `named` says what the
    ports we know are for (port -> purpose). Data in, not the Stack: stack.py calls this."""
    owner = {pid: name for root, name in processes.items() for pid in _tree(root)}
    out = []
    for c in psutil.net_connections("inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in owner:
            purpose = named.get(c.laddr.port, "internal (SGLang / transfer library)")
            out.append(Listener(c.laddr.ip, c.laddr.port, owner[c.pid], purpose))
    return sorted(out, key=lambda x: (x.process, x.port))
