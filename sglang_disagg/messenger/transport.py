"""The transfer-backend contract as the messenger uses it: `Transport` and `TransportPeer`.

These Protocols hold exactly the members the messenger package calls on a backend and on its
peers, no more: a `backends.base.TransferBackend` (and its `Peer`) satisfies them, and so does
`dp.proxy.ProxyBackend` (and its `ProxyPeer`), which stands in for the server's one backend in a
DP group other than the owner's. What the messenger does not call (`wait_peer`, `write`,
`write_uniform`, `peers`, `Peer.notify`, ...) is the backends' own business and is not here.

Regions and remote regions are opaque handles (`Any`): a backend returns a `MemoryRegion` and a
`RemoteRegion`, the proxy plain ids; the messenger only hands them back to the same backend.
Errors are those of `backends.errors` (`TransferError` and its subclasses), never return codes.
`tests/unit/test_transport_contract.py` holds every registered backend and the proxy to these
signatures (parameter names, kinds and defaults).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..backends.future import TransferFuture
from ..backends.regions import HOST, Memory, PeerState

__all__ = ["Transport", "TransportPeer"]


@runtime_checkable
class TransportPeer(Protocol):
    """A connection to another server's backend, as `Transport.connect` or `Transport.recv` gave it."""

    @property
    def id(self) -> str:
        """The peer backend's instance id: the owner named in its region descriptors, and what
        `Transport.expect(peer=...)` takes to tie an expectation to this peer."""
        ...

    @property
    def address(self) -> str:
        """The peer's control address (host:port), for logs and for telling peers apart."""
        ...

    @property
    def state(self) -> PeerState:
        """CONNECTED until the connection is closed here (CLOSED) or lost (LOST); it changes on
        the backend's threads, and never goes back to CONNECTED."""
        ...

    def send(self, data: bytes) -> None:
        """Send a small control message, delivered in order to the peer's `Transport.recv()`;
        raise PeerLostError when the peer is not connected."""
        ...

    def add_remote_region(self, descriptor: bytes | str) -> Any:
        """Validate a region descriptor this peer sent (its owner must be this peer, its backend
        and provider ours) and return the opaque remote handle `write_pages` takes as `dst`;
        raise DescriptorError for one that does not fit."""
        ...

    def close(self) -> None:
        """Close the connection here: its state becomes CLOSED and its pending writes and
        expectations fail with PeerLostError."""
        ...


@runtime_checkable
class Transport(Protocol):
    """One server's transfer backend: registered memory, peers, one-sided writes counted by tag."""

    @property
    def name(self) -> str:
        """The backend's registered name (``shmem``, ``libfabric``, ...), compared at first contact."""
        ...

    @property
    def provider(self) -> str:
        """The provider or transport the backend runs (``""`` where it has none), compared at first contact."""
        ...

    @property
    def address(self) -> str:
        """Where peers connect: host:port of the backend's control channel."""
        ...

    @property
    def instance(self) -> str:
        """This backend's instance id, unique per process start; peers know us by it."""
        ...

    def register(self, addr: int, length: int, memory: Memory = HOST) -> tuple[Any, bytes]:
        """Register [addr, addr+length) of `memory`'s kind for peers to write into and for our
        writes to read from; return (opaque region handle, descriptor bytes to send to peers).
        Raise DescriptorError for a bad range and UnsupportedMemory for a kind it cannot
        register (never treat device memory as host)."""
        ...

    def connect(self, address: str, timeout_s: float | None = None) -> TransportPeer:
        """Authenticate to the backend listening at `address` and exchange hellos; return the
        connected peer. `timeout_s` None: the backend's configured connect timeout."""
        ...

    def recv(self, timeout_s: float) -> tuple[TransportPeer, bytes]:
        """The next control message any peer sent with `send()`, and who sent it; raise
        DeadlineExceeded when none came within `timeout_s`, TransferError once closed."""
        ...

    def write_pages(self, peer: TransportPeer, src: Any, src_pages: Any, src_stride: int, dst: Any,
                    dst_pages: Any, dst_stride: int, length: int, imm: int, src_offset: int = 0,
                    dst_offset: int = 0) -> TransferFuture:
        """Post one batch: page i copies `length` bytes from src + src_pages[i]*src_stride +
        src_offset to dst + dst_pages[i]*dst_stride + dst_offset, each write carrying the 32-bit
        immediate `imm`. Everything is validated before anything is posted (DescriptorError);
        the future completes once every write completed locally, or fails (TransferError,
        PeerLostError, DeadlineExceeded past the batch timeout)."""
        ...

    def expect(self, tag: int, count: int, timeout_s: float, peer: Any = None) -> TransferFuture:
        """A future that completes once `count` writes with immediate `tag` landed here; it fails
        with DeadlineExceeded after `timeout_s` and with PeerLostError when a peer it is tied to
        is lost (`peer`: a peer, or a collection of peer instance ids; None: any peer)."""
        ...

    def retire(self, tag: int, reason: str = "cancelled") -> None:
        """Stop counting `tag`: its pending expectation fails with TransferError(`reason`), and
        writes that still arrive with that tag are discarded (counted in stats'
        ``late_writes_dropped``)."""
        ...

    def forget(self, tag: int) -> None:
        """Drop the unclaimed count of a tag nobody will expect (writes that landed with no
        expectation set)."""
        ...

    def is_retired(self, tag: int) -> bool:
        """Whether `tag` was retired and not forgotten since."""
        ...

    def landed(self, tag: int) -> int:
        """How many writes with retired `tag` arrived here, before it was retired and since
        (-1: not retired here). A decoder frees a failed request's pages once every write the
        prefill posted for it is accounted for: none can land in them afterwards."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for metrics and logs (peers, batches, expectations, late_writes_dropped, ...)."""
        ...

    def close(self) -> None:
        """Fail whatever is pending, close every peer, deregister memory and join the backend's
        threads; a second call does nothing."""
        ...
