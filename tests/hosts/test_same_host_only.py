"""Same-host-only backends are refused at first contact by a peer on another host.

A listener runs in one host, a dialer in another (netns.py: own /proc, /dev/shm, network).
The refusal must come at the handshake, within 2 s, and say the peer is not on this host;
the same dialer run in the listener's host (the control) connects and writes, so the
refusal is about where the peer is, not about the address or the backend.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from harness.hosts import netns
from sglang_disagg.backends.reach import NOT_HERE

from .conftest import deployment

PEER = Path(__file__).with_name("peer.py")
PORT = 29517


def _listen(net: netns.Network, host: str, backend: str, provider: str, d: Path):
    addr = f"{net[host].address}:{PORT}"
    proc = net[host].popen([sys.executable, str(PEER), "listen", backend, provider, net[host].address, str(PORT),
                            str(d)], d / "listen.log")
    deadline = time.monotonic() + 60
    while not (d / "listening").exists():
        assert proc.poll() is None, (d / "listen.log").read_text()
        assert time.monotonic() < deadline, "listener did not start"
        time.sleep(0.1)
    return addr, proc


def landed(d: Path, wait_s: float = 1.0) -> int:
    """Writes the listener saw land in its memory (it polls every 0.1 s)."""
    time.sleep(wait_s)
    return int((d / "landed").read_text()) if (d / "landed").exists() else 0


def _dial(net: netns.Network, host: str, backend: str, provider: str, addr: str, d: Path) -> dict:
    r = net[host].run([sys.executable, str(PEER), "dial", backend, provider, net[host].address, addr, str(d)],
                      timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"landed": landed(d)}


@pytest.fixture
def two_hosts(hosts_possible):
    net = netns.Network.create("same", ["a", "b"])
    yield net
    net.close()


def test_shmem_is_refused_at_first_contact_by_a_peer_on_another_host(two_hosts, tmp_path):
    addr, listener = _listen(two_hosts, "a", "shmem", "-", tmp_path)
    try:
        same = _dial(two_hosts, "a", "shmem", "-", addr, tmp_path)
        assert same.get("write") == "completed", f"control (same host) did not work: {same}"
        other = _dial(two_hosts, "b", "shmem", "-", addr, tmp_path)
    finally:
        listener.kill()
    print("shmem across hosts:", other)
    assert "refused" in other, f"shmem connected across hosts: {other}"
    assert NOT_HERE in other["refused"] and "memory cannot be reached" in other["refused"], other
    assert other["seconds"] < 2.0, other


@pytest.mark.e2e
def test_a_shmem_deployment_across_hosts_stops_the_decoder_at_first_contact(network, tmp_path):
    """As an operator would meet it: the deployment file says shmem, the groups are on two
    hosts; the decoder's launcher stops at start-up with the prefill server's reason."""
    dep = deployment(tmp_path, network, backend="shmem")
    try:
        prefill, decode = dep.launch("prefill-0", "prefill"), dep.launch("decode-0", "decode")
        prefill.wait_up(time.monotonic() + 300)
        code = decode.wait_exit(300)
        out = decode.output(80)
    finally:
        dep.close()
    assert code != 0, out
    assert "cannot use its prefill server" in out and NOT_HERE in out, out
    assert "memory cannot be reached" in out, out
