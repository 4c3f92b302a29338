"""A connected peer: its control connection and whatever the backend attached to it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import control
from .regions import PeerState, RemoteRegion

if TYPE_CHECKING:
    from .base import TransferBackend


class Peer:
    def __init__(self, backend: TransferBackend, conn: control.ControlConn, instance: str, address: str,
                 endpoint: dict[str, Any]) -> None:
        self.id = instance            # the peer backend's instance id (descriptor owner)
        self.address = address        # its control address
        self.endpoint = endpoint      # backend-specific connection info from its hello
        self.state = PeerState.CONNECTED
        self.native: Any = None       # backend's per-peer state (fi_addr, agent name, session)
        self._backend = backend
        self._conn = conn

    def add_remote_region(self, descriptor: bytes | str) -> RemoteRegion:
        return self._backend.add_remote_region(self, descriptor)

    def send(self, data: bytes) -> None:
        """A small control message, delivered in order to the peer's `recv()`."""
        self._conn.send(control.MSG, bytes(data))

    def notify(self, tag: int, count: int) -> None:
        """Credit `count` arrivals for `tag` at the peer (for backends without native immediates)."""
        self._conn.send_json(control.NOTIFY, {"tag": tag, "count": count})

    def close(self) -> None:
        self._conn.close(say_bye=True)
        self._backend._drop_peer(self, PeerState.CLOSED, "closed locally")

    def __repr__(self) -> str:
        return f"Peer({self.address}, {self.id[:8]}, {self.state.value})"
