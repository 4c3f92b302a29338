"""Where a rail's progress thread runs: on the CPUs of its NIC's NUMA node, when the host has
several nodes and the firmware says which the NIC is on (completions then touch memory and
caches local to the NIC). Read from sysfs (`/sys/class/net/IF/device/numa_node`,
`/sys/devices/system/node/nodeN/cpulist`); intersected with the CPUs the process may use (the
launcher's --pin-cores); None when any of that is unknown or the intersection is empty: the
thread stays where the scheduler puts it."""

from __future__ import annotations

import os
from pathlib import Path


def parse_cpulist(text: str) -> set[int]:
    """Linux's cpulist format ("0-3,8,10-11") -> CPU numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def nic_cpus(interface: str, allowed: set[int], sysfs: str | Path = "/sys") -> set[int] | None:
    """The CPUs of `interface`'s NUMA node that the process may use, or None (see above)."""
    root = Path(sysfs)
    try:
        node = int((root / "class/net" / interface / "device/numa_node").read_text())
        nodes = [p for p in (root / "devices/system/node").glob("node[0-9]*") if p.is_dir()]
        if node < 0 or len(nodes) < 2:
            return None
        cpus = parse_cpulist((root / f"devices/system/node/node{node}/cpulist").read_text()) & allowed
    except (OSError, ValueError):
        return None
    return cpus or None


def place_thread(interface: str) -> set[int] | None:
    """Pin the calling thread to its NIC's node (Linux applies sched_setaffinity(0) to the calling
    thread only); the CPUs it now runs on, or None when it was left alone."""
    cpus = nic_cpus(interface, os.sched_getaffinity(0))
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    return cpus
