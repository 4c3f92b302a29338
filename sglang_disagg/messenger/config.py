"""The messenger's configuration: what the launcher hands to each SGLang server.

One JSON object in the environment variable ``SGLANG_DISAGG_MESSENGER`` (set by
``python -m sglang_disagg.launch --mode messenger``; absent = SGLang runs unchanged).
Validated here, with errors that name the field.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, dataclass, fields

from ..backends.config import check_rails

ENV = "SGLANG_DISAGG_MESSENGER"


class MessengerRole(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class ConfigError(ValueError):
    pass


def _address(value: str, field: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{field}: {value!r} is not host:port")
    return value


@dataclass(frozen=True, slots=True)
class MessengerConfig:
    """`port`: where a prefill server's messenger listens (decoders connect there; 0 on a
    decoder). `prefill`: the prefill messengers a decoder may use, as host:port.
    `transfer_timeout_s`: how long a decoder waits for a request's KV before failing it.
    `recheck_s`: how long a decoder keeps a prefill server that failed its last requests
    out of use before connecting again (doubling while it keeps failing, up to 30 s).
    `stats_file`: where the leader publishes its counters as JSON ("" = nowhere);
    `metrics_port`: where it serves them to Prometheus (0 = nowhere).
    `stream`: a prefill server posts each layer's writes as the forward passes that layer
    (False: a chunk's writes after its forward ends). `reuse_prefix`: a decoder asks only
    for the pages after what its radix tree holds of a prompt (False: whole prompts).
    `migration_rate_bps`: a decoder's outgoing live migrations together write at most this many
    bytes per second (0 = no cap; migration/pacer.py)."""

    role: MessengerRole
    backend: str
    provider: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    prefill: tuple[str, ...] = ()
    name: str = ""
    transfer_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    recheck_s: float = 1.0
    stats_file: str = ""
    stream: bool = True
    reuse_prefix: bool = True
    metrics_port: int = 0  # Prometheus endpoint of the leader (0 = none)
    rails: tuple[str, ...] = ()  # data-path interfaces, "ADDRESS/PREFIX" (BackendConfig.rails); (): host only
    migration_rate_bps: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.role, MessengerRole):
            try:
                object.__setattr__(self, "role", MessengerRole(self.role))
            except ValueError:
                raise ConfigError(f"role: {self.role!r} is not one of "
                                  f"{', '.join(r.value for r in MessengerRole)}") from None
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError("backend: a transfer backend name is required (libfabric, nixl, mooncake)")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
                raise ConfigError(f"{name}: {value!r} is not a port number")
        object.__setattr__(self, "prefill", tuple(self.prefill))
        try:
            object.__setattr__(self, "rails", check_rails(self.rails))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for i, addr in enumerate(self.prefill):
            _address(addr, f"prefill[{i}]")
        if self.role is MessengerRole.DECODE and not self.prefill:
            raise ConfigError("prefill: a decoder needs at least one prefill messenger address (host:port)")
        if self.role is MessengerRole.PREFILL and not self.port:
            raise ConfigError("port: a prefill server's messenger needs a fixed port for decoders to reach")
        rate = self.migration_rate_bps
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < float("inf"):
            raise ConfigError(f"migration_rate_bps: must be 0 (no cap) or a positive number of bytes/s, got {rate!r}")
        for name in ("transfer_timeout_s", "connect_timeout_s", "recheck_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name}: must be a positive number of seconds, got {value!r}")

    def to_env(self) -> str:
        d = asdict(self)
        d["role"] = self.role.value
        d["prefill"] = list(self.prefill)
        d["rails"] = list(self.rails)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MessengerConfig:
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{ENV} is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{ENV} must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ConfigError(f"{ENV}: unknown field(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**obj)
        except TypeError as e:
            raise ConfigError(f"{ENV}: {e}") from None

    @classmethod
    def from_env(cls) -> MessengerConfig | None:
        text = os.environ.get(ENV)
        return cls.from_json(text) if text else None
