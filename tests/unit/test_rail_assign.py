"""Write groups onto rail pairs (sglang_disagg/rails/assign.py), over the real planner's groups:
spread by bytes over a rank's rails, only through rails the source rank owns and the destination
rank takes, the same number of writes whatever the rails, and MLA's drawn replica spreading
over both replicas' NICs across requests."""

from __future__ import annotations

import ipaddress
from collections import Counter

import pytest

from sglang_disagg.messenger.planner import KVGeometry, ShardPlan
from sglang_disagg.rails.assign import Route, assign
from sglang_disagg.rails.pairing import pair_rails

TWO = pair_rails({"r0": [ipaddress.ip_interface("10.1.0.2/24")], "r1": [ipaddress.ip_interface("10.2.0.2/24")]},
                 {"p0": [ipaddress.ip_interface("10.1.0.7/24")], "p1": [ipaddress.ip_interface("10.2.0.7/24")]})
LLAMA = KVGeometry(num_layers=8, kv_heads=4, head_dim=64, v_head_dim=64, page_size=16, dtype_bytes=4)
MLA = KVGeometry(num_layers=4, kv_heads=1, head_dim=160, v_head_dim=0, page_size=16, dtype_bytes=4, replicated=True)


def bytes_by_route(groups, routes) -> Counter:
    c = Counter()
    for g, r in zip(groups, routes):
        c[r] += g.writes * g.length
    return c


def test_one_rank_stripes_evenly_over_both_rails_and_the_writes_are_the_plans():
    plan = ShardPlan.build(LLAMA, 1, 1)
    groups = plan.groups(range(10), range(100, 110))
    routes = assign(groups, [("r0", "r1")], TWO, seed=5)
    spread = bytes_by_route(groups, routes)
    assert set(spread) == {Route("r0", "p0"), Route("r1", "p1")}
    assert spread[Route("r0", "p0")] == spread[Route("r1", "p1")]
    assert sum(g.writes for g in groups) == plan.total_writes(10)  # rails change nothing the decoder counts


def test_each_source_rank_uses_only_its_own_rails():
    plan = ShardPlan.build(LLAMA, 2, 1)
    groups = plan.groups(range(4), range(4))
    routes = assign(groups, [("r0",), ("r1",)], TWO, seed=1)
    assert {(g.src_rank, r.local) for g, r in zip(groups, routes)} == {(0, "r0"), (1, "r1")}


def test_the_destination_ranks_nearest_rail_is_taken_when_known():
    plan = ShardPlan.build(LLAMA, 1, 2)
    groups = plan.groups(range(4), range(4))
    routes = assign(groups, [("r0", "r1")], TWO, seed=3, dst_by_rank=[("p0",), ("p1",)])
    assert {(g.dst_rank, r) for g, r in zip(groups, routes)} == {(0, Route("r0", "p0")), (1, Route("r1", "p1"))}


def test_mla_requests_spread_over_both_replicas_and_both_nics():
    """TP 2 -> 1, one rail per prefill rank: the replica drawn per request picks the NIC."""
    base = ShardPlan.build(MLA, 2, 1)
    used = Counter()
    for tag in range(12):
        plan = base.for_request(tag)
        groups = plan.groups(range(3), range(3))
        assert len({g.src_rank for g in groups}) == 1  # one replica per destination rank and request
        used.update(r.local for r in assign(groups, [("r0",), ("r1",)], TWO, seed=tag))
    assert set(used) == {"r0", "r1"}, used


def test_the_first_rail_differs_between_requests():
    groups = ShardPlan.build(LLAMA, 1, 1).groups([0], [0])
    firsts = {assign(groups, [("r0", "r1")], TWO, seed=s)[0] for s in range(16)}
    assert firsts == {Route("r0", "p0"), Route("r1", "p1")}


def test_no_route_is_refused_naming_the_rails():
    groups = ShardPlan.build(LLAMA, 1, 1).groups([0], [0])
    with pytest.raises(ValueError, match=r"no rail of \['r0'\] reaches \['p1'\]"):
        assign(groups, [("r0",)], TWO, seed=0, dst_by_rank=[("p1",)])
