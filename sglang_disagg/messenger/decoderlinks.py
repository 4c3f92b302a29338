"""A prefill rank's table of the decoders it writes into, and its bounds.

Scheduler thread, every rank, driven by the broadcast inputs (the same on all ranks):
``join`` on DecoderJoined, ``leave`` on DecoderLeft (the intake emits it once a lost or
replaced decoder's cancels are out), ``settled`` when an order of it ends here.

Bounded (docs/security.md, tables): a link lives while its decoder is known to the intake
(at most MAX_DECODERS at once, intake.py) or an order of it is still on this rank; then it
is dropped. Only the leader holds data connections. A decoder whose control connection
dropped while it lives says Hello again with the same key, and closing our data connection
to it meanwhile would fail its transfers from us; so the leader parks a left decoder's live
connection for that Hello, at most PARKED of them, the oldest closed first. Without the
drop, every decoder restart (a new instance, so a new key) would leave a link, its remote
regions and a connection behind for the life of the server.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from ..backends import PeerState
from .inputs import DecoderKey
from .orders import DecoderLink

PARKED = 16


class DecoderLinks:
    def __init__(self) -> None:
        self._links: dict[DecoderKey, DecoderLink] = {}
        self._leaving: set[DecoderKey] = set()   # left, but an order of theirs is still here
        self._parked: collections.OrderedDict[DecoderKey, Any] = collections.OrderedDict()  # key -> data peer (leader)

    # ----- reads -----------------------------------------------------------------------
    def get(self, key: DecoderKey) -> DecoderLink | None:
        return self._links.get(key)

    def __getitem__(self, key: DecoderKey) -> DecoderLink:
        return self._links[key]

    def items(self) -> list[tuple[DecoderKey, DecoderLink]]:
        return list(self._links.items())  # a copy: the metrics thread reads while the scheduler writes

    def __len__(self) -> int:
        return len(self._links)

    def __iter__(self) -> Iterator[DecoderKey]:
        return iter(list(self._links))

    def sizes(self) -> dict[str, int]:
        return {"links": len(self._links), "leaving": len(self._leaving), "parked": len(self._parked)}

    # ----- the life cycle ----------------------------------------------------------------
    def join(self, key: DecoderKey, link: DecoderLink) -> Any:
        """Record `link`; the data peer to keep for it if one lives (the previous link's, or
        one parked when it left), else None."""
        old = self._links.get(key)
        self._links[key] = link
        self._leaving.discard(key)
        parked = self._parked.pop(key, None)
        kept = old.peers.get(0) if old is not None else parked
        if parked is not None and parked is not kept:
            _close(parked)
        return kept

    def leave(self, key: DecoderKey, busy: bool) -> None:
        """The decoder is gone (its orders' cancels applied before this). `busy`: an order of
        it is still on this rank; the link then stays until `settled`."""
        if key not in self._links:
            return
        if busy:
            self._leaving.add(key)
        else:
            self._drop(key)

    def settled(self, key: DecoderKey, busy: bool) -> None:
        """An order of `key` ended here; `busy`: another one is still here."""
        if key in self._leaving and not busy:
            self._leaving.discard(key)
            self._drop(key)

    def close(self) -> None:
        for peer in self._parked.values():
            _close(peer)
        self._parked.clear()

    def _drop(self, key: DecoderKey) -> None:
        link = self._links.pop(key)
        peer = link.peers.get(0)
        for k in [k for k, p in self._parked.items() if p.state is not PeerState.CONNECTED]:
            del self._parked[k]  # already lost: nothing to close
        if peer is None or peer.state is not PeerState.CONNECTED:
            return
        if any(peer is other.peers.get(0) for other in self._links.values()):
            return  # another link writes through it
        self._parked[key] = peer
        while len(self._parked) > PARKED:
            _, oldest = self._parked.popitem(last=False)
            _close(oldest)


def _close(peer: Any) -> None:
    try:
        peer.close()
    except Exception:  # noqa: BLE001 - a connection that is going away anyway
        pass
