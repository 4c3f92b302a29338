"""Hand-built sysfs trees of machines this project has no access to, shaped as Linux shows them
(``/sys/devices/pciDDDD:BB/<root port>/<switch ports>/<device>``, ``/sys/bus/pci/devices``
links, ``/sys/class/{net,infiniband}/X/device`` links), for the rail planner's tests."""

from __future__ import annotations

import os
from pathlib import Path

NVIDIA, AMAZON, MELLANOX, INTEL = "0x10de", "0x1d0f", "0x15b3", "0x8086"
GPU_CLASS, NIC_CLASS, NVME_CLASS = "0x030200", "0x020000", "0x010802"


class Tree:
    def __init__(self, root: Path) -> None:
        self.sys = root

    def device(self, root: str, chain: list[str], numa: int | None, vendor: str, cls: str) -> Path:
        d = self.sys / "devices" / root
        for addr in chain:
            d = d / addr
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{-1 if numa is None else numa}\n")
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
        bus = self.sys / "bus" / "pci" / "devices"
        bus.mkdir(parents=True, exist_ok=True)
        (bus / chain[-1]).symlink_to(os.path.relpath(d, bus))
        return d

    def rdma(self, name: str, device: Path) -> None:
        entry = self.sys / "class" / "infiniband" / name
        entry.mkdir(parents=True)
        (entry / "device").symlink_to(os.path.relpath(device, entry))

    def net(self, name: str, device: Path | None = None, operstate: str = "up", bridge: bool = False,
            master: str = "", loopback: bool = False) -> None:
        entry = self.sys / "class" / "net" / name
        entry.mkdir(parents=True)
        (entry / "operstate").write_text(operstate + "\n")
        (entry / "type").write_text("772\n" if loopback else "1\n")
        if device is not None:
            (entry / "device").symlink_to(os.path.relpath(device, entry))
        if bridge:
            (entry / "bridge").mkdir()
        if master:
            (entry / "master").symlink_to(f"../{master}")


def switch(root_port: str, bus: int, ports: int) -> tuple[list[str], list[list[str]]]:
    """A PCIe switch under `root_port`: its upstream port on `bus`, `ports` downstream ports on
    bus + 1; returns (the chain to the upstream port, one chain per downstream slot ending in
    the device's address on the bus below that port)."""
    up = [root_port, f"0000:{bus:02x}:00.0"]
    slots = []
    for k in range(ports):
        down = f"0000:{bus + 1:02x}:{k:02x}.0"
        slots.append(up + [down, f"0000:{bus + 2 + k:02x}:00.0"])
    return up, slots


def aws_p5(root: Path) -> Tree:
    """p5.48xlarge: 8 H100, 32 EFA (100 Gb/s each), 2 sockets; each PCIe switch holds one GPU,
    four EFA interfaces and one NVMe drive (Perplexity, "High-Performance GPU Memory Transfer
    on AWS Sagemaker Hyperpod", 2025: "each PCIe switch connecting to one H100 GPU, four 100
    Gbps EFA cards, and one NVMe SSD"; AWS: 3200 Gbps of EFA per instance). GPUs 0-3 on NUMA
    node 0, 4-7 on node 1; EFA devices named rdmap<bus>s0 as on the instance."""
    t = Tree(root)
    for i in range(8):
        socket = i // 4
        rc = "pci0000:00" if socket == 0 else "pci0000:80"
        base = (0x10 if socket == 0 else 0x90) + 0x20 * (i % 4)
        _, slots = switch(f"0000:{rc[-2:]}:{i % 4 + 1:02x}.0", base, 6)
        t.device(rc, slots[0], socket, NVIDIA, GPU_CLASS)
        for j in range(4):
            dev = t.device(rc, slots[1 + j], socket, AMAZON, NIC_CLASS)
            t.rdma(f"rdmap{base + 3 + j}s0", dev)
        t.device(rc, slots[5], socket, AMAZON, NVME_CLASS)
    t.net("ens32", t.device("pci0000:00", ["0000:00:05.0"], 0, AMAZON, NIC_CLASS))  # the ENA: the host's address
    t.net("lo", loopback=True)
    return t


