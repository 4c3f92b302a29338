"""Decoder A's side of a live migration over real backends: the KV of a held request moves
into decoder B's pages with the prefill-to-decode planner, every layer, any TP pair, and B's
count by immediate completes exactly; what B claims is checked against what A holds before
anything is posted; a held request no order came for is given back; the table is bounded.

Both decoders are backends in this process with their KV pools in shared memory (as the
messenger allocates them); the leader of each holds every rank's regions, as Node does."""

from __future__ import annotations

import secrets

import pytest
import torch

from sglang_disagg.backends import BackendConfig, available, create_backend
from sglang_disagg.ipc.shm import shared_zeros
from sglang_disagg.messenger import wire
from sglang_disagg.messenger.planner import KVGeometry, Kind, rank_heads
from sglang_disagg.messenger.migration.pacer import BURST_S, Pacer
from sglang_disagg.messenger.migration.source import HeldState, MigrationRefused, MigrationSource

SECRET = secrets.token_bytes(32)
BACKENDS = [("shmem", None), ("libfabric", "tcp"), ("nixl", None), ("mooncake", None)]
PAGES, PS, DIM = 12, 4, 8


def _geometry(kv_heads: int, replicated: bool = False) -> KVGeometry:
    return KVGeometry(num_layers=3, kv_heads=kv_heads, head_dim=DIM, v_head_dim=0 if replicated else DIM,
                      page_size=PS, dtype_bytes=4, replicated=replicated)


class Pool:
    """One decoder's KV: per TP rank, per layer and kind, an HND buffer [page, head, slot, dim]
    of float32 in shared memory; A's hold a code of (layer, kind, page, global head, slot, dim)."""

    def __init__(self, g: KVGeometry, tp: int, fill: bool) -> None:
        self.g, self.tp = g, tp
        self.heads = [range(0, 1) if g.replicated else rank_heads(g.kv_heads, tp, r) for r in range(tp)]
        self.t = []
        for r in range(tp):
            bufs = []
            for layer in range(g.num_layers):
                for kind in g.kinds:
                    t = shared_zeros((PAGES, len(self.heads[r]), PS, g.dim(kind)), torch.float32, "test-migration")
                    if fill:
                        p, h, s, d = torch.meshgrid(torch.arange(PAGES), torch.tensor(list(self.heads[r])),
                                                    torch.arange(PS), torch.arange(g.dim(kind)), indexing="ij")
                        t.copy_(((((layer * 2 + int(kind)) * 64 + p) * 16 + h) * 8 + s) * 16 + d + 1.0)
                    bufs.append(t)
            self.t.append(bufs)

    def register(self, be) -> tuple[list[list], list[list[str]]]:
        regions, descs = [], []
        for bufs in self.t:
            rr, dd = [], []
            for t in bufs:
                region, desc = be.register(t.data_ptr(), t.numel() * t.element_size())
                rr.append(region)
                dd.append(desc.decode())
            regions.append(rr)
            descs.append(dd)
        return regions, descs

    def page(self, layer: int, kind: Kind, page: int, head: int) -> torch.Tensor:
        """Global head `head` of page `page` as the first rank holding it has it."""
        i = layer * len(self.g.kinds) + int(kind)
        r = next(r for r in range(self.tp) if head in self.heads[r])
        return self.t[r][i][page, list(self.heads[r]).index(head)]


# The dialer's handshake deadline is its connect timeout, not the config's slack below: a
# libfabric pair's handshake once missed 5 s here in a full CI run (CI of 638d471; 116 of 116 passed alone right after)
CONNECT_S = 15.0


