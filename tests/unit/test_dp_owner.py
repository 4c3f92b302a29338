"""A DP group's messenger reaches the server's one transfer backend through the owner
(dp.owner.Owner, in group 0's leader) over its Unix socket (dp.proxy.ProxyBackend).

Real backends on both ends (shmem and libfabric tcp): a "decoder" whose group 1 registers
its shared-memory pool through the owner, connects to a "prefill" backend, exchanges control
messages both ways, and counts the prefill's real writes into its pages by tag; a peer's loss
reaches the group within the links' deadline; the owner gone fails what the group waits on
at once. The prefill-side dispatch (Hello to every group, an order to the least loaded, a
cancel after its order) is checked on the dispatch logic with recording groups.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time

import pytest
import torch

from sglang_disagg.ipc import shm
from sglang_disagg.backends import BackendConfig, PeerLostError, PeerState, TransferError, create_backend
from sglang_disagg.ipc import fdpass
from sglang_disagg.messenger import wire
from sglang_disagg.messenger.config import MessengerRole
from sglang_disagg.messenger.dp import wire as gw
from sglang_disagg.messenger.dp.owner import Owner
from sglang_disagg.messenger.dp.proxy import ProxyBackend

SECRET = secrets.token_bytes(32)
BACKENDS = [("shmem", None), ("libfabric", "tcp")]


def _backend(name, provider):
    return create_backend(name, BackendConfig(provider=provider, host="127.0.0.1", port=0, secret=SECRET))


def _name() -> str:
    return gw.socket_name(f"test-{os.getpid()}-{secrets.token_hex(4)}")


def _recv(backend, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return backend.recv(0.2)
        except TransferError:
            if time.monotonic() > deadline:
                raise


@pytest.mark.parametrize("name,provider", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_a_group_moves_kv_and_messages_through_the_owner(name, provider):
    owner_backend, prefill = _backend(name, provider), _backend(name, provider)
    path = _name()
    got = []
    owner = Owner(owner_backend, path, MessengerRole.DECODE, groups=2, local=lambda p, m: got.append(m))
    group = ProxyBackend(path, 1, deadline_s=5.0)
    try:
        assert (group.name, group.address, group.instance) == (owner_backend.name, owner_backend.address,
                                                               owner_backend.instance)
        pool = shm.shared_zeros((8, 64), torch.float32)  # the group's KV: 8 pages of 256 bytes
        region, desc = group.register(pool.data_ptr(), pool.numel() * 4)
        peer = group.connect(prefill.address, 5.0)
        assert peer.id == prefill.instance
        hello = wire.Hello(decoder="d", backend=name, provider=prefill.provider or "", ranks=(), group=1,
                           kv=wire.KVSpec(model="m", fingerprint="f", num_layers=1, kv_heads=1, head_dim=64,
                                          v_head_dim=64, page_size=1, dtype="torch.float32", layout="hnd", tp=1))
        peer.send(wire.encode(hello))
        from_decoder, raw = _recv(prefill)
        assert wire.decode(raw) == hello
        # The prefill's answer reaches the owner's control thread, which gives it to the group
        # whose connection it came on (here by dispatch, as Node's reader does).
        from_decoder.send(wire.encode(wire.Released(rid="r", tag=5, posted=7)))
        p, raw = _recv(owner_backend)
        owner.dispatch(p, raw, wire.decode(raw))
        back_peer, back = group.recv(5.0)
        assert back_peer is peer and wire.decode(back) == wire.Released(rid="r", tag=5, posted=7) and not got
        # The prefill's real writes land in the group's pages and are counted by tag.
        src = shm.shared_zeros((8, 64), torch.float32)  # the prefill's pool (shmem moves shared memory only)
        src.copy_(torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64))
        src_region, _ = prefill.register(src.data_ptr(), src.numel() * 4)
        remote = from_decoder.add_remote_region(desc)
        expected = group.expect(7, 2, 5.0, {prefill.instance})
        prefill.write_pages(from_decoder, src_region, [1, 3], 256, remote, [0, 5], 256, 256, 7).wait(5.0)
        expected.wait(5.0)
        assert torch.equal(pool[0], src[1]) and torch.equal(pool[5], src[3])
        # The group's own write (the prefill direction) from its registered region.
        back_region, _ = prefill.register(src.data_ptr(), src.numel() * 4)
        dst = peer.add_remote_region(prefill.descriptor(back_region))
        pool[2].fill_(3.0)
        mine = prefill.expect(9, 1, 5.0)
        group.write_pages(peer, region, [2], 256, dst, [6], 256, 256, 9).wait(5.0)
        mine.wait(5.0)
        assert torch.equal(src[6], pool[2])
        assert group.is_retired(11) is False
        group.retire(11, "test")
        assert group.is_retired(11) is True
        # The prefill going away: the group's peer is LOST well within 2 s, its expectation fails.
        waiting = group.expect(13, 1, 30.0, {prefill.instance})
        group.is_retired(13)  # calls are served in order: the expectation is set at the owner now
        t0 = time.monotonic()
        prefill.close()
        with pytest.raises(PeerLostError):
            waiting.wait(5.0)
        while peer.state is PeerState.CONNECTED and time.monotonic() - t0 < 2.0:
            time.sleep(0.01)
        assert peer.state is PeerState.LOST, f"still {peer.state} after {time.monotonic() - t0:.2f} s"
    finally:
        group.close()
        owner.close()
        owner_backend.close()
        prefill.close()


def test_the_owner_gone_fails_the_group_at_once():
    owner_backend, prefill = _backend("shmem", None), _backend("shmem", None)
    path = _name()
    owner = Owner(owner_backend, path, MessengerRole.DECODE, groups=2)
    group = ProxyBackend(path, 1, deadline_s=5.0)
    try:
        peer = group.connect(prefill.address, 5.0)
        waiting = group.expect(3, 1, 60.0)
        t0 = time.monotonic()
        owner.close()
        with pytest.raises(PeerLostError, match="owner"):
            waiting.wait(2.0)
        assert time.monotonic() - t0 < 1.0
        assert peer.state is PeerState.LOST
        assert "owner" in group.gone
        with pytest.raises(TransferError):
            group.recv(0.1)
        with pytest.raises(PeerLostError):
            group.expect(4, 1, 1.0).wait(1.0)
    finally:
        group.close()
        owner_backend.close()
        prefill.close()


def test_an_owner_gone_mid_step_fails_the_group_instead_of_killing_its_scheduler():
    """The owner dies after a step's check and before a call to it (seen in CI: a request
    being routed asked it whether a tag was retired): Node.owner_may_go ends the step and the
    group fails what it holds with the reason; a PeerLostError that is not the owner's still
    propagates. The real owner and proxy; the node is the two methods the guard calls."""
    import threading
    import types

    from sglang_disagg.messenger.dp.groups import Groups, MemberGroup
    from sglang_disagg.messenger.node import Node

    def node_of(dp) -> types.SimpleNamespace:
        node = types.SimpleNamespace(dp=dp, _owner_lost_at=0.0, group=1, wakeup=threading.Event())
        node.owner_gone = types.MethodType(Node.owner_gone, node)
        node.stop_if_owner_gone = types.MethodType(Node.stop_if_owner_gone, node)
        return node

    owner_backend = _backend("shmem", None)
    path = _name()
    owner = Owner(owner_backend, path, MessengerRole.DECODE, groups=2)
    group = ProxyBackend(path, 1, deadline_s=5.0)
    try:
        node, failed = node_of(MemberGroup(group)), []
        assert group.is_retired(5) is False
        owner.close()
        t0 = time.monotonic()
        with Node.owner_may_go(node, failed.append):
            group.is_retired(7)
            pytest.fail("a call to an owner that is gone returned")
        assert time.monotonic() - t0 < 2.0
        assert len(failed) == 1 and failed[0].startswith("this server's messenger is gone (") and "owner" in failed[0]
        alive = node_of(Groups(None))  # no proxy: the error is some peer's, not the owner's
        with pytest.raises(PeerLostError, match="a prefill server"):
            with Node.owner_may_go(alive, failed.append):
                raise PeerLostError("a prefill server was lost")
        assert len(failed) == 1
    finally:
        group.close()
        owner_backend.close()


def test_a_group_with_no_owner_says_so():
    with pytest.raises(TransferError, match="no messenger owner"):
        ProxyBackend(_name(), 1, deadline_s=0.2)


class _Peer:
    def __init__(self, instance):
        self.id, self.address, self.state = instance, f"{instance}:1", PeerState.CONNECTED


class _Recording:
    """A group's end of the socket that records what the owner delivers."""

    def __init__(self):
        self.got = []

    def send(self, msg):
        self.got.append(wire.decode(msg.data))


