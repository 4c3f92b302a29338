"""The migration's source, as it travels in B's request: SGLang's bootstrap fields (host, port,
room) name decoder A's messenger and the held request, and the room carries a MAC with the
deployment's secret over all three.

A request with a grammar also says how many of its input tokens are outputs A already
generated (``replay``: B advances the grammar over them before it samples), in the request id
B receives (``<rid>.m<handle>g<replay>``, which SGLang keeps as given); the MAC covers it too.

Why a MAC: B's front end takes these fields from anyone holding the API key, and a decoder
that believed them would connect its messenger wherever a client pointed it. B checks the MAC
before it contacts anything: without the secret, a forged source is refused at intake
(one try in 2**32 passes the check, and even then A refuses an order for a request it does
not hold). Pure: no sockets.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

HANDLE_BITS = 31
MAC_BITS = 32


class SourceError(ValueError):
    """Bootstrap fields that do not name a migration source this deployment made."""


MAX_REPLAY = 1 << 20
_RID = re.compile(r"\.m([0-9]{1,10})(?:g([0-9]{1,7}))?$")


def migrated_rid(rid: str) -> bool:
    """Whether `rid` is one a decoder gave a request it migrated here (the suffix A appends)."""
    return bool(_RID.search(rid))


def _mac(secret: bytes, host: str, port: int, handle: int, replay: int) -> int:
    msg = f"sglang-disagg migration source v2|{host}|{port}|{handle}|{replay}".encode()
    return int.from_bytes(hmac.new(secret, msg, hashlib.sha256).digest()[:4], "big")


@dataclass(frozen=True, slots=True)
class Source:
    host: str
    port: int
    handle: int  # the held request's key on A (never A's rid)
    replay: int = 0  # output tokens in the input that B's grammar must accept first (0: no grammar)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def new(cls, address: str, replay: int = 0, group: int = 0, groups: int = 1) -> Source:
        """A fresh handle. A data-parallel decoder's groups share one messenger address, whose
        owner hands B's order to the group holding the request: the handle says which
        (handle % groups == group, dp/owner.py), so it is drawn from that group's residues."""
        host, _, port = address.rpartition(":")
        if not 0 <= replay < MAX_REPLAY:
            raise ValueError(f"replay {replay}: 0 to {MAX_REPLAY - 1}")
        if not 0 <= group < groups:
            raise ValueError(f"DP group {group} of {groups}")
        handle = secrets.randbelow(((1 << HANDLE_BITS) - groups) // groups + 1) * groups + group
        return cls(host, int(port), handle, replay)

    def room(self, secret: bytes) -> int:
        return (self.handle << MAC_BITS) | _mac(secret, self.host, self.port, self.handle, self.replay)

    def fields(self, secret: bytes, rid: str) -> dict:
        """B's bootstrap fields and request id (A's rid, the handle and the replay count)."""
        return {"bootstrap_host": self.host, "bootstrap_port": self.port, "bootstrap_room": self.room(secret),
                "rid": f"{rid}.m{self.handle}" + (f"g{self.replay}" if self.replay else "")}

    @classmethod
    def of(cls, host: object, port: object, room: object, secret: bytes, rid: object = "") -> Source | None:
        """The source a request's bootstrap fields and id name (None: they name none), or SourceError."""
        if host is None:  # SGLang may fill a room (and a default port) on its own: the host decides
            return None
        if not isinstance(host, str) or not host or len(host) > 255:
            raise SourceError("a migrated request names no valid source host")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise SourceError("a migrated request names no valid source port")
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << (HANDLE_BITS + MAC_BITS):
            raise SourceError("a migrated request names no valid room")
        handle, mac = room >> MAC_BITS, room & ((1 << MAC_BITS) - 1)
        m = _RID.search(rid) if isinstance(rid, str) else None
        replay = int(m.group(2) or 0) if m is not None and int(m.group(1)) == handle else 0
        if not hmac.compare_digest(mac.to_bytes(4, "big"),
                                   _mac(secret, host, port, handle, replay).to_bytes(4, "big")):
            raise SourceError("the migration source is not authenticated (its room's MAC does not match this "
                              "deployment's secret)")
        return cls(host, port, handle, replay)
