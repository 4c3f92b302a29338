"""Value types of the backend API: configuration, regions, descriptors, writes."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple

from .. import untrusted
from .errors import DescriptorError

DESCRIPTOR_VERSION = 1
_U64 = 2**64
MAX_DESCRIPTOR_BYTES = 16 << 20  # a descriptor travels inside one control message (its 16 MiB bound)


class PeerState(enum.Enum):
    CONNECTED = "connected"
    LOST = "lost"        # died or reset: noticed through the control channel
    CLOSED = "closed"    # closed by us


class MemoryKind(enum.Enum):
    HOST = "host"    # CPU memory (pageable or pinned)
    CUDA = "cuda"    # CUDA device memory (cudaMalloc or cuMem), on device `Memory.device`


@dataclass(frozen=True, slots=True)
class Memory:
    """Where a registered range lives. A backend that cannot register this kind raises
    UnsupportedMemory at register() naming what it lacks, never registers it as host memory."""

    kind: MemoryKind = MemoryKind.HOST
    device: int = -1  # the CUDA ordinal for CUDA memory; -1 for host memory

    def __post_init__(self) -> None:
        if not isinstance(self.kind, MemoryKind):
            raise ValueError(f"Memory.kind must be a MemoryKind, got {self.kind!r}")
        if (self.kind is MemoryKind.CUDA) != (self.device >= 0):
            raise ValueError(f"Memory: {self.kind.value} memory with device {self.device} "
                             "(CUDA memory names its device ordinal >= 0, host memory -1)")

    def __str__(self) -> str:
        return "host memory" if self.kind is MemoryKind.HOST else f"cuda:{self.device} memory"


HOST = Memory()


def cuda(device: int) -> Memory:
    return Memory(MemoryKind.CUDA, device)


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A local registration. Offsets in writes are relative to `addr`."""

    id: int
    addr: int
    length: int
    owner: str  # instance id of the backend that registered it
    memory: Memory = HOST


@dataclass(frozen=True, slots=True)
class RegionDescriptor:
    """What a peer needs to write into one of our regions. Serialised as JSON with named
    fields; `base` is what the data path adds offsets to (the virtual address where the
    provider wants one, else 0), `key` the remote key, `extra` backend specifics."""

    version: int
    backend: str
    provider: str
    owner: str
    region: int
    length: int
    base: int
    key: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview | str) -> RegionDescriptor:
        try:  # a peer's: bounded before json reads it (untrusted.py)
            obj = untrusted.loads(raw, MAX_DESCRIPTOR_BYTES)
        except untrusted.MalformedJSON as e:
            raise DescriptorError(f"unreadable region descriptor: {e}") from e
        if not isinstance(obj, dict):
            raise DescriptorError("region descriptor must be a JSON object")
        names = {f.name for f in fields(cls)}
        if set(obj) != names:
            raise DescriptorError(f"region descriptor fields {sorted(obj)} != expected {sorted(names)}")
        if obj["version"] != DESCRIPTOR_VERSION:
            raise DescriptorError(f"region descriptor version {obj['version']!r}, this build reads {DESCRIPTOR_VERSION}")
        for name in ("backend", "provider", "owner"):
            if not isinstance(obj[name], str):
                raise DescriptorError(f"region descriptor field {name!r} must be a string")
        for name in ("region", "length", "base", "key"):
            v = obj[name]
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _U64:
                raise DescriptorError(f"region descriptor field {name!r}={v!r} is not a 64-bit unsigned integer")
        if obj["length"] == 0 or obj["base"] + obj["length"] > _U64:
            raise DescriptorError(f"region descriptor range base={obj['base']} length={obj['length']} is invalid")
        if not isinstance(obj["extra"], dict):
            raise DescriptorError("region descriptor field 'extra' must be an object")
        return cls(**obj)


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """A peer's region, validated against the peer it came from."""

    peer: str
    descriptor: RegionDescriptor

    @property
    def length(self) -> int:
        return self.descriptor.length


class PageWrite(NamedTuple):
    """Copy `length` bytes from `src` + `src_offset` to `dst` + `dst_offset`."""

    src: MemoryRegion
    src_offset: int
    dst: RemoteRegion
    dst_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class NativeRegistration:
    """What a backend's native registration returns to the shared code."""

    handle: Any
    base: int
    key: int
    extra: Mapping[str, Any] = field(default_factory=dict)