_KV = wire.KVSpec(model="m", fingerprint="f", num_layers=1, kv_heads=1, head_dim=64, v_head_dim=64,
                  page_size=1, dtype="f", layout="hnd", tp=1)


@contextlib.contextmanager
def _recording_owner(role: MessengerRole):
    """An owner of 3 groups: group 0's messages in `local`, groups 1 and 2 recording theirs."""
    backend = _backend("shmem", None)
    local = []
    owner = Owner(backend, _name(), role, groups=3, local=lambda p, m: local.append(m))
    groups = {1: _Recording(), 2: _Recording()}
    owner._conns.update(groups)
    try:
        yield owner, local, groups
    finally:
        owner._conns.clear()
        owner.close()
        backend.close()


def test_prefill_dispatch_spreads_orders_and_follows_cancels():
    with _recording_owner(MessengerRole.PREFILL) as (owner, local, groups):
        decoder = _Peer("dec")

        def give(msg):
            owner.dispatch(decoder, wire.encode(msg), msg)

        give(wire.Hello(decoder="d", backend="shmem", provider="", kv=_KV, ranks=()))
        assert len(local) == 1 and all(len(g.got) == 1 for g in groups.values())  # every group hears it
        orders = [wire.PrefillOrder(rid=f"r{t}", tag=t, token_ids=(1,), dst_pages=(0,), start_page=0)
                  for t in range(1, 7)]
        for o in orders:
            give(o)
        where = {o.tag: 0 for o in local[1:]} | {o.tag: g for g, r in groups.items() for o in r.got[1:]}
        assert sorted(where) == [1, 2, 3, 4, 5, 6]
        assert owner.outstanding == [2, 2, 2]  # least outstanding first: evenly spread
        assert where[1] == where[4]  # the same group took the 1st and 4th
        owner.order_done("dec", 1)
        owner.order_done("dec", 4)  # ... and finished both: the next order is its
        give(wire.PrefillOrder(rid="r7", tag=7, token_ids=(1,), dst_pages=(0,), start_page=0))
        assert owner.outstanding[where[1]] == 1 and owner._orders[("dec", 7)] == where[1]
        give(wire.Cancel(rid="r5", tag=5))  # to the group that took order 5
        holder = groups[where[5]].got if where[5] else local
        assert holder[-1] == wire.Cancel(rid="r5", tag=5)
        give(wire.Cancel(rid="r1", tag=1))  # a finished order: group 0 answers "released"
        assert local[-1] == wire.Cancel(rid="r1", tag=1)


