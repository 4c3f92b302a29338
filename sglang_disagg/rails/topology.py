"""Where a node's GPUs and NICs sit: their PCI paths and NUMA nodes, read from sysfs.

A rail is one NIC a server's messenger writes through. Which NIC is near which GPU is a fact
of the machine's PCIe tree: a GPU and a NIC under the same PCIe switch share an upstream
bridge, so their paths in ``/sys/devices`` share a longer prefix than either shares with a
device under another switch; the NUMA node says which CPU socket the tree hangs from. This
module only reads those facts (``read_topology``); plan.py decides, without touching the
machine, which rank uses which rail, so it is tested on recorded machines (tests/unit/
test_rail_plan.py builds sysfs trees of an AWS p5, a DGX H100, ...).

What counts as a NIC: an RDMA device (``/sys/class/infiniband``: EFA, mlx5) or a network
interface (``/sys/class/net``), by ``kind``; loopback, bridges, bonds' members and links that
are not up are read but marked unusable, with the reason (``Nic.unusable``). A virtual
interface (a veth, a namespace's link) has no PCI device: it is a rail on a CPU host, near no
GPU.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
GPU_VENDORS = {"0x10de": "nvidia", "0x1002": "amd"}
GPU_CLASSES = ("0x0300", "0x0302")  # VGA / 3D controller (the class file's first 4 hex digits)
ARPHRD_LOOPBACK = "772"


class NicKind(enum.Enum):
    RDMA = "rdma"  # /sys/class/infiniband: libfabric's verbs and efa providers' domains
    NET = "net"    # /sys/class/net: the tcp provider's domains (one per interface)


@dataclass(frozen=True, slots=True)
class PciPosition:
    """A device's place in the PCIe tree: its root complex ("pci0000:00") and the chain of
    PCI addresses from the root port down to the device itself; its NUMA node (None: the
    firmware did not say, as on single-socket hosts and most VMs)."""

    root: str
    chain: tuple[str, ...]
    numa: int | None

    @property
    def address(self) -> str:
        return self.chain[-1]

    def shared(self, other: PciPosition) -> int:
        """How many bridges above both devices their paths share: >= 1 under one PCIe
        switch (its upstream port at least), 0 when only the root complex is common, -1
        under different root complexes. More shared bridges, fewer hops between them."""
        if self.root != other.root:
            return -1
        n = 0
        for a, b in zip(self.chain[:-1], other.chain[:-1]):
            if a != b:
                break
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int          # in PCI address order (CUDA's order with CUDA_DEVICE_ORDER=PCI_BUS_ID)
    vendor: str
    pci: PciPosition


@dataclass(frozen=True, slots=True)
class Nic:
    name: str                 # the interface (eth0, ens5) or RDMA device (mlx5_0, rdmap16s27)
    kind: NicKind
    pci: PciPosition | None   # None: a virtual interface
    unusable: str = ""        # why it is no rail ("" when it is one)


@dataclass(frozen=True, slots=True)
class Topology:
    gpus: tuple[Gpu, ...]
    nics: tuple[Nic, ...]

    def rails(self, kind: NicKind) -> tuple[Nic, ...]:
        return tuple(n for n in self.nics if n.kind is kind and not n.unusable)


def _position(device: Path) -> PciPosition | None:
    """The PCI position of a sysfs device directory (a class entry's ``device`` link)."""
    try:
        real = device.resolve(strict=True)
    except OSError:
        return None
    parts = real.parts
    roots = [i for i, p in enumerate(parts) if p.startswith("pci") and ":" in p]
    if not roots:
        return None
    chain = tuple(p for p in parts[roots[-1] + 1:] if PCI_ADDRESS.match(p))
    if not chain:
        return None
    numa = _read(real / "numa_node")
    return PciPosition(parts[roots[-1]], chain, int(numa) if numa and int(numa) >= 0 else None)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _net_unusable(entry: Path) -> str:
    if entry.name == "lo" or _read(entry / "type") == ARPHRD_LOOPBACK:
        return "loopback"
    if (entry / "bridge").exists():
        return "a bridge"
    if (entry / "master").exists():
        return f"a member of {Path(_read_link(entry / 'master')).name}"
    state = _read(entry / "operstate")
    if state not in ("up", "unknown"):  # "unknown": virtual links that report no state, yet carry traffic
        return f"link {state or 'state unreadable'}"
    return ""


def _read_link(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return ""


def read_topology(sysfs: str | Path = "/sys") -> Topology:
    """The GPUs and NICs of this node (or of a recorded sysfs tree at `sysfs`)."""
    root = Path(sysfs)
    gpus = []
    for dev in sorted((root / "bus" / "pci" / "devices").glob("*")):
        vendor = GPU_VENDORS.get(_read(dev / "vendor"))
        if vendor and _read(dev / "class")[:6] in GPU_CLASSES and (pos := _position(dev)) is not None:
            gpus.append((pos.address, vendor, pos))
    nics = []
    for entry in sorted((root / "class" / "infiniband").glob("*")):
        pos = _position(entry / "device")
        nics.append(Nic(entry.name, NicKind.RDMA, pos, "" if pos else "no PCI device"))
    for entry in sorted((root / "class" / "net").glob("*")):
        nics.append(Nic(entry.name, NicKind.NET, _position(entry / "device"), _net_unusable(entry)))
    return Topology(tuple(Gpu(i, v, p) for i, (_, v, p) in enumerate(sorted(gpus))), tuple(nics))
