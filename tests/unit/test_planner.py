"""The pure planner: every destination byte is written exactly once, with the right
bytes, and each decode rank's expected count is the number of writes that land on it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sglang_disagg.messenger.planner import (KVGeometry, Kind, Layout, ShardPlan, WriteGroup, pages_for,
                                             rank_heads, shard_pieces)

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (4, 1), (1, 4), (8, 2), (2, 8), (4, 4), (8, 8), (3, 1), (1, 3)]


def _geometry(kv_heads: int, layout: Layout, page_size: int = 4, head_dim: int = 8, v_head_dim: int = 8,
              layers: int = 2) -> KVGeometry:
    return KVGeometry(num_layers=layers, kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                      page_size=page_size, dtype_bytes=2, layout=layout)


def _shardable(kv_heads: int, tp: int) -> bool:
    return kv_heads % tp == 0 if tp <= kv_heads else tp % kv_heads == 0


# Each TP pair with every head count both sides can shard: replicated (tp > heads) and split.
CASES = [(s, d, h) for s, d in TP_PAIRS for h in (1, 2, 3, 4, 8) if _shardable(h, s) and _shardable(h, d)]


def _kv_heads_for(src_tp: int, dst_tp: int) -> int:
    return next(h for s, d, h in reversed(CASES) if (s, d) == (src_tp, dst_tp))


def _rank_buffer(g: KVGeometry, kind: Kind, heads: range, pages: int) -> np.ndarray:
    """A (layer, kind) buffer of one rank, as bytes, in the geometry's layout, where each
    element's value encodes (page, slot, global head, dim) so misplacement is visible."""
    dim = g.dim(kind)
    page, slot, head, d = np.meshgrid(np.arange(pages), np.arange(g.page_size), np.array(heads), np.arange(dim),
                                      indexing="ij")
    code = ((page * 131 + slot) * 257 + head) * 263 + d + 1 + int(kind) * 7  # never 0
    arr = code.astype(np.uint16)  # dtype_bytes == 2
    if g.layout is Layout.HND:
        arr = arr.transpose(0, 2, 1, 3)  # [page, head, slot, dim]
    return np.ascontiguousarray(arr).view(np.uint8).reshape(-1)


def _apply(groups: list[WriteGroup], src_bufs, dst_bufs, hits) -> None:
    for w in groups:
        src, dst, hit = src_bufs[w.src_rank, w.layer, w.kind], dst_bufs[w.dst_rank, w.layer, w.kind], \
            hits[w.dst_rank, w.layer, w.kind]
        for sp, dp in zip(w.src_pages, w.dst_pages):
            s0, d0 = sp * w.src_stride + w.src_offset, dp * w.dst_stride + w.dst_offset
            dst[d0:d0 + w.length] = src[s0:s0 + w.length]
            hit[d0:d0 + w.length] += 1


def _mla(layout: Layout = Layout.HND) -> KVGeometry:
    # One latent "head" (kv_lora_rank + rope dims), no separate V, held whole by every rank.
    return KVGeometry(num_layers=2, kv_heads=1, head_dim=12, v_head_dim=0, page_size=4, dtype_bytes=2,
                      layout=layout, replicated=True)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("src_tp, dst_tp, kv_heads", CASES)
def test_every_destination_byte_written_once_with_the_right_bytes(src_tp, dst_tp, kv_heads, layout):
    g = _geometry(kv_heads, layout, v_head_dim=8 if layout is Layout.NHD else 6)
    _check_bytes(ShardPlan.build(g, src_tp, dst_tp), src_tp, dst_tp)


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("src_tp, dst_tp", TP_PAIRS)
def test_mla_replica_sets_write_every_destination_byte_once(src_tp, dst_tp, seed):
    _check_bytes(ShardPlan.build(_mla(), src_tp, dst_tp).for_request(seed), src_tp, dst_tp)


def _check_bytes(plan: ShardPlan, src_tp: int, dst_tp: int) -> None:
    g = plan.geometry
    pool_pages = 7
    # The same logical pages live at different page ids on each side.
    src_pages, dst_pages = [5, 1, 3], [0, 6, 2]
    src = {(r, layer, k): _rank_buffer(g, k, plan.heads(src_tp, r), pool_pages)
           for r in range(src_tp) for layer in range(g.num_layers) for k in g.kinds}
    # The expected destination content: the same logical tokens, laid out for the decode rank.
    want = {(r, layer, k): _rank_buffer(g, k, plan.heads(dst_tp, r), pool_pages)
            for r in range(dst_tp) for layer in range(g.num_layers) for k in g.kinds}
    dst = {key: np.zeros_like(v) for key, v in want.items()}
    hits = {key: np.zeros(v.shape, dtype=np.int32) for key, v in want.items()}
    # Source page p holds what destination page q must hold: relabel the source codes.
    for key in src:
        src[key] = _relabel(g, key[2], plan.heads(src_tp, key[0]), pool_pages, dict(zip(src_pages, dst_pages)))

    groups = list(itertools.chain.from_iterable(
        plan.groups(src_pages, dst_pages, src_rank=r) for r in range(src_tp)))
    _apply(groups, src, dst, hits)
    assert plan.total_bytes(len(src_pages)) == sum(g.writes * g.length for g in groups)

    for key in want:
        page_bytes = len(want[key]) // pool_pages
        for q in range(pool_pages):
            block = slice(q * page_bytes, (q + 1) * page_bytes)
            if q in dst_pages:
                assert (hits[key][block] == 1).all(), f"rank/layer/kind {key} page {q}: bytes written {set(hits[key][block])} times"
                assert (dst[key][block] == want[key][block]).all(), f"{key} page {q}: wrong bytes"
            else:
                assert (hits[key][block] == 0).all(), f"{key} page {q} written but not requested"
    counted = {r: 0 for r in range(dst_tp)}
    for w in groups:
        counted[w.dst_rank] += w.writes
    assert counted == plan.expected(len(src_pages))


