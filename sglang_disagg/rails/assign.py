"""Which rail pair carries each write group of a request: pure, over the planner's groups
(messenger/planner.WriteGroup or anything with its fields), a rail plan per side and their
pairing.

A group goes from its source rank's rails (plan.py) to rails its destination rank can take:
the destination's own rails when the peer told them (its nearest NICs), else any it pairs
with (pairing.py). Among a rank's allowed pairs the groups are spread by bytes, each to the
pair that has carried least so far for this request, ties broken from a start drawn with
the request's seed, so concurrent requests do not all begin on the first NIC. The number of
writes does not change with the rails they use: a decoder counts a tag's writes over every
rail's completion queue, as before. (With MLA the source replica is drawn per request by the
planner; the rail start drawn here with the same seed spreads the NICs of that replica.)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .pairing import Pairing


class Group(Protocol):
    src_rank: int
    dst_rank: int
    length: int

    @property
    def writes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Route:
    local: str   # the source's rail
    remote: str  # the destination's rail


def allowed(src_rails: Sequence[str], dst_rails: Sequence[str] | None, pairing: Pairing) -> tuple[Route, ...]:
    """The rail pairs one (source rank, destination rank) may use, in a fixed order."""
    routes = tuple(Route(lo, r) for lo in src_rails for r in pairing.remote_for(lo)
                   if dst_rails is None or r in dst_rails)
    if not routes:
        raise ValueError(f"no rail of {list(src_rails)} reaches {list(dst_rails) if dst_rails else 'the peer'}: "
                         f"pairs {list(pairing.pairs)}")
    return routes


def assign(groups: Sequence[Group], src_by_rank: Sequence[Sequence[str]], pairing: Pairing, seed: int,
           dst_by_rank: Sequence[Sequence[str]] | None = None) -> list[Route]:
    """One route per group (same order as `groups`)."""
    rng = random.Random(seed)
    carried: dict[Route, int] = {}
    orders: dict[tuple[int, int], tuple[Route, ...]] = {}  # per rank pair: its routes from the drawn start
    out = []
    for g in groups:
        key = (g.src_rank, g.dst_rank)
        if key not in orders:
            routes = allowed(src_by_rank[g.src_rank], dst_by_rank[g.dst_rank] if dst_by_rank else None, pairing)
            start = rng.randrange(len(routes))
            orders[key] = routes[start:] + routes[:start]
        best = min(orders[key], key=lambda r: carried.get(r, 0))  # min keeps the first of equals: the drawn start
        carried[best] = carried.get(best, 0) + g.nbytes
        out.append(best)
    return out
