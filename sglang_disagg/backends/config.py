"""A transfer backend's configuration (frozen, validated with errors naming the field)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BATCH_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """`provider` selects the libfabric provider ("tcp" = tcp;ofi_rxm, the default; "efa", "verbs";
    "shm" is refused, see backends/libfabric/__init__.py);
    other backends ignore it. `host` is where the control channel listens (and, for TCP
    transports, the data path binds): loopback in tests. `port` is the control channel's
    port (0: any free port). `options` are backend specific.
    `secret`: the deployment's shared secret every control connection must prove (auth.py;
    None: both ends run without one). `handshake_timeout_s`: how long a new connection may
    take to authenticate and say HELLO (a deadline from its accept, not a timeout per read).
    `max_connections`: control connections alive at once (when all are taken, a newcomer
    evicts the oldest one not yet admitted; see control_server.ControlServer).
    `batch_timeout_s`: a batch of writes not complete this long after posting fails with
    DeadlineExceeded (a write whose completion never comes must not hold its future forever).
    `peer_timeout_s`: a peer that sent nothing at all (not even its heartbeat) for this long is
    lost: hung or stopped.
    `rails`: the interfaces the data path uses, as "ADDRESS/PREFIX" (IPv4), one transport
    endpoint each (libfabric; backends/libfabric/rails.py); () = one endpoint on `host`. The
    control channel stays on `host` either way. Other backends take their device lists from
    the launcher (docs/backends.md, "Rails")."""

    provider: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    connect_timeout_s: float = 5.0
    options: Mapping[str, Any] = field(default_factory=dict)
    secret: bytes | None = field(default=None, repr=False)
    handshake_timeout_s: float = 2.0
    max_connections: int = 256
    batch_timeout_s: float = DEFAULT_BATCH_TIMEOUT_S
    peer_timeout_s: float = 1.8  # the heartbeat thread wakes when the silence passes it: lost within 1.8 s (+ 5 ms)
    rails: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.secret is not None and (not isinstance(self.secret, bytes) or len(self.secret) < 16):
            raise ValueError("secret: need bytes of at least 16 (see sglang_disagg.backends.auth)")
        for name in ("connect_timeout_s", "handshake_timeout_s", "batch_timeout_s", "peer_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ValueError(f"max_connections: must be a positive int, got {self.max_connections!r}")
        object.__setattr__(self, "rails", check_rails(self.rails))


MAX_RAILS = 16


def check_rails(rails: object) -> tuple[str, ...]:
    """("ADDRESS/PREFIX", ...) of distinct IPv4 interfaces, at most MAX_RAILS; ValueError naming the entry."""
    if isinstance(rails, str) or not isinstance(rails, (tuple, list)):
        raise ValueError(f"rails: need a list of \"ADDRESS/PREFIX\" strings, got {rails!r}")
    if len(rails) > MAX_RAILS:
        raise ValueError(f"rails: at most {MAX_RAILS}, got {len(rails)}")
    out = []
    for r in rails:
        try:
            if not isinstance(r, str) or "/" not in r:
                raise ValueError("not ADDRESS/PREFIX")
            iface = ipaddress.IPv4Interface(r)
        except ValueError as e:
            raise ValueError(f"rails: {r!r} is not an IPv4 ADDRESS/PREFIX ({e})") from None
        if str(iface) in out:
            raise ValueError(f"rails: {r!r} is named twice")
        out.append(str(iface))
    return tuple(out)
