"""Which TP rank's writes leave through which rail: a pure function of the ranks' devices and
the node's topology (topology.py), with no I/O, so that it is tested on recorded machines.

The rules (issue "Every NIC carries a slice"):
- a rank on a GPU writes through the NIC(s) nearest its GPU: those sharing the most PCIe
  bridges with it (one switch: a DGX H100's one ConnectX-7 per GPU, a p5's four EFA
  interfaces per GPU, which then share that rank's writes); where no NIC shares a bridge,
  those on its root complex, then those on its NUMA node, then all (nvidia-smi's PIX/PXB,
  PHB, NODE, SYS, in that order);
- ranks on CPUs have no PCIe position worth the name: they are spread round-robin over the
  rails, and when there are fewer ranks than rails each rank stripes over several, so that
  every rail is used (a single rank's writes go over every rail);
- the same inputs give the same plan (rails in natural name order: mlx5_2 before mlx5_10).
A NIC nearest no GPU (one on a socket without GPUs) carries nothing on a GPU node: a rank's
rails are its nearest, and crossing the socket to use that NIC would cost more than it adds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .topology import Gpu, Nic, NicKind, Topology


def natural(name: str) -> tuple:
    """Sort key: digits as numbers (mlx5_2 < mlx5_10, eth2 < eth10)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


@dataclass(frozen=True, slots=True)
class RailPlan:
    rails: tuple[str, ...]                # every rail of the server, natural order
    by_rank: tuple[tuple[str, ...], ...]  # TP rank -> the rails its writes leave through

    def used(self) -> tuple[str, ...]:
        return tuple(r for r in self.rails if any(r in mine for mine in self.by_rank))


def nearness(gpu: Gpu, nic: Nic) -> tuple[int, int]:
    """Larger is nearer: (PCIe bridges shared, or -1 across root complexes; same NUMA node)."""
    if nic.pci is None:
        return (-2, 0)
    same_numa = int(gpu.pci.numa is not None and gpu.pci.numa == nic.pci.numa)
    return (gpu.pci.shared(nic.pci), same_numa)


def nearest(gpu: Gpu, rails: Sequence[Nic]) -> tuple[Nic, ...]:
    best = max(nearness(gpu, n) for n in rails)
    return tuple(n for n in rails if nearness(gpu, n) == best)


def choose_rails(topo: Topology, kind: NicKind, names: Sequence[str] = ()) -> tuple[Nic, ...]:
    """The server's rails: every usable NIC of `kind` (`names` empty: 'auto'), or the named
    ones, each of which must exist and be usable (ValueError naming what there is)."""
    usable = {n.name: n for n in topo.rails(kind)}
    if not names:
        if not usable:
            raise ValueError(f"no usable {kind.value} NIC for a rail on this host: {_listing(topo, kind)}")
        return tuple(sorted(usable.values(), key=lambda n: natural(n.name)))
    chosen = []
    for name in names:
        if name not in usable:
            known = next((n for n in topo.nics if n.name == name and n.kind is kind), None)
            why = f"it is {known.unusable}" if known else "there is no such NIC"
            raise ValueError(f"rail {name!r} cannot be used ({why}); {kind.value} NICs here: {_listing(topo, kind)}")
        chosen.append(usable[name])
    return tuple(sorted(set(chosen), key=lambda n: natural(n.name)))


def _listing(topo: Topology, kind: NicKind) -> str:
    nics = [n for n in topo.nics if n.kind is kind]
    return ", ".join(f"{n.name}" + (f" ({n.unusable})" if n.unusable else "") for n in nics) or "none"


def plan_rails(devices: Sequence[str], topo: Topology, rails: Sequence[Nic]) -> RailPlan:
    """`devices[r]`: TP rank r's device ('cuda:3', 'cpu'); `rails`: choose_rails' answer."""
    if not devices:
        raise ValueError("no TP rank to plan rails for")
    if not rails:
        raise ValueError("no rail to plan with")
    ordered = tuple(sorted(rails, key=lambda n: natural(n.name)))
    cpu = [r for r, d in enumerate(devices) if not str(d).startswith("cuda")]
    by_rank: list[tuple[str, ...]] = [()] * len(devices)
    for r, dev in enumerate(devices):
        if r in cpu:
            continue
        index = int(str(dev).partition(":")[2] or 0)
        if index >= len(topo.gpus):
            raise ValueError(f"TP rank {r} is on {dev}, but this host shows {len(topo.gpus)} GPU(s) in sysfs")
        by_rank[r] = tuple(n.name for n in nearest(topo.gpus[index], ordered))
    n, total = len(cpu), len(ordered)
    for i, r in enumerate(cpu):  # round-robin; fewer ranks than rails: each takes every n-th rail
        by_rank[r] = (ordered[i % total].name,) if n >= total else tuple(x.name for x in ordered[i::n])
    return RailPlan(tuple(x.name for x in ordered), tuple(by_rank))


def describe(plan: RailPlan, topo: Topology, devices: Sequence[str]) -> list[str]:
    """Lines for a person: what the node has and which rank writes through what."""
    lines = [f"GPUs: {len(topo.gpus)}"]
    for g in topo.gpus:
        lines.append(f"  GPU {g.index} {g.vendor} {g.pci.address} (NUMA {g.pci.numa}, under {' > '.join(g.pci.chain[:-1]) or g.pci.root})")
    lines.append("NICs:")
    for nic in topo.nics:
        where = f"{nic.pci.address} (NUMA {nic.pci.numa})" if nic.pci else "virtual"
        lines.append(f"  {nic.name} [{nic.kind.value}] {where}" + (f": not a rail, {nic.unusable}" if nic.unusable else ""))
    lines.append(f"rails: {', '.join(plan.rails)}; used: {', '.join(plan.used())}")
    lines += [f"  TP rank {r} ({devices[r]}) -> {', '.join(mine)}" for r, mine in enumerate(plan.by_rank)]
    return lines


def nearest_rails(gpu_address: str, rails: Sequence[str], topo: Topology) -> tuple[int, ...]:
    """Indices into `rails` (a server's rail interfaces, in --rails order) of those nearest the
    GPU at PCI address `gpu_address` ("0000:61:00.0"): what its rank's writes prefer. Every
    index when the GPU or no rail's PCI position is known (a virtual interface): no preference."""
    gpu = next((g for g in topo.gpus if g.pci.address.lower() == gpu_address.lower()), None)
    nics = {n.name: n for n in topo.nics if n.kind is NicKind.NET and n.pci is not None}
    known = [(i, nics[name]) for i, name in enumerate(rails) if name in nics]
    if gpu is None or not known:
        return tuple(range(len(rails)))
    best = nearest(gpu, [n for _, n in known])
    return tuple(i for i, n in known if n in best)