def test_decode_dispatch_sends_a_migration_targets_order_to_the_group_holding_its_request():
    """A data-parallel decoder migrating requests out: the other decoder's Hello reaches every
    group (any may hold a request for it), its MigrationOrder and Cancel the group whose
    handle they name (Source.new draws group g's handles from g modulo the groups), and a
    prefill server's answer still goes to the group that opened that connection."""
    from sglang_disagg.messenger.migration.room import Source

    with _recording_owner(MessengerRole.DECODE) as (owner, local, groups):
        target, prefill = _Peer("decoder-b"), _Peer("prefill")
        owner._opened_by[id(prefill)] = 2

        def give(peer, msg):
            owner.dispatch(peer, wire.encode(msg), msg)

        give(target, wire.Hello(decoder="b", backend="shmem", provider="", kv=_KV, ranks=()))
        assert len(local) == 1 and all(len(g.got) == 1 for g in groups.values())  # every group hears it
        for g in (0, 1, 2):
            handles = {Source.new("10.0.0.1:5000", group=g, groups=3).handle for _ in range(50)}
            assert {h % 3 for h in handles} == {g} and all(0 <= h < 1 << 31 for h in handles)
            h = handles.pop()
            order = wire.MigrationOrder(rid=str(h), tag=7 + g, num_tokens=3, dst_pages=(0,))
            cancel = wire.Cancel(rid=f"req-{g}.m{h}g2", tag=7 + g)  # B's rid: A's, the handle, the replay
            give(target, order)
            give(target, cancel)
            got = local if g == 0 else groups[g].got
            assert got[-2:] == [order, cancel], f"group {g}"
        give(prefill, wire.OrderFailed(rid="r.m4", tag=1, reason="x", blame=wire.Blame.ORDER, posted=0))
        assert isinstance(groups[2].got[-1], wire.OrderFailed)  # its opener's, whatever the rid says
        give(target, wire.MigrationOrder(rid="not-a-handle", tag=9, num_tokens=1, dst_pages=(0,)))
        assert local[-1].rid == "not-a-handle"  # group 0 refuses it with the reason