# DGX H100 User Guide, "Network Modules" table: the ConnectX-7 port each GPU pairs with
# (GPU -> RDMA device, interface ibp<bus>s0). Each GPU sits under the same PCIe switch as its
# NIC (here: the GPU 3 buses below it); GPUs 0-3 on NUMA node 0, 4-7 on node 1.
DGX_PAIRS = [(0, "mlx5_0", 24), (1, "mlx5_3", 64), (2, "mlx5_4", 79), (3, "mlx5_5", 94),
             (4, "mlx5_6", 154), (5, "mlx5_9", 192), (6, "mlx5_10", 206), (7, "mlx5_11", 220)]


def dgx_h100(root: Path) -> Tree:
    """8 H100, 8 ConnectX-7 for the compute fabric (one under each GPU's switch), plus the two
    in-band/storage ConnectX-7 (mlx5_1 on socket 0, mlx5_7 on socket 1) under no GPU's switch."""
    t = Tree(root)
    for gpu, name, nic_bus in DGX_PAIRS:
        socket = gpu // 4
        rc = "pci0000:00" if socket == 0 else "pci0000:80"
        up = [f"0000:{rc[-2:]}:{gpu % 4 + 1:02x}.0", f"0000:{nic_bus - 2:02x}:00.0"]
        dev = t.device(rc, up + [f"0000:{nic_bus - 1:02x}:00.0", f"0000:{nic_bus:02x}:00.0"], socket, MELLANOX, NIC_CLASS)
        t.rdma(name, dev)
        t.net(f"ibp{nic_bus}s0", dev)
        t.device(rc, up + [f"0000:{nic_bus - 1:02x}:01.0", f"0000:{nic_bus + 3:02x}:00.0"], socket, NVIDIA, GPU_CLASS)
    for name, socket, bus in (("mlx5_1", 0, 0x2a), ("mlx5_7", 1, 0xaa)):
        rc = "pci0000:00" if socket == 0 else "pci0000:80"
        dev = t.device(rc, [f"0000:{rc[-2:]}:07.0", f"0000:{bus:02x}:00.0"], socket, MELLANOX, NIC_CLASS)
        t.rdma(name, dev)
    t.net("lo", loopback=True)
    return t


def fewer_nics(root: Path) -> Tree:
    """A 2-socket server with 8 GPUs (one per root port) and one NIC per socket, on a root port
    of its own: no NIC shares a switch with a GPU; NUMA decides."""
    t = Tree(root)
    for i in range(8):
        socket = i // 4
        rc = "pci0000:00" if socket == 0 else "pci0000:80"
        t.device(rc, [f"0000:{rc[-2:]}:{i % 4 + 1:02x}.0", f"0000:{0x10 * (i + 1):02x}:00.0"], socket, NVIDIA,
                 GPU_CLASS)
    for name, socket in (("eth0", 0), ("eth1", 1)):
        rc = "pci0000:00" if socket == 0 else "pci0000:80"
        t.net(name, t.device(rc, [f"0000:{rc[-2:]}:08.0", f"0000:{0x0a + 0x80 * socket:02x}:00.0"], socket, INTEL,
                             NIC_CLASS))
    t.net("lo", loopback=True)
    return t


def cpu_host(root: Path) -> Tree:
    """No GPU: two PCI NICs, one of them down, a bridge and its veth member, a free veth, lo."""
    t = Tree(root)
    t.net("eth0", t.device("pci0000:00", ["0000:00:03.0"], None, INTEL, NIC_CLASS))
    t.net("eth1", t.device("pci0000:00", ["0000:00:04.0"], None, INTEL, NIC_CLASS))
    t.net("eth2", t.device("pci0000:00", ["0000:00:05.0"], None, INTEL, NIC_CLASS), operstate="down")
    t.net("docker0", bridge=True)
    t.net("veth1a2b", master="docker0")
    t.net("rail2", operstate="unknown")  # a namespace host's second veth: virtual, carries traffic
    t.net("lo", loopback=True)
    return t
