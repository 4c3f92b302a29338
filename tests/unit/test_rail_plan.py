"""The rail planner (sglang_disagg/rails) on recorded machines: sysfs trees built by hand in
sysfs_tree.py (an AWS p5, a DGX H100, a server with fewer NICs than GPUs, a CPU host), read by
the same reader a real node uses, each with the plan it must give written out here."""

from __future__ import annotations

import random

import pytest

from sglang_disagg.rails import NicKind, Topology, choose_rails, plan_rails, read_topology
from sglang_disagg.rails.plan import nearness

from . import sysfs_tree

GPUS8 = [f"cuda:{i}" for i in range(8)]

P5 = {0: ("rdmap19s0", "rdmap20s0", "rdmap21s0", "rdmap22s0"), 1: ("rdmap51s0", "rdmap52s0", "rdmap53s0", "rdmap54s0"),
      2: ("rdmap83s0", "rdmap84s0", "rdmap85s0", "rdmap86s0"),
      3: ("rdmap115s0", "rdmap116s0", "rdmap117s0", "rdmap118s0"),
      4: ("rdmap147s0", "rdmap148s0", "rdmap149s0", "rdmap150s0"),
      5: ("rdmap179s0", "rdmap180s0", "rdmap181s0", "rdmap182s0"),
      6: ("rdmap211s0", "rdmap212s0", "rdmap213s0", "rdmap214s0"),
      7: ("rdmap243s0", "rdmap244s0", "rdmap245s0", "rdmap246s0")}
# The DGX H100 User Guide's pairs (sysfs_tree.DGX_PAIRS): GPU i -> its ConnectX-7.
DGX = {0: ("mlx5_0",), 1: ("mlx5_3",), 2: ("mlx5_4",), 3: ("mlx5_5",), 4: ("mlx5_6",), 5: ("mlx5_9",),
       6: ("mlx5_10",), 7: ("mlx5_11",)}
FEWER = {r: ("eth0",) if r < 4 else ("eth1",) for r in range(8)}


@pytest.fixture
def machine(tmp_path):
    def build(name: str) -> Topology:
        getattr(sysfs_tree, name)(tmp_path / name)
        return read_topology(tmp_path / name)
    return build


@pytest.mark.parametrize("name,kind,expected", [
    ("aws_p5", NicKind.RDMA, P5), ("dgx_h100", NicKind.RDMA, DGX), ("fewer_nics", NicKind.NET, FEWER)])
def test_each_gpu_writes_through_the_nics_under_its_own_switch(machine, name, kind, expected):
    topo = machine(name)
    assert len(topo.gpus) == 8
    plan = plan_rails(GPUS8, topo, choose_rails(topo, kind))
    assert dict(enumerate(plan.by_rank)) == expected
    # A TP 2 server on GPUs 4 and 5 of the same node: the same NICs for the same GPUs.
    assert plan_rails(["cuda:4", "cuda:5"], topo, choose_rails(topo, kind)).by_rank == (expected[4], expected[5])


def test_the_dgx_storage_nics_are_rails_but_nearest_no_gpu(machine):
    topo = machine("dgx_h100")
    plan = plan_rails(GPUS8, topo, choose_rails(topo, NicKind.RDMA))
    assert "mlx5_1" in plan.rails and "mlx5_7" in plan.rails
    assert set(plan.rails) - set(plan.used()) == {"mlx5_1", "mlx5_7"}
    # Named rails: only the compute fabric's (what a deployment file would say).
    named = choose_rails(topo, NicKind.RDMA, [n for pair in DGX.values() for n in pair])
    assert plan_rails(GPUS8, topo, named).used() == plan_rails(GPUS8, topo, named).rails


@pytest.mark.parametrize("ranks,expected", [
    (1, [("eth0", "eth1", "rail2")]),                        # one rank stripes over every rail
    (2, [("eth0", "rail2"), ("eth1",)]),                     # fewer ranks than rails: every rail still used
    (3, [("eth0",), ("eth1",), ("rail2",)]),
    (4, [("eth0",), ("eth1",), ("rail2",), ("eth0",)]),      # round-robin
])
def test_cpu_ranks_spread_round_robin_and_a_single_rank_stripes(machine, ranks, expected):
    topo = machine("cpu_host")
    rails = choose_rails(topo, NicKind.NET)
    assert [n.name for n in rails] == ["eth0", "eth1", "rail2"]  # not lo, the bridge, its member, a down link
    assert list(plan_rails(["cpu"] * ranks, topo, rails).by_rank) == expected


