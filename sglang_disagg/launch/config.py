"""What a launch is: roles, transfer backends, ports, validated up front."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"
    ALL = "all"  # 1 prefill + 1 decode + the sglang-router, on this machine
    COLOCATED = "colocated"  # one ordinary SGLang server: the A/B baseline


class TransferBackend(str, Enum):
    """SGLang's upstream PD transfer backends usable on CPU."""

    MOONCAKE = "mooncake"
    NIXL = "nixl"
    FAKE = "fake"  # decode only, no KV moves: for negative controls


@dataclass(frozen=True)
class Ports:
    """Every port a local stack binds, derived from the front door so that two
    stacks started with different ``--port`` never collide."""

    front: int

    @property
    def prefill(self) -> int:
        return self.front + 1

    @property
    def decode(self) -> int:
        return self.front + 2

    @property
    def bootstrap(self) -> int:
        return self.front + 3

    @property
    def prefill_dist(self) -> int:
        return self.front + 4

    @property
    def decode_dist(self) -> int:
        return self.front + 5

    @property
    def colocated_dist(self) -> int:
        return self.front + 6

    def all(self, role: Role) -> dict[str, int]:
        if role is Role.COLOCATED:
            return {"colocated server": self.front, "colocated dist-init": self.colocated_dist}
        ports = {
            "router": self.front,
            "prefill server": self.prefill,
            "decode server": self.decode,
            "prefill bootstrap": self.bootstrap,
            "prefill dist-init": self.prefill_dist,
            "decode dist-init": self.decode_dist,
        }
        keep = {
            Role.ALL: ports.keys(),
            Role.PREFILL: ("prefill server", "prefill bootstrap", "prefill dist-init"),
            Role.DECODE: ("decode server", "decode dist-init"),
            Role.ROUTER: ("router",),
        }[role]
        return {k: v for k, v in ports.items() if k in keep}


@dataclass(frozen=True)
class LaunchConfig:
    role: Role
    model: str  # a built-in model name or a directory
    port: int = 30000
    host: str = "127.0.0.1"
    backend: TransferBackend = TransferBackend.MOONCAKE
    device: str = "cpu"
    prefill_tp: int = 1
    decode_tp: int = 1
    dtype: str | None = None  # None: float32 for built-in models, SGLang's default otherwise
    max_total_tokens: int = 8192
    prefill_urls: tuple[str, ...] = ()  # router role: "http://host:port[@bootstrap_port]"
    decode_urls: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()  # passed through to every SGLang server
    log_dir: str | None = None
    startup_timeout_s: float = 300.0
    env: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if not 1024 <= self.port <= 65535 - 8:
            raise ValueError(f"--port {self.port}: must be in 1024..65527 (the stack uses port..port+6)")
        for name, tp in (("--prefill-tp", self.prefill_tp), ("--decode-tp", self.decode_tp)):
            if tp < 1:
                raise ValueError(f"{name} must be >= 1, got {tp}")
            if self.device == "cpu" and tp > (os.cpu_count() or 1):
                raise ValueError(f"{name} {tp} exceeds the {os.cpu_count()} CPU cores of this machine")
        if self.role is Role.ROUTER and not (self.prefill_urls and self.decode_urls):
            raise ValueError("--role router needs at least one --prefill-url and one --decode-url")
        if self.backend is TransferBackend.FAKE and self.role is not Role.DECODE:
            raise ValueError("--transfer-backend fake only works for --role decode (SGLang refuses it on prefill)")
        if self.max_total_tokens < 256:
            raise ValueError("--max-total-tokens must be >= 256")

    @property
    def ports(self) -> Ports:
        return Ports(self.port)
