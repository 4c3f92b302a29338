"""The payloads of the control channel's HELLO and NOTIFY frames, checked field by field.
(The notifications NIXL and Mooncake deliver with a batch: notifications.py.)

A HELLO carries the control protocol's version, the backend and provider, the sender's
instance id, its control address and the backend's endpoint info (or, in reply, a refusal
``{"error": reason}``); a NOTIFY credits ``count`` arrivals to ``tag`` for backends without
native immediates. Both are JSON objects with exactly these fields; anything else raises
TransferError naming the field, and the connection that sent it is closed.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import TransferError

MAX_NOTIFY = 1 << 24       # arrivals one NOTIFY may credit (a request's writes: pages x layers x 2)
_HELLO_FIELDS = {"v": int, "backend": str, "provider": str, "instance": str, "address": str, "endpoint": dict}
_MAX_STR = 256


def parse_hello(payload: bytes) -> dict[str, Any]:
    """A peer's HELLO (or its refusal, {"error": str}) as a dict of checked fields; raises
    TransferError naming the first field that is wrong."""
    try:
        hello = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise TransferError(f"HELLO is not valid JSON: {e}") from None
    if not isinstance(hello, dict):
        raise TransferError("HELLO must be a JSON object")
    if set(hello) == {"error"} and isinstance(hello["error"], str):
        return hello
    if set(hello) != set(_HELLO_FIELDS):
        raise TransferError(f"HELLO fields {sorted(hello)[:8]} != expected {sorted(_HELLO_FIELDS)}")
    for name, typ in _HELLO_FIELDS.items():
        value = hello[name]
        if not isinstance(value, typ) or isinstance(value, bool):
            raise TransferError(f"HELLO field {name!r} must be {typ.__name__}")
        if typ is str and not 0 < len(value) <= _MAX_STR:
            raise TransferError(f"HELLO field {name!r} must be 1..{_MAX_STR} characters")
    host, sep, port = hello["address"].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"HELLO field 'address' {hello['address']!r} is not host:port")
    return hello


def parse_notify(payload: bytes) -> tuple[int, int]:
    note = json.loads(payload)
    if not isinstance(note, dict) or set(note) != {"tag", "count"}:
        raise TransferError("NOTIFY must be an object with exactly 'tag' and 'count'")
    tag, count = note["tag"], note["count"]
    if type(tag) is not int or not 0 <= tag < 2**32:
        raise TransferError(f"NOTIFY tag {tag!r} is not a 32-bit unsigned integer")
    if type(count) is not int or not 0 < count <= MAX_NOTIFY:
        raise TransferError(f"NOTIFY count {count!r} outside 1..{MAX_NOTIFY}")
    return tag, count