def test_why_an_interface_is_not_a_rail(machine):
    topo = machine("cpu_host")
    why = {n.name: n.unusable for n in topo.nics}
    assert why == {"docker0": "a bridge", "eth0": "", "eth1": "", "eth2": "link down", "lo": "loopback",
                   "rail2": "", "veth1a2b": "a member of docker0"}


def test_a_named_rail_that_does_not_exist_or_cannot_carry_is_refused_with_the_list(machine):
    topo = machine("cpu_host")
    with pytest.raises(ValueError) as e:
        choose_rails(topo, NicKind.NET, ["eth9"])
    msg = str(e.value)
    assert "rail 'eth9' cannot be used (there is no such NIC)" in msg
    assert "eth0, eth1, eth2 (link down)" in msg and "lo (loopback)" in msg
    with pytest.raises(ValueError, match=r"rail 'eth2' cannot be used \(it is link down\)"):
        choose_rails(topo, NicKind.NET, ["eth2"])
    with pytest.raises(ValueError, match="no usable rdma NIC"):
        choose_rails(topo, NicKind.RDMA)
    with pytest.raises(ValueError, match="shows 0 GPU"):
        plan_rails(["cuda:0"], topo, choose_rails(topo, NicKind.NET))


@pytest.mark.parametrize("name,kind", [("aws_p5", NicKind.RDMA), ("dgx_h100", NicKind.RDMA),
                                       ("fewer_nics", NicKind.NET), ("cpu_host", NicKind.NET)])
def test_invariants(machine, name, kind):
    """Deterministic whatever order the NICs are listed in; a GPU rank's rails are exactly its
    nearest; on CPU every rail is used whatever the rank count."""
    topo = machine(name)
    rails = choose_rails(topo, kind)
    devices = [f"cuda:{g.index}" for g in topo.gpus] or ["cpu"]
    plan = plan_rails(devices, topo, rails)
    shuffled = list(rails)
    random.Random(7).shuffle(shuffled)
    assert plan_rails(devices, topo, shuffled) == plan
    for r, mine in enumerate(plan.by_rank):
        assert mine, f"rank {r} has no rail"
        if topo.gpus:
            best = max(nearness(topo.gpus[r], n) for n in rails)
            assert {n.name for n in rails if nearness(topo.gpus[r], n) == best} == set(mine)
    if not topo.gpus:
        for ranks in range(1, 6):
            assert set(plan_rails(["cpu"] * ranks, topo, rails).used()) == set(plan.rails)


def test_this_machine_has_a_plan():
    """The real sysfs here (a CPU VM): at least one usable interface, and a plan for it."""
    topo = read_topology()
    rails = choose_rails(topo, NicKind.NET)
    assert plan_rails(["cpu", "cpu"], topo, rails).used()


def test_a_gpu_regions_rails_are_the_interfaces_nearest_its_gpu(machine):
    """What the libfabric backend prefers for a CUDA region (rails/plan.nearest_rails): the
    --rails interfaces nearest the region's GPU, found by the GPU's PCI address."""
    from sglang_disagg.rails.plan import nearest_rails

    topo = machine("dgx_h100")
    rails = [f"ibp{bus}s0" for _, _, bus in sysfs_tree.DGX_PAIRS]  # every compute NIC's interface, GPU order
    for i, gpu in enumerate(topo.gpus):
        assert nearest_rails(gpu.pci.address, rails, topo) == (i,), gpu  # the User Guide's pair
    assert nearest_rails(topo.gpus[5].pci.address, ["ibp24s0", "ibp192s0"], topo) == (1,)
    fewer = machine("fewer_nics")
    assert [nearest_rails(g.pci.address, ["eth0", "eth1"], fewer) for g in fewer.gpus] == [(0,)] * 4 + [(1,)] * 4
    # a GPU or rails the tree does not show: no preference, every rail
    assert nearest_rails("0000:ff:00.0", rails, topo) == tuple(range(8))
    assert nearest_rails(topo.gpus[0].pci.address, ["rail1", "rail2"], topo) == (0, 1)
