"""This server's DP groups as one scheduler's messenger sees them: the same four calls with
and without data parallelism, so Node carries no DP branch.

    open(place, ...)          what this rank holds: nothing (a follower rank), the backend
                              (no DP), the backend and the owner (DP group 0's leader), or a
                              proxy to the owner (another group's leader)
    groups.backend            the Transport this group's messenger calls (real or proxy)
    groups.dispatcher(handle) what the control reader calls for each peer message
    groups.order_done(k, t)   prefill: this group finished decoder k's order t
    groups.gone               why the server's backend is out of reach ("" while it lives)
    groups.close()

The owner's dispatch decides which group a peer's message is for (owner.py); the order
accounting it balances with lives there only, reached from group 0 by a call and from the
others by an OrderDone message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import MessengerRole
from ..inputs import DecoderKey
from ..reader import Dispatch
from ..transport import Transport
from . import wire as gw
from .owner import Owner
from .place import Place
from .proxy import ProxyBackend

OWNER_WAIT_S = 120.0  # the owner (group 0's leader) loads its model at the same time


class Groups:
    """A server without data parallelism (or a follower rank, `backend` None): one group, the
    backend in this process."""

    local = True  # the backend lives in this process (its own gauges are served here)

    def __init__(self, backend: Transport | None) -> None:
        self.backend = backend

    def dispatcher(self, handle: Callable[[Any, Any], None]) -> Dispatch:
        def dispatch(peer: Any, raw: bytes, msg: Any) -> None:
            handle(peer, msg)
        return dispatch

    def order_done(self, key: DecoderKey, tag: int) -> None:
        """Nothing to balance with one group."""

    @property
    def gone(self) -> str:
        return ""

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


class OwnerGroups(Groups):
    """DP group 0's leader: the server's one backend, and the owner serving the other groups."""

    def __init__(self, backend: Transport, owner: Owner) -> None:
        super().__init__(backend)
        self.owner = owner

    def dispatcher(self, handle: Callable[[Any, Any], None]) -> Dispatch:
        self.owner.local = handle  # every group's messages arrive here; group 0's go to `handle`
        return self.owner.dispatch

    def order_done(self, key: DecoderKey, tag: int) -> None:
        self.owner.order_done(key.instance, tag)

    def close(self) -> None:
        self.owner.close()
        super().close()


class MemberGroup(Groups):
    """Another DP group's leader: the owner's backend, through the group's channel."""

    local = False

    def __init__(self, proxy: ProxyBackend) -> None:
        super().__init__(proxy)
        self.proxy = proxy

    def order_done(self, key: DecoderKey, tag: int) -> None:
        self.proxy.tell(gw.OrderDone(key.instance, tag))

    @property
    def gone(self) -> str:
        return self.proxy.gone


def open_groups(place: Place, leader: bool, role: MessengerRole, secret: bytes | None,
                make_backend: Callable[[], Transport]) -> Groups:
    """What this rank holds of the server's groups (the backend is made only where it lives)."""
    if not leader:
        return Groups(None)
    if place.group > 0:
        return MemberGroup(ProxyBackend(place.owner_socket(secret), place.group, OWNER_WAIT_S))
    backend = make_backend()
    if place.groups == 1:
        return Groups(backend)
    try:
        return OwnerGroups(backend, Owner(backend, place.owner_socket(secret), role, place.groups))
    except BaseException:
        backend.close()
        raise