def test_group_wire_checks_version_and_fields():
    raw = gw.encode(gw.Stats(3))
    assert gw.decode(raw) == gw.Stats(3)
    with pytest.raises(gw.GroupWireError, match="version"):
        gw.decode(raw.replace(b'"v":3', b'"v":9'))
    with pytest.raises(gw.GroupWireError, match="fields"):
        gw.decode(raw.replace(b'"id"', b'"ix"'))


def test_a_group_joining_late_hears_the_hellos_before_any_order():
    """A prefill server's group 1 still loading when a decoder said Hello: it hears that
    Hello when it joins, before the owner gives it an order (orders go to joined groups)."""
    backend = _backend("shmem", None)
    path = _name()
    local = []
    owner = Owner(backend, path, MessengerRole.PREFILL, groups=2, local=lambda p, m: local.append(m))
    decoder = _Peer("dec")
    hello = wire.Hello(decoder="d", backend="shmem", provider="", kv=_KV, ranks=())
    owner.dispatch(decoder, wire.encode(hello), hello)
    order = wire.PrefillOrder(rid="r", tag=1, token_ids=(1,), dst_pages=(0,), start_page=0)
    owner.dispatch(decoder, wire.encode(order), order)
    assert local == [hello, order]  # group 1 not joined yet: everything to group 0
    group = ProxyBackend(path, 1, deadline_s=5.0)
    try:
        peer, raw = group.recv(5.0)
        assert wire.decode(raw) == hello and peer.id == "dec"
        second = wire.PrefillOrder(rid="r2", tag=2, token_ids=(1,), dst_pages=(0,), start_page=0)
        owner.dispatch(decoder, wire.encode(second), second)  # group 1 has fewer outstanding now
        assert wire.decode(group.recv(5.0)[1]) == second
    finally:
        group.close()
        owner.close()
        backend.close()


def test_only_the_servers_own_user_may_join(monkeypatch):
    """The owner's abstract socket has no file permissions: a process of another user is
    refused on its credentials (SO_PEERCRED; the other user is simulated by this process's
    uid as the owner sees it, the check being one comparison)."""
    import socket

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn = fdpass.Conn(a)
        assert conn.other_user() == ""
        monkeypatch.setattr(fdpass.os, "getuid", lambda: os.geteuid() + 1)
        assert f"runs as uid {os.geteuid()}" in conn.other_user()
    finally:
        a.close()
        b.close()