@pytest.fixture(params=BACKENDS, ids=[b if p is None else f"{b}-{p}" for b, p in BACKENDS])
def pair(request):
    name, provider = request.param
    ok, why = available(name)
    if not ok:
        pytest.skip(f"{name}: {why}")  # fails under CI=true (tests/conftest.py): every backend is installed there
    # What these tests check is where the bytes land, not how fast a peer answers: the liveness and
    # handshake deadlines get room a loaded 2-core machine needs (CI once saw a Mooncake pair's
    # handshake miss 2 s and a peer "silent for 4.37 s" while the backends were being created)
    slack = dict(handshake_timeout_s=10.0, peer_timeout_s=10.0)
    cfg = BackendConfig(host="127.0.0.1", port=0, secret=SECRET, provider=provider, **slack) if provider else \
        BackendConfig(host="127.0.0.1", port=0, secret=SECRET, **slack)
    a, b = create_backend(name, cfg), create_backend(name, cfg)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _migrate(a, b, g: KVGeometry, src_tp: int, dst_tp: int, src_pages, dst_pages, num_tokens: int, tag: int = 77):
    pa, pb = Pool(g, src_tp, fill=True), Pool(g, dst_tp, fill=False)
    a_regions, _ = pa.register(a)
    _, b_descs = pb.register(b)
    peer = a.connect(b.address, CONNECT_S)
    remote = {d: [peer.add_remote_region(x) for x in b_descs[d]] for d in range(dst_tp)}
    src = MigrationSource(g, src_tp)
    held = src.hold("req-1", src_pages, num_tokens)
    order = wire.decode(wire.encode(wire.MigrationOrder(rid="req-1", tag=tag, num_tokens=num_tokens,
                                                        dst_pages=tuple(dst_pages))))
    h, groups, count = src.plan(order, dst_tp)
    landed = b.expect(tag, count, 20.0)
    src.post(h, tag, groups, a, {d: peer for d in range(dst_tp)}, a_regions, remote)
    landed.wait(20.0)
    return pa, pb, src, held, count


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_a_held_request_moves_every_layer_into_the_new_decoders_pages(pair, src_tp, dst_tp):
    a, b = pair
    g = _geometry(kv_heads=2)
    num_tokens = 4 * PS - 1  # the last page is partly filled: it moves whole
    src_pages, dst_pages = [7, 2, 9, 4, 11], [3, 10, 0, 6]
    pa, pb, src, held, count = _migrate(a, b, g, src_tp, dst_tp, src_pages, dst_pages, num_tokens)
    assert held.pages == tuple(src_pages[:4]), "a held request keeps only the pages its tokens fill"
    for layer in range(g.num_layers):
        for kind in g.kinds:
            for sp, dp in zip(held.pages, dst_pages):
                for head in range(g.kv_heads):
                    assert torch.equal(pb.page(layer, kind, dp, head), pa.page(layer, kind, sp, head)), \
                        (layer, kind, sp, dp, head)
    # Nothing else of B's pool was touched.
    untouched = [p for p in range(PAGES) if p not in dst_pages]
    assert all(float(t[untouched].abs().sum()) == 0.0 for bufs in pb.t for t in bufs)
    import time
    deadline = time.monotonic() + 10
    while held.state is HeldState.WRITING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.state is HeldState.WRITTEN and held.writes == count and not held.error
    per_page = g.num_layers * sum(g.page_bytes(k, g.kv_heads) for k in g.kinds)
    assert held.nbytes == len(dst_pages) * per_page, "A wrote exactly the request's KV (the floor), once"
    assert [h.rid for h in src.settled()] == ["req-1"] and not src.held


def test_mla_latent_moves_from_one_source_replica(pair):
    a, b = pair
    g = _geometry(kv_heads=1, replicated=True)
    pa, pb, src, held, count = _migrate(a, b, g, 2, 1, [5, 6, 1], [0, 1, 2], 3 * PS)
    for layer in range(g.num_layers):
        for sp, dp in zip(held.pages, [0, 1, 2]):
            assert torch.equal(pb.page(layer, Kind.K, dp, 0), pa.page(layer, Kind.K, sp, 0))
    assert count == 3 * g.num_layers, "one write per page and layer into the single decode rank"


