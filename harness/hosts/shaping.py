"""What a host's link carries: a rate cap and dropped sources, set on its switch port.

The shaping sits on the bridge side of each host's veth (in the bridge's namespace), on
egress, so it governs what enters the host: ``cap(net, "decode", 100)`` makes the link into
the decode host a 100 Mbit/s one, as the KV (written by the prefill host into the decoder's
memory) all flows that way. A partition drops, in both directions, the IP packets between
two hosts while each still reaches every other host (ARP and the rest of the traffic pass).

A capped port's queue holds about 50 ms of traffic, as a switch port's buffer would: the
kernel's default (1,000 packets of up to 64 KiB) would queue seconds of KV in front of the
heartbeats that share the link, and every peer would look silent to the other.

One HTB tree per port, rebuilt from the port's state on each change (a rebuild drops
what the old tree had queued: the packets are retransmitted): class 1:10 (the
default) carries traffic at the cap, class 1:20 leads to a FIFO of length 0 (every packet
classified there is dropped) and a u32 filter per blocked source sends that source's
packets to it. An uncapped, unblocked port has no qdisc at all. Changing only the rate
changes the class in place, so a transfer in flight slows down rather than restarting
(the "rate drop mid-transfer" fault). The kernel here lacks tc actions and netem, hence a
drop by classification, and no added delay or random loss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from .netns import HostsUnavailable, Network

UNCAPPED_MBIT = 10_000   # the default class's rate when a port only blocks sources
QUEUE_S = 0.05           # a capped port queues at most this much traffic (and at least QUEUE_MIN bytes)
QUEUE_MIN = 256 << 10
BURST = "64k"            # >= a GSO segment: the veth hands the qdisc up to 64 KiB at once
QUANTUM = "60000"


@dataclass
class Port:
    rate_mbit: float | None = None
    blocked: set[str] = field(default_factory=set)  # source addresses dropped on the way in


def _ports(net: Network) -> dict[str, Port]:
    return net.shaping  # type: ignore[return-value]


def _rate(mbit: float) -> str:
    return f"{int(mbit * 1000)}kbit"


def _queue(mbit: float) -> str:
    return str(max(QUEUE_MIN, int(mbit * 1e6 / 8 * QUEUE_S)))


def _apply(net: Network, name: str, rate_only: bool = False) -> None:
    state = _ports(net).setdefault(name, Port())
    dev = net[name].port
    if not rate_only:
        with contextlib.suppress(HostsUnavailable):  # no qdisc yet: nothing to delete
            net.tc("qdisc", "del", "dev", dev, "root")
    if state.rate_mbit is None and not state.blocked:
        return
    rate = _rate(state.rate_mbit or UNCAPPED_MBIT)
    default = ("parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate, "burst", BURST, "cburst", BURST,
               "quantum", QUANTUM)
    queue = ("parent", "1:10", "handle", "10:", "bfifo", "limit", _queue(state.rate_mbit or UNCAPPED_MBIT))
    if rate_only:
        net.tc("class", "change", "dev", dev, *default)
        net.tc("qdisc", "change", "dev", dev, *queue)
        return
    net.tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
    net.tc("class", "add", "dev", dev, *default)
    net.tc("qdisc", "add", "dev", dev, *queue)
    net.tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", _rate(UNCAPPED_MBIT),
           "quantum", QUANTUM)
    net.tc("qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
    for src in sorted(state.blocked):
        net.tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "src",
               f"{src}/32", "flowid", "1:20")


def cap(net: Network, name: str, mbit: float | None) -> None:
    """Cap the link into host `name` at `mbit` Mbit/s (None: no cap). A capped port only changes rate in place."""
    if mbit is not None and mbit <= 0:
        raise ValueError(f"a link rate must be > 0 Mbit/s, got {mbit}")
    state = _ports(net).setdefault(name, Port())
    in_place = state.rate_mbit is not None and mbit is not None
    state.rate_mbit = mbit
    _apply(net, name, rate_only=in_place)


def partition(net: Network, a: str, b: str, cut: bool = True) -> None:
    """Drop every IP packet between hosts `a` and `b` (cut=False: heal), both ways."""
    for here, there in ((a, b), (b, a)):
        blocked = _ports(net).setdefault(here, Port()).blocked
        (blocked.add if cut else blocked.discard)(net[there].address)
        _apply(net, here)


def rate_of(net: Network, name: str) -> float | None:
    return _ports(net).get(name, Port()).rate_mbit
