"""Which local rail writes to which of a peer's rails: pairs by reachability, so that two
servers with different rail counts still link.

Over tcp a rail is an interface with an address; a source rail can write to a destination rail
on the same IP network (one subnet per rail, as multi-rail fabrics and our namespace hosts are
built). A local rail that shares no network with any of the peer's rails has no route to it
and is left out for that peer (said in `Pairing.unpaired`); when several rails of one side
share a network with one rail of the other, they all write to it. Pure: addresses in, pairs out.
An interface's addresses are read by `interface_addresses` (psutil).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Address = ipaddress.IPv4Interface | ipaddress.IPv6Interface


@dataclass(frozen=True, slots=True)
class Pairing:
    pairs: tuple[tuple[str, str], ...]  # (local rail, remote rail), local rails in the order given
    unpaired: tuple[str, ...]           # local rails that reach none of the peer's

    def remote_for(self, local: str) -> tuple[str, ...]:
        return tuple(r for lo, r in self.pairs if lo == local)


def pair_rails(local: Mapping[str, Sequence[Address]], remote: Mapping[str, Sequence[Address]]) -> Pairing:
    """`local`/`remote`: rail name -> its addresses (with prefix length). Each local rail pairs
    with every remote rail that has an address on one of its networks; remote rails that
    several local rails reach are shared, and a local rail reaching several remote rails
    takes them all (the planner spreads write groups over the pairs)."""
    pairs, unpaired = [], []
    for name, addrs in local.items():
        nets = {a.network for a in addrs}
        mine = [r for r, raddrs in remote.items() if any(ra.ip in net for ra in raddrs for net in nets)]
        if mine:
            pairs += [(name, r) for r in mine]
        else:
            unpaired.append(name)
    if not pairs:
        raise ValueError(f"no local rail shares a network with the peer's rails: local "
                         f"{_show(local)}; peer {_show(remote)}")
    return Pairing(tuple(pairs), tuple(unpaired))


def _show(rails: Mapping[str, Sequence[Address]]) -> str:
    return ", ".join(f"{n} ({' '.join(str(a) for a in addrs) or 'no address'})" for n, addrs in rails.items()) or "none"


def ipv4_by_interface() -> dict[str, list[ipaddress.IPv4Interface]]:
    """Every interface of this host -> its IPv4 addresses with their netmasks (one read): what a
    tcp rail binds its endpoint to. IPv4 only: every link has an IPv6 link-local address on the
    same fe80::/64, which would pair every rail with every rail."""
    import socket

    import psutil  # as launch/checks.py reads the host's addresses

    return {name: [ipaddress.IPv4Interface(f"{a.address}/{a.netmask}") for a in addrs
                   if a.family == socket.AF_INET and a.netmask]
            for name, addrs in psutil.net_if_addrs().items()}


def interface_addresses(name: str) -> list[ipaddress.IPv4Interface]:
    """The IPv4 addresses of interface `name` ([] when it has none or does not exist)."""
    return ipv4_by_interface().get(name, [])
