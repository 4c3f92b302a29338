"""The payloads of the control channel's HELLO and NOTIFY frames, checked field by field.

Also the text of the notifications NIXL and Mooncake deliver with a batch (our stand-in for
immediate data on those transports): ``sgd2 <tag> <count> <mac>``. Their transports take
notifications from anyone who reaches the port (measured from a host outside the deployment:
a forged one was credited), so each carries an HMAC-SHA256 of tag and count under the
deployment's secret; one without a valid MAC is dropped (ForgedNotification), never
credited, and never blamed on the peer it names (the name is the sender's to choose).

A HELLO carries the control protocol's version, the backend and provider, the sender's
instance id, its control address and the backend's endpoint info (or, in reply, a refusal
``{"error": reason}``); a NOTIFY credits ``count`` arrivals to ``tag`` for backends without
native immediates. Both are JSON objects with exactly these fields; anything else raises
TransferError naming the field, and the connection that sent it is closed.
"""

from __future__ import annotations

import hashlib
import hmac
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


NOTIF_PREFIX = "sgd2 "


class ForgedNotification(ValueError):
    """A notification in our format without the deployment secret's MAC."""


def _mac(key: bytes, tag: int, count: int) -> str:
    return hmac.new(key, f"notif {tag} {count}".encode(), hashlib.sha256).hexdigest()[:32]


def notif_text(tag: int, count: int, key: bytes | None) -> str:
    """`key`: the deployment's secret (None: both ends run without one)."""
    return f"{NOTIF_PREFIX}{tag} {count} {_mac(key, tag, count) if key else '-'}"


def parse_notif(msg: str | bytes, key: bytes | None) -> tuple[int, int] | None:
    """(tag, count) of one of our batch notifications; None for a message that is not ours.
    Raises ForgedNotification for one whose MAC is not the secret's, ValueError for one that
    claims to be ours but is malformed."""
    text = msg.decode("utf-8", errors="replace") if isinstance(msg, bytes) else msg
    if not text.startswith(NOTIF_PREFIX):
        return None
    fields = text[len(NOTIF_PREFIX):].split()
    if len(fields) != 3:
        raise ValueError(f"notification {text[:64]!r}: expected 'sgd2 <tag> <count> <mac>'")
    tag, count = int(fields[0]), int(fields[1])
    if not 0 <= tag < 2**32 or count < 0:
        raise ValueError(f"notification {text[:64]!r}: tag or count out of range")
    if key is not None and not hmac.compare_digest(fields[2], _mac(key, tag, count)):
        raise ForgedNotification(f"notification for tag {tag} without the deployment secret's MAC: dropped")
    return tag, count
