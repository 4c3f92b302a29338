"""The libfabric backend's rails: one endpoint per local network interface, paired with a
peer's rails by the networks they share, each batch of writes on the rail that has carried
least so far.

A rail is an endpoint opened on one interface (FI_SOURCE: the provider binds to the node
given; for tcp an IPv4 address, i.e. an interface). `BackendConfig.rails` names them as
"ADDRESS/PREFIX"; none: one endpoint on `BackendConfig.host`, as before rails existed. The
control connection stays on `host` whatever the rails are.

First contact: the HELLO's endpoint info carries `fi_addr` (rail 0's, what a peer without
rails uses) and, with rails, `rails`: per rail its address and network. A local rail writes to
the peer rails on one of its networks (rails/pairing.py), one route each; the paired one first:
local rail i's is the one with the same index if it is among them, else the (i mod n)-th, so equal
rail counts pair one to one while the regions allow it. Without rails on either side only rail 0
is used, to the peer's `fi_addr`.

Each rail registers the regions it carries (registration.py; each libfabric domain registers
separately); a region's descriptor carries rail 0's key as `key` and the others' in
`extra["rails"]`, and `extra["carriers"]` (the rail indices) when not every rail carries it. A
write goes from a rail carrying its source to a peer rail carrying its destination. The decoder
counts a tag's writes over every rail's completion queue: the pollers share one tracker.
"""

from __future__ import annotations

import base64
import ipaddress
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DescriptorError, TransferError
from ..regions import RegionDescriptor
from ...rails.pairing import pair_rails

MAX_RAILS = 16  # as BackendConfig; a peer's HELLO is untrusted: its rail list is bounded
_U64 = 2**64


@dataclass(frozen=True, slots=True)
class RailRoute:
    """How one of our endpoints reaches a peer: its AV address there, which of the peer's rails
    it is (the index of the key in the peer's descriptors), and that rail's raw address (what a
    reachability probe connects to)."""

    local: int
    fi_addr: int
    remote: int
    address: bytes = b""


@dataclass(frozen=True, slots=True)
class PeerRail:
    address: bytes  # the peer endpoint's fi_getname address (the shim checks its format)
    network: ipaddress.IPv4Interface


def parse(rails: Sequence[str]) -> list[ipaddress.IPv4Interface]:
    """BackendConfig.rails -> interfaces (validated there already: this only converts)."""
    return [ipaddress.IPv4Interface(r) for r in rails]


def hello(addresses: Sequence[bytes], networks: Sequence[ipaddress.IPv4Interface]) -> dict[str, Any]:
    info: dict[str, Any] = {"fi_addr": base64.b64encode(addresses[0]).decode()}
    if networks:
        info["rails"] = [{"fi_addr": base64.b64encode(a).decode(), "net": str(n)}
                         for a, n in zip(addresses, networks)]
    return info


