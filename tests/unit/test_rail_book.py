"""The libfabric backend's rail bookkeeping (backends/libfabric/railwatch.RailBook), pure: which
rail a batch takes, when a (rail, peer) counts as stalled (and when a whole peer's stall is left
to the heartbeat and the transfer deadline), and that a rail down for a peer carries nothing to
it until it is up again. The lost rail end to end: tests/hosts/test_rails_e2e.py."""

from __future__ import annotations

import socket
import struct

import pytest

from sglang_disagg.backends import TransferError
from sglang_disagg.backends.libfabric.rails import RailRoute, sockaddr
from sglang_disagg.backends.libfabric.railwatch import RailBook, RailState

ROUTES = (RailRoute(0, 10, 0), RailRoute(1, 11, 1))
P, Q = "peer-p", "peer-q"


def test_batches_go_to_the_rail_that_carried_least():
    book = RailBook(2)
    picked = [book.pick(P, ROUTES, 1, size).local for size in (100, 100, 50, 200, 10)]
    assert picked == [0, 1, 0, 1, 0]  # 0:100, 1:100 -> 0 (tie: first) -> 1 (150 vs 100) -> 0 (150 vs 300)
    assert (book.bytes, book.writes) == ([160, 300], [3, 2])


def test_a_rail_stalls_when_it_makes_no_progress_while_another_rail_to_the_peer_does():
    book = RailBook(2)
    assert book.stalled(100.0, 1.0) == []  # nothing in flight: an idle rail is not stalled
    book.posted(1, 0, P, 10.0)
    book.posted(2, 1, P, 10.0)
    book.posted(3, 1, P, 10.1)
    assert book.stalled(10.9, 1.0) == []
    book.finished(1, 10.95)  # rail 0 progressed after rail 1's last progress (its oldest post, 10.0)
    assert book.stalled(11.5, 1.0) == [(1, P, [2, 3])]
    book.forget(2)
    book.forget(3)  # failed here: no longer judged
    assert book.stalled(11.5, 1.0) == []


def test_a_whole_peer_that_stalls_is_not_a_lost_rail():
    book = RailBook(2)
    book.finished(7, 9.0)  # unknown batch: nothing
    book.posted(1, 0, P, 10.0)
    book.posted(2, 1, P, 10.0)
    assert book.stalled(20.0, 1.0) == []  # both rails silent: the heartbeat and the deadline judge the peer
    book.posted(3, 0, Q, 10.0)
    book.finished(3, 10.5)  # another peer's progress says nothing of P's rails
    assert book.stalled(20.0, 1.0) == []


def test_a_rail_down_for_a_peer_carries_nothing_to_it_until_it_is_up_again():
    book = RailBook(2)
    book.posted(1, 1, P, 0.0)
    book.mark(1, P, RailState.DOWN)
    assert book.lost == 1 and book.down() == [(1, P)]
    assert {book.pick(P, ROUTES, 1, 10).local for _ in range(5)} == {0}
    assert book.pick(Q, ROUTES, 1, 10).local == 1  # down for P only
    with pytest.raises(TransferError, match="every rail to this peer is down"):
        book.pick(P, ROUTES[1:], 1, 10)
    assert book.stats()["rail1_up"] == 0
    book.mark(1, P, RailState.UP)
    assert {book.pick(P, ROUTES, 1, 10).local for _ in range(2)} == {0, 1}  # back in use, starting even
    s = book.stats()
    assert (s["rail0_up"], s["rail1_up"], s["rails_lost"]) == (1, 1, 1)


def test_only_a_tcp_address_can_be_probed():
    raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", 4242) + socket.inet_aton("10.77.1.2") + bytes(8)
    assert sockaddr(raw) == ("10.77.1.2", 4242)
    assert sockaddr(b"\x0a\x00" + bytes(26)) is None  # AF_INET6 (or any other provider's format)
    assert sockaddr(b"") is None


def test_a_rail_that_comes_back_starts_even_instead_of_taking_every_batch():
    book = RailBook(2)
    book.mark(1, P, RailState.DOWN)
    for _ in range(10):
        book.pick(P, ROUTES, 1, 100)  # all on rail 0 meanwhile
    book.mark(1, P, RailState.UP)
    assert [book.pick(P, ROUTES, 1, 100).local for _ in range(4)] == [0, 1, 0, 1]
    assert book.bytes == [1200, 200]  # the lifetime counts (metrics) are kept


def test_a_batch_takes_only_routes_between_rails_that_registered_its_regions():
    """Each rail registers only the regions it carries (registration.py): a route from a rail
    without the source, or to a peer rail without the destination, is never taken; with none
    left the batch is refused with both sides' carriers, not posted with a key that is not there."""
    routes = (RailRoute(0, 10, 0), RailRoute(0, 12, 1), RailRoute(1, 11, 1), RailRoute(1, 13, 0))
    book = RailBook(2)
    assert {(r.local, r.remote) for r in (book.pick(P, routes, 1, 10, frozenset({1})) for _ in range(4))} == {(1, 1)}
    # their region only on their rail 0: our rail 1 writes to it through route (1, 0), its second
    assert book.pick(P, routes, 1, 10, frozenset({1}), frozenset({0})) == routes[3]
    with pytest.raises(TransferError, match=r"ours: \[1\]\) to a rail holding the destination \(theirs: \[2\]\)"):
        book.pick(P, routes, 1, 10, frozenset({1}), frozenset({2}))
    book.mark(1, P, RailState.DOWN)
    with pytest.raises(TransferError, match="every rail to this peer is down"):
        book.pick(P, routes, 1, 10, frozenset({1}))
    assert book.pick(P, routes, 1, 10).local == 0  # a region every rail carries still goes
