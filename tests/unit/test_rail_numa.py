"""Where a rail's progress thread runs (sglang_disagg/rails/numa.py), on hand-built sysfs trees:
its NIC's NUMA node's CPUs, within what the process may use; left alone wherever that is unknown."""

from __future__ import annotations

import threading

from sglang_disagg.rails.numa import nic_cpus, parse_cpulist, place_thread


def tree(root, nodes: dict[int, str], nics: dict[str, int]):
    for n, cpus in nodes.items():
        d = root / f"devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    for name, node in nics.items():
        d = root / f"class/net/{name}/device"
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


def test_cpulists_read_as_linux_writes_them():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5} and parse_cpulist("") == set()


def test_a_rail_thread_goes_to_its_nics_node_within_the_allowed_cpus(tmp_path):
    sysfs = tree(tmp_path, {0: "0-7", 1: "8-15"}, {"eth0": 0, "rail1": 1, "virt0": -1})
    everything = set(range(16))
    assert nic_cpus("eth0", everything, sysfs) == set(range(8))
    assert nic_cpus("rail1", everything, sysfs) == set(range(8, 16))
    assert nic_cpus("rail1", {2, 9, 10}, sysfs) == {9, 10}  # --pin-cores: only what the process has
    assert nic_cpus("rail1", {0, 1}, sysfs) is None  # none of its node's CPUs allowed: left alone
    assert nic_cpus("virt0", everything, sysfs) is None  # the firmware did not say
    assert nic_cpus("nosuch", everything, sysfs) is None


def test_one_numa_node_places_nothing(tmp_path):
    sysfs = tree(tmp_path, {0: "0-1"}, {"eth0": 0})
    assert nic_cpus("eth0", {0, 1}, sysfs) is None


def test_this_machine_leaves_the_thread_where_it_was():
    got = []
    t = threading.Thread(target=lambda: got.append(place_thread("lo")))  # lo has no device: never placed
    t.start()
    t.join()
    assert got == [None]