def test_a_paced_migration_goes_out_as_credit_comes_and_lands_whole(pair):
    """--migration-rate (pacer.py): the groups past the bucket wait as the held request's
    `later` and go out as credit comes (a fake clock); the request is written only once the
    last went out and landed, every byte where it belongs."""
    a, b = pair
    g = _geometry(kv_heads=2)
    pa, pb = Pool(g, 1, fill=True), Pool(g, 1, fill=False)
    a_regions, _ = pa.register(a)
    _, b_descs = pb.register(b)
    peer = a.connect(b.address, CONNECT_S)
    remote = {0: [peer.add_remote_region(x) for x in b_descs[0]]}
    src, src_pages, dst_pages = MigrationSource(g, 1), [7, 2, 9], [3, 10, 0]
    held = src.hold("req-p", src_pages, 3 * PS)
    h, groups, count = src.plan(wire.MigrationOrder(rid="req-p", tag=88, num_tokens=3 * PS,
                                                    dst_pages=tuple(dst_pages)), 1)
    sizes = [gr.nbytes for gr in groups]
    clock = [0.0]
    pacer = Pacer(1.5 * sizes[0] / BURST_S, now=lambda: clock[0])  # a bucket of 1.5 groups
    landed = b.expect(88, count, 20.0)
    now = pacer.take(sizes)
    assert now == 2 < len(groups)
    src.post(h, 88, groups, a, {0: peer}, a_regions, remote, hold_back=len(groups) - now)
    rounds = 0
    while held.later:
        assert held.state is HeldState.WRITING, "not written while groups still wait for credit"
        clock[0] += BURST_S
        src.post_later(held, pacer.take(src.later_sizes(held)))
        rounds += 1
    assert rounds >= len(groups) // 2, f"{len(groups)} groups went out in {rounds} rounds of credit"
    landed.wait(20.0)
    import time
    deadline = time.monotonic() + 10
    while held.state is HeldState.WRITING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.state is HeldState.WRITTEN and held.writes == count and held.nbytes == sum(sizes)
    for layer in range(g.num_layers):
        for kind in g.kinds:
            for sp, dp in zip(held.pages, dst_pages):
                for head in range(g.kv_heads):
                    assert torch.equal(pb.page(layer, kind, dp, head), pa.page(layer, kind, sp, head))


def _held(num_tokens: int = 2 * PS) -> MigrationSource:
    src = MigrationSource(_geometry(kv_heads=2), 1, max_held=2)
    src.hold("r", [1, 2, 3], num_tokens)
    return src


@pytest.mark.parametrize("order,why", [
    (wire.MigrationOrder(rid="other", tag=1, num_tokens=2 * PS, dst_pages=(0, 1)), "no request 'other' is held"),
    (wire.MigrationOrder(rid="r", tag=1, num_tokens=3 * PS, dst_pages=(0, 1, 2)), "holds KV of 8 tokens"),
    (wire.MigrationOrder(rid="r", tag=1, num_tokens=2 * PS, dst_pages=(0,)), "needs 2 pages, the order gives 1"),
])
def test_an_order_that_does_not_match_what_is_held_is_refused(order, why):
    with pytest.raises(MigrationRefused, match=why):
        _held().plan(order, 1)


def test_a_second_order_for_the_same_request_is_refused_and_the_table_is_bounded():
    src = _held()
    h, _, _ = src.plan(wire.MigrationOrder(rid="r", tag=1, num_tokens=2 * PS, dst_pages=(0, 1)), 1)
    h.state = HeldState.WRITING
    with pytest.raises(MigrationRefused, match="is writing, not waiting"):
        src.plan(wire.MigrationOrder(rid="r", tag=2, num_tokens=2 * PS, dst_pages=(4, 5)), 1)
    with pytest.raises(MigrationRefused, match="already being migrated"):
        src.hold("r", [1, 2], 2 * PS)
    src.hold("s", [1], 1)
    with pytest.raises(MigrationRefused, match="at most 2"):
        src.hold("t", [1], 1)
    with pytest.raises(MigrationRefused, match="cannot hold"):
        MigrationSource(_geometry(kv_heads=2), 1).hold("u", [1], PS + 1)


def test_a_held_request_no_order_came_for_goes_back():
    src = _held()
    assert src.expired(now=src.held["r"].since + src.hold_s - 0.1) == []
    gone = src.expired(now=src.held["r"].since + src.hold_s + 0.1)
    assert [h.rid for h in gone] == ["r"] and not src.held
