"""Test-only fault injection for negative controls.

``SGLANG_DISAGG_FAULT=zero_kv:pages=SEL,layers=SEL[,kinds=k|v|kv]`` makes a decoder zero
part of the KV it received, right before the request is handed to the batch (prefill
servers ignore it; ``drop_kv`` is the upstream mode's variant, see testsupport.py). SEL is
``all``, ``first``, ``last``, ``first:N``, ``last:N`` or an index. Several specs joined by
``|`` apply in turn, one per carried request (request i gets spec i mod n), so one
server can exercise several partial losses. A test that still sees the colocated tokens under such a fault has
a comparison that cannot fail; one page of one layer must be enough to change them.
On prefill servers, ``early_writes`` posts each layer's writes before its KV exists and
``fail_writes`` fails every write into a decoder at posting (prefill.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .kvpool import KVPoolView
from .planner import Kind

ENV = "SGLANG_DISAGG_FAULT"


def _pick(sel: str, items: Sequence[int]) -> list[int]:
    if not items:
        return []
    if sel == "all":
        return list(items)
    if sel == "first":
        return [items[0]]
    if sel == "last":
        return [items[-1]]
    head, _, count = sel.partition(":")
    if count:
        n = int(count)
        return list(items[:n]) if head == "first" else list(items[-n:])
    return [items[int(sel)]]


@dataclass(frozen=True, slots=True)
class Fault:
    pages: str = "all"
    layers: str = "all"
    kinds: str = "kv"

    @classmethod
    def from_env(cls) -> Faults | None:
        spec = os.environ.get(ENV, "")
        if not spec.startswith("zero_kv"):
            return None
        return Faults(tuple(cls.parse(part) for part in spec.split("|")))

    @classmethod
    def parse(cls, spec: str | None) -> Fault | None:
        if not spec:
            return None
        kind, _, args = spec.partition(":")
        if kind != "zero_kv":
            raise ValueError(f"fault {spec!r}: only zero_kv is known")
        fields = dict(part.split("=", 1) for part in args.split(",") if part)
        unknown = set(fields) - {"pages", "layers", "kinds"}
        if unknown:
            raise ValueError(f"fault {spec!r}: unknown field(s) {sorted(unknown)}")
        fault = cls(**fields)
        for sel in (fault.pages, fault.layers):
            head, colon, count = sel.partition(":")
            ok = (sel in ("all", "first", "last") or sel.lstrip("-").isdigit()
                  or (colon and head in ("first", "last") and count.isdigit()))
            if not ok:
                raise ValueError(f"fault {spec!r}: selector {sel!r} is not all/first/last[:N]/<index>")
        if fault.kinds not in ("k", "v", "kv"):
            raise ValueError(f"fault {spec!r}: kinds must be k, v or kv")
        return fault

    def apply(self, view: KVPoolView, pages: Sequence[int]) -> None:
        layers = _pick(self.layers, range(view.geometry.num_layers))
        kinds = [k for k in Kind if k.name.lower() in self.kinds]
        view.zero_pages(_pick(self.pages, pages), layers, kinds)


@dataclass(slots=True)
class Faults:
    """Specs applied in turn, one per carried request."""

    specs: tuple[Fault, ...]
    served: int = 0

    def apply(self, view: KVPoolView, pages: Sequence[int]) -> None:
        self.specs[self.served % len(self.specs)].apply(view, pages)
        self.served += 1


@dataclass(slots=True)
class CorruptSource:
    """Prefill side, ``SGLANG_DISAGG_FAULT=corrupt_source:R``: right before the leader posts
    writes read from TP rank R's KV, it zeroes those source bytes in rank R's pool (its
    forward is over; the other ranks' copies stay correct). With replicated (MLA) KV each
    request reads from one rank drawn per request, so exactly the requests that drew R
    come out wrong: the negative control that shows which copy a decoder really read.
    CPU pools only (the leader writes through its mapping of rank R's memory)."""

    rank: int
    corrupted: list[str]  # rids whose pages were corrupted, in order (bounded)

    @classmethod
    def from_env(cls) -> CorruptSource | None:
        spec = os.environ.get(ENV, "")
        if not spec.startswith("corrupt_source"):
            return None
        _, _, rank = spec.partition(":")
        if not rank.isdigit():
            raise ValueError(f"fault {spec!r}: expected corrupt_source:<TP rank>")
        return cls(int(rank), [])

    def apply(self, addresses: Sequence[int], region: Any, groups: Sequence[Any], rid: str) -> None:
        """`addresses[i]`: where region i of rank `self.rank` is mapped in this process;
        `region(layer, kind)` -> i."""
        import ctypes

        mine = [g for g in groups if g.src_rank == self.rank]
        for g in mine:
            base = addresses[region(g.layer, g.kind)]
            for p in g.src_pages:
                ctypes.memset(base + p * g.src_stride + g.src_offset, 0, g.length)
        if mine and (not self.corrupted or self.corrupted[-1] != rid):
            self.corrupted.append(rid)
            del self.corrupted[:-256]


@dataclass(frozen=True, slots=True)
class HoldOrders:
    """Prefill side, ``SGLANG_DISAGG_FAULT=hold_orders:PREFIX:SECONDS``: an order whose rid
    (the client's) starts with PREFIX is held SECONDS before the server takes it (intake.py),
    so that its decoder waits that long for the KV: the check that a request waiting for its
    KV holds up nobody else (no DP group stalls another)."""

    prefix: str
    seconds: float

    @classmethod
    def from_env(cls) -> HoldOrders | None:
        spec = os.environ.get(ENV, "")
        if not spec.startswith("hold_orders"):
            return None
        parts = spec.split(":")
        try:
            return cls(parts[1], float(parts[2]))
        except (IndexError, ValueError):
            raise ValueError(f"fault {spec!r}: expected hold_orders:<rid prefix>:<seconds>") from None
