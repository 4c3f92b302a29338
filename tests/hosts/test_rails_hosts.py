"""Namespace hosts with several rails (harness/hosts/netns.py, ``rails=3``): each host has eth0 and
rail1, rail2, each on a bridge and subnet of its own, as a multi-rail node has one network per
NIC. What issue 42's tests will stand on: traffic to a peer's rail address crosses that rail and
no other (the kernel's interface counters), a rail's cable is cut alone, and the rail pairing
read from the hosts' real interfaces pairs each rail with the peer's on the same subnet."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import pytest

from harness.hosts import netns
from sglang_disagg.rails.pairing import pair_rails

pytestmark = pytest.mark.e2e

MiB = 1 << 20
# Receive everything from one connection on PORT, print how much; run inside host b.
SINK = ("import socket, sys\n"
        "s = socket.create_server((sys.argv[1], 7070)); print('ready', flush=True)\n"
        "c, _ = s.accept(); n = 0\n"
        "while (b := c.recv(1 << 16)): n += len(b)\n"
        "print(n, flush=True)\n")
SEND = ("import socket, sys\n"
        "t = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0\n"
        "c = socket.create_connection((sys.argv[1], 7070), timeout=t); c.sendall(b'x' * int(sys.argv[2])); c.close()\n")
ADDRS = ("import json, socket\n"
         "from sglang_disagg.rails.pairing import interface_addresses\n"
         "print(json.dumps({n: [str(a) for a in interface_addresses(n)] for _, n in socket.if_nameindex() if n != 'lo'}))\n")


@pytest.fixture(scope="module")
def net(hosts_possible):
    with netns.Network.create("rails", ["a", "b"], rails=3) as n:
        yield n


def send(net, rail: int, size: int) -> dict[str, int]:
    """`size` bytes from a to b's address on `rail`; tx bytes of each of a's interfaces meanwhile."""
    a, b = net["a"], net["b"]
    names = [a.interface] + [r[0] for r in a.rails]
    before = {i: a.counters(i)["tx_bytes"] for i in names}
    sink = subprocess.Popen(b.argv([sys.executable, "-c", SINK, b.rail_address(rail)]), stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        r = a.run([sys.executable, "-c", SEND, b.rail_address(rail), str(size)], timeout=30)
        assert r.returncode == 0, r.stderr
        assert int(sink.stdout.readline()) == size
    finally:
        sink.kill()
        sink.wait(5)
    return {i: a.counters(i)["tx_bytes"] - before[i] for i in names}


def test_each_rail_is_its_own_network_and_carries_only_its_traffic(net):
    a, b = net["a"], net["b"]
    assert [r[0] for r in a.rails] == ["rail1", "rail2"]
    assert (a.rail_address(1), b.rail_address(2)) == ("10.77.1.1", "10.77.2.2")
    for rail, iface in ((0, "eth0"), (1, "rail1"), (2, "rail2")):
        sent = send(net, rail, 4 * MiB)
        assert sent[iface] >= 4 * MiB, sent
        assert all(v < 64 * 1024 for k, v in sent.items() if k != iface), f"rail {rail}'s bytes crossed {sent}"


def test_a_rail_cut_alone(net):
    net.link("b", False, rail=1)
    try:
        r = net["a"].run([sys.executable, "-c", SEND, net["b"].rail_address(1), "1", "1.0"], timeout=30)
        assert r.returncode != 0 and "timed out" in r.stderr, r.stderr  # the SYN never arrives
        assert send(net, 2, MiB)["rail2"] >= MiB  # the other rails carry on
    finally:
        net.link("b", True, rail=1)
    assert send(net, 1, MiB)["rail1"] >= MiB


def test_rails_read_from_the_hosts_pair_by_subnet(net):
    seen = {}
    for name in ("a", "b"):
        r = net[name].run([sys.executable, "-c", ADDRS], timeout=30)
        assert r.returncode == 0, r.stderr
        seen[name] = {n: [ipaddress.ip_interface(x) for x in v] for n, v in json.loads(r.stdout).items()}
    assert set(seen["a"]) == {"eth0", "rail1", "rail2"}
    p = pair_rails(seen["a"], seen["b"])
    assert p.pairs == (("eth0", "eth0"), ("rail1", "rail1"), ("rail2", "rail2")) and p.unpaired == ()
