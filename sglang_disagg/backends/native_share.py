"""Which control connections share a peer instance's native state, and when a lost one ends it.

A backend keeps one native connection per peer instance (an address-vector entry, a NIXL remote
agent, a Mooncake session), made by whichever control connection reached it first; each side dials
the other, control one way and data the other, so two connections usually share it. When one of
them is lost, the state goes with it unless another connection to the same instance proves the
path alive: it heard from the peer within `FRESH_BEATS` heartbeats. Tearing it down under a
healthy connection strands that connection's writes (seen: a decoder's control connection reset
by `ss -K` left the prefill's writes on its data connection uncompleted until their deadline, and
the decoder quarantined the pages). Keeping it when the other connection is merely not yet found
silent keeps a provider connection that a partition left stale (seen: after a cable cut, a
re-linked prefill's writes went into it and never arrived), so a connection that is quiet too
shares the loss: the state is torn down and the other connections lose their claim on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .regions import PeerState

if TYPE_CHECKING:
    from .config import BackendConfig
    from .peers import Peer

# How recently (in heartbeats: peer_timeout_s / 9 each) another connection to an instance must
# have heard from it for a lost connection to leave the instance's native state in place.
FRESH_BEATS = 3


class NativeShares:
    """The connections using each peer instance's native state, by instance id. `connect` and
    `disconnect` make and end that state, `expire` forgets one batch's native side; all three run
    under this table's lock, so a connection's attach and another's loss never interleave."""

    def __init__(self, config: BackendConfig, connect: Callable[[Peer], None],
                 disconnect: Callable[[Peer], None], expire: Callable[[int], None]) -> None:
        self._config = config
        self._connect, self._disconnect, self._expire = connect, disconnect, expire
        self._lock = threading.Lock()
        self._users: dict[str, set[Peer]] = {}

    def attach(self, peer: Peer) -> None:
        """`peer`, a connection just admitted, uses (or makes) its instance's native state."""
        with self._lock:
            self._connect(peer)
            self._users.setdefault(peer.id, set()).add(peer)

    def detach(self, peer: Peer, batch_ids: Iterable[int]) -> None:
        """`peer` is lost (its state already says so) and `batch_ids` were its batches: its
        instance's native state ends unless a fresh connection to that instance still uses it;
        then only those batches' native sides are forgotten."""
        with self._lock:
            users = self._users.get(peer.id, set())
            if peer not in users:
                return  # an earlier loss tore the state down under this connection already
            users.discard(peer)
            fresh = time.monotonic() - FRESH_BEATS * self._config.peer_timeout_s / 9
            if any(p.state is PeerState.CONNECTED and p.last_heard() > fresh for p in users):
                for bid in batch_ids:  # only this connection's batches go
                    self._expire(bid)
            else:
                self._users.pop(peer.id, None)
                self._disconnect(peer)