def _relabel(g: KVGeometry, kind: Kind, heads: range, pages: int, src_to_dst: dict[int, int]) -> np.ndarray:
    """A source buffer whose page p carries the codes of destination page src_to_dst[p]."""
    base = _rank_buffer(g, kind, heads, pages)
    page_bytes = len(base) // pages
    out = base.copy()
    for p, q in src_to_dst.items():
        out[p * page_bytes:(p + 1) * page_bytes] = base[q * page_bytes:(q + 1) * page_bytes]
    return out


@pytest.mark.parametrize("src_tp, dst_tp", TP_PAIRS)
def test_hnd_moves_each_page_shard_in_one_write(src_tp, dst_tp):
    g = _geometry(_kv_heads_for(src_tp, dst_tp), Layout.HND, page_size=16)
    plan = ShardPlan.build(g, src_tp, dst_tp)
    n_pages = 5
    # pages x layers x (K, V) x pieces landing on that rank
    for d in range(dst_tp):
        pieces = sum(1 for p in plan.pieces if p.dst_rank == d)
        assert plan.expected(n_pages)[d] == n_pages * g.num_layers * 2 * pieces
    if src_tp == dst_tp:
        assert all(p.src_rank == p.dst_rank for p in plan.pieces), "equal sharding pairs ranks one to one"


def test_nhd_costs_one_write_per_slot_when_shards_differ():
    hnd = ShardPlan.build(_geometry(4, Layout.HND, page_size=16), 1, 2)
    nhd = ShardPlan.build(_geometry(4, Layout.NHD, page_size=16), 1, 2)
    assert nhd.total_writes(10) == 16 * hnd.total_writes(10)
    # Equal sharding: NHD pages line up and move whole.
    assert ShardPlan.build(_geometry(4, Layout.NHD, page_size=16), 2, 2).total_writes(10) == \
        ShardPlan.build(_geometry(4, Layout.HND, page_size=16), 2, 2).total_writes(10)


def test_mla_sources_are_drawn_at_random_and_alike_on_every_prefill_rank():
    plan = ShardPlan.build(_mla(), 8, 2)
    sources = {p.src_rank for seed in range(50) for p in plan.for_request(seed).pieces}
    assert sources == set(range(8))  # the load spreads over every replica
    assert plan.for_request(11).pieces == plan.for_request(11).pieces  # same seed, same draw
    assert {plan.for_request(s).expected(5)[d] for s in range(20) for d in range(2)} == {5 * 2}  # K only
    assert plan.for_request(3).groups([1], [2], src_rank=99) == []


def test_replicated_heads_spread_sources_over_replicas():
    # 2 KV heads, prefill TP 8: each head lives on 4 ranks; decode TP 2 takes one replica each.
    pieces = shard_pieces(2, 8, 2)
    assert [(p.src_rank, p.dst_rank, p.first_head) for p in pieces] == [(0, 0, 0), (5, 1, 1)]
    # decode TP 8 from prefill TP 8: rank to rank
    assert all(p.src_rank == p.dst_rank for p in shard_pieces(2, 8, 8))


def test_rank_heads_rule_and_errors():
    assert [rank_heads(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(ValueError, match="cannot be split"):
        rank_heads(6, 4, 0)
    with pytest.raises(ValueError, match="outside"):
        rank_heads(4, 2, 2)
    with pytest.raises(ValueError, match="num_layers"):
        KVGeometry(0, 2, 8, 8, 16, 4)


def test_groups_for_a_subset_of_layers_and_pages():
    plan = ShardPlan.build(_geometry(2, Layout.HND), 2, 1)
    groups = plan.groups([1, 2], [3, 4], layers=[1])
    assert {g.layer for g in groups} == {1}
    assert sum(g.writes for g in groups) == 2 * 2 * 2  # 2 pages x K/V x 2 source ranks
    assert plan.groups([], []) == []
    with pytest.raises(ValueError, match="destination pages"):
        plan.groups([1], [])
    assert pages_for(33, 16) == 3 and pages_for(32, 16) == 2 and pages_for(0, 16) == 0


@pytest.mark.parametrize("groups,group", [(2, 0), (2, 1), (4, 3)])
def test_a_dp_decoder_groups_tags_still_draw_every_source_evenly(groups, group):
    """A DP decoder's group g takes the tags equal to g modulo the groups (decode.py): the draw
    seeded by the tag must stay even over the prefill's replicas for such a residue class."""
    from collections import Counter

    plan = ShardPlan.build(_mla(), 4, 1)
    tags = [k * groups + group for k in range(1, 2001)]
    drawn = Counter(p.src_rank for t in tags for p in plan.for_request(t).pieces)
    assert set(drawn) == {0, 1, 2, 3}
    assert all(400 <= n <= 600 for n in drawn.values()), drawn  # 500 each expected; 4.5 sigma either side