def peer_rails(endpoint: Mapping[str, Any]) -> tuple[bytes, list[PeerRail]]:
    """A peer's HELLO endpoint info -> (its primary address, its rails, [] without). Untrusted."""
    try:
        primary = base64.b64decode(endpoint["fi_addr"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise TransferError(f"peer hello has no valid libfabric address: {e}") from e
    raw = endpoint.get("rails")
    if raw is None:
        return primary, []
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_RAILS:
        raise TransferError(f"peer hello: rails must be a list of 1-{MAX_RAILS} entries")
    out = []
    for i, r in enumerate(raw):
        try:
            if not isinstance(r, dict) or set(r) != {"fi_addr", "net"} or not isinstance(r["net"], str):
                raise ValueError("need exactly fi_addr and net")
            out.append(PeerRail(base64.b64decode(r["fi_addr"], validate=True), ipaddress.IPv4Interface(r["net"])))
        except (TypeError, ValueError) as e:
            raise TransferError(f"peer hello: rail {i} is invalid: {e}") from e
    return primary, out


def pairing(local: Sequence[ipaddress.IPv4Interface], remote: Sequence[PeerRail]) -> list[list[int]]:
    """For each local rail, the peer rails it reaches (a shared network), its paired one first
    ([]: it reaches none of them)."""
    if not local or not remote:
        return [[0]] + [[] for _ in local[1:]]
    try:
        p = pair_rails({str(i): [n] for i, n in enumerate(local)}, {str(j): [r.network] for j, r in enumerate(remote)})
    except ValueError as e:
        raise TransferError(f"libfabric rails: {e}") from e
    out: list[list[int]] = []
    for i in range(len(local)):
        mine = sorted(int(j) for j in p.remote_for(str(i)))
        if mine:
            first = i if i in mine else mine[i % len(mine)]
            mine = [first] + [j for j in mine if j != first]
        out.append(mine)
    return out


def check_descriptor(d: RegionDescriptor) -> None:
    """A peer's descriptor with rails: extra["rails"] = [[base, key], ...] for its rails 1..,
    extra["carriers"] = the rails that registered it (absent: every rail)."""
    rails = d.extra.get("rails")
    if rails is not None:
        if not isinstance(rails, list) or len(rails) >= MAX_RAILS:
            raise DescriptorError(f"libfabric descriptor: rails must be a list of at most {MAX_RAILS - 1} [base, key]")
        for i, bk in enumerate(rails, 1):
            if not (isinstance(bk, list) and len(bk) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                  and 0 <= v < _U64 for v in bk)):
                raise DescriptorError(f"libfabric descriptor: rail {i} needs [base, key] as 64-bit unsigned integers")
    c = d.extra.get("carriers")
    if c is not None:
        n = 1 + len(rails or [])
        if (not isinstance(c, list) or not c or len(c) != len(set(c))
                or any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < n for r in c)):
            raise DescriptorError(f"libfabric descriptor: carriers must be distinct rail indices below {n}")


def carriers(d: RegionDescriptor) -> frozenset[int] | None:
    """The peer rails that hold keys for this region (None: every rail)."""
    c = d.extra.get("carriers")
    return None if c is None else frozenset(c)


def common(sets: Sequence[frozenset[int] | None]) -> frozenset[int] | None:
    """The rails in every set (None stands for every rail)."""
    out: frozenset[int] | None = None
    for c in sets:
        if c is not None:
            out = c if out is None else out & c
    return out


def remote_key(d: RegionDescriptor, rail: int) -> tuple[int, int]:
    """(base, key) of a peer's region on its rail `rail`."""
    c = carriers(d)
    if c is not None and rail not in c:
        raise DescriptorError(f"the peer's region {d.region} is not registered on its rail {rail} "
                              f"(carried by {sorted(c)})")
    if rail == 0:
        return d.base, d.key
    rails = d.extra.get("rails") or []
    if rail > len(rails):
        raise DescriptorError(f"the peer's descriptor of region {d.region} has no key for its rail {rail}")
    base, key = rails[rail - 1]
    return base, key


def sockaddr(raw: bytes) -> tuple[str, int] | None:
    """(IPv4, port) of a tcp provider's address (a struct sockaddr_in), None for any other."""
    if len(raw) < 8 or struct.unpack("=H", raw[:2])[0] != socket.AF_INET:
        return None
    return socket.inet_ntoa(raw[4:8]), struct.unpack("!H", raw[2:4])[0]


def reachable(source: str, raw: bytes, timeout_s: float) -> bool:
    """Whether a TCP connection from `source` reaches the peer rail at `raw` (its listening
    socket) within `timeout_s`: what says a rail whose link went down is back. Non-tcp
    addresses (verbs, efa) cannot be probed this way: reported reachable."""
    where = sockaddr(raw)
    if where is None:
        return True
    try:
        with socket.create_connection(where, timeout=timeout_s, source_address=(source, 0)):
            return True
    except OSError:
        return False
