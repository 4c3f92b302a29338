"""`--rails auto|NAME[,NAME...]`: which of this host's interfaces a server's data path uses.

Resolved where the server starts (interface names differ per host, so a deployment file names
them per group), into the "ADDRESS/PREFIX" form `BackendConfig.rails` takes. A named interface
that does not exist, is down or has no IPv4 address is refused with the host's interface list.
`auto` takes every interface that is up, has an IPv4 address and is neither loopback nor a
bridge, in name order (on GPU hosts the rail plan, plan.py, orders them nearest-first); an
interface that reaches none of a peer's rails is left out for that peer at first contact
(pairing.py). Without `--rails` a server uses one endpoint on its `--host` address, as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

AUTO = "auto"


def check_names(names: Sequence[str]) -> tuple[str, ...]:
    """Syntax only (a rendering machine does not have the target's interfaces)."""
    names = tuple(names)
    if not names:
        return ()
    if AUTO in names and len(names) > 1:
        raise ValueError(f"--rails: {AUTO} stands alone, got {','.join(names)}")
    for n in names:
        if not n or "/" in n or len(n) > 15 or any(c.isspace() for c in n):
            raise ValueError(f"--rails: {n!r} is not an interface name")
    if len(set(names)) != len(names):
        raise ValueError(f"--rails: an interface is named twice in {','.join(names)}")
    return names


def parse_flag(text: str) -> tuple[str, ...]:
    return check_names([p.strip() for p in text.split(",")])


def _interfaces() -> dict[str, tuple[bool, list[str]]]:
    """name -> (up, ["ADDRESS/PREFIX", ...] IPv4), from the process's own network namespace."""
    import psutil

    from .pairing import ipv4_by_interface

    stats = psutil.net_if_stats()
    return {name: (bool(stats.get(name) and stats[name].isup), [str(a) for a in v4])
            for name, v4 in ipv4_by_interface().items()}


def _describe(found: dict[str, tuple[bool, list[str]]]) -> str:
    return ", ".join(f"{n} ({'up' if up else 'down'}{': ' + ' '.join(a) if a else ', no IPv4'})"
                     for n, (up, a) in sorted(found.items())) or "none"


def _is_bridge(name: str, sysfs: str) -> bool:
    # Not topology.read_topology(): a process in a network namespace without its own sysfs mount
    # (the namespace hosts) sees the root namespace's /sys/class/net, so interfaces come from
    # psutil (the process's namespace) and sysfs is only asked about the bridge flag.
    return os.path.isdir(Path(sysfs) / "class/net" / name / "bridge")


def resolve(names: Sequence[str], sysfs: str = "/sys") -> tuple[str, ...]:
    """Interface names (or auto) -> ("ADDRESS/PREFIX", ...), one per rail, in order."""
    names = check_names(names)
    if not names:
        return ()
    found = _interfaces()
    if names == (AUTO,):
        chosen = [n for n, (up, a) in sorted(found.items())
                  if up and a and n != "lo" and not a[0].startswith("127.") and not _is_bridge(n, sysfs)]
        if not chosen:
            raise ValueError(f"--rails auto: no usable interface (up, IPv4, not loopback or a bridge) on this "
                             f"host; interfaces: {_describe(found)}")
        return tuple(found[n][1][0] for n in chosen)
    out = []
    for n in names:
        if n not in found:
            raise ValueError(f"--rails: no interface {n!r} on this host; interfaces: {_describe(found)}")
        up, addrs = found[n]
        if not up or not addrs:
            raise ValueError(f"--rails: interface {n!r} is {'down' if not up else 'without an IPv4 address'}; "
                             f"interfaces: {_describe(found)}")
        out.append(addrs[0])
    return tuple(out)


def interface_names(rails: Sequence[str]) -> list[str]:
    """The interface carrying each "ADDRESS/PREFIX" rail ("" for one this host lacks)."""
    found = _interfaces()
    return [next((n for n, (_, addrs) in sorted(found.items()) if r in addrs), "") for r in rails]
