"""Rails pair by reachability (sglang_disagg/rails/pairing.py): a local rail writes to the peer's
rails on its networks, so servers with different rail counts link; one sharing no network is
left out, and no pair at all is refused naming both sides' addresses."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from sglang_disagg.rails.pairing import interface_addresses, pair_rails


def rails(**named: str) -> dict[str, list]:
    return {n: [ipaddress.ip_interface(a) for a in addrs.split()] for n, addrs in named.items()}


def test_two_rails_each_pair_with_the_peer_rail_on_their_subnet():
    p = pair_rails(rails(r0="10.1.0.2/24", r1="10.2.0.2/24"), rails(p0="10.1.0.7/24", p1="10.2.0.7/24"))
    assert p.pairs == (("r0", "p0"), ("r1", "p1")) and p.unpaired == ()


def test_different_rail_counts_still_link():
    four = rails(r0="10.1.0.2/24", r1="10.2.0.2/24", r2="10.3.0.2/24", r3="10.4.0.2/24")
    p = pair_rails(four, rails(p0="10.1.0.7/24", p1="10.3.0.7/24"))
    assert p.pairs == (("r0", "p0"), ("r2", "p1")) and p.unpaired == ("r1", "r3")
    # The other way round: the peer's two rails each reached by one of ours.
    q = pair_rails(rails(p0="10.1.0.7/24", p1="10.3.0.7/24"), four)
    assert q.pairs == (("p0", "r0"), ("p1", "r2"))
    # One flat network: every rail reaches every peer rail (the planner spreads over them).
    flat = pair_rails(rails(a="10.0.0.1/16", b="10.0.1.1/16"), rails(x="10.0.2.1/16"))
    assert flat.remote_for("a") == flat.remote_for("b") == ("x",)


def test_no_shared_network_is_refused_with_both_sides_addresses():
    with pytest.raises(ValueError) as e:
        pair_rails(rails(r0="10.1.0.2/24"), rails(p0="10.9.0.7/24", p1=""))
    msg = str(e.value)
    assert "local r0 (10.1.0.2/24)" in msg and "peer p0 (10.9.0.7/24), p1 (no address)" in msg


def test_interface_addresses_of_this_machine():
    assert interface_addresses("lo") == [ipaddress.IPv4Interface("127.0.0.1/8")]
    assert interface_addresses("no-such-if0") == []
    names = [n for _, n in socket.if_nameindex() if n != "lo"]
    assert any(interface_addresses(n) for n in names), f"no IPv4 address on any of {names}"
