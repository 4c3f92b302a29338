"""The payloads of the control channel's HELLO and NOTIFY frames, checked field by field.

Also the text of the notifications NIXL and Mooncake deliver with a batch (our stand-in for
immediate data on those transports): ``sgd2 <tag> <count> <mac>``. Their transports take
notifications from anyone who reaches the port (measured from a host outside the deployment:
a forged one was credited), so each carries an HMAC-SHA256 of tag and count under the
deployment's secret. Authentication comes first: anything that is not a well-formed one of
ours with a valid MAC (malformed, over-long, non-ASCII, forged, not ours at all) is dropped
and counted (NotifDrops), never credited, and never blamed on any peer: the sender's name
arrives with the notification and is the sender's to choose.

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
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import TransferError

log = logging.getLogger(__name__)

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
MAX_NOTIF_BYTES = 256  # ours are at most 57: "sgd2 " + 10 + 1 + 8 + 1 + 32
_NOTIF = re.compile(r"sgd2 (0|[1-9][0-9]{0,9}) ([1-9][0-9]{0,7}) ([0-9a-f]{32}|-)")


class RejectedNotification(ValueError):
    """A notification that is not a well-formed one of ours with the deployment secret's MAC.
    `reason` names the stat it is counted under; it is dropped, never credited, and never
    blamed on anyone (its sender names itself)."""

    reason = "malformed"


class ForgedNotification(RejectedNotification):
    """Well formed, but its MAC is not the deployment secret's."""

    reason = "forged"


def _mac(key: bytes, tag: int, count: int) -> str:
    return hmac.new(key, f"notif {tag} {count}".encode(), hashlib.sha256).hexdigest()[:32]


def notif_text(tag: int, count: int, key: bytes | None) -> str:
    """`key`: the deployment's secret (None: both ends run without one)."""
    if not 0 <= tag < 2**32 or not 0 < count <= MAX_NOTIFY:
        raise TransferError(f"notification for tag {tag}, {count} writes: outside 0..2^32-1, 1..{MAX_NOTIFY}")
    return f"{NOTIF_PREFIX}{tag} {count} {_mac(key, tag, count) if key else '-'}"


def parse_notif(msg: object, key: bytes | None) -> tuple[int, int] | None:
    """(tag, count) of one of our batch notifications carrying `key`'s MAC ("-" when there is
    no key); None for a message that is not ours (another prefix). Anything else raises
    RejectedNotification (ForgedNotification when only the MAC is wrong), and nothing else is
    raised, whatever `msg` is: its length is bounded before anything is decoded or parsed."""
    if not isinstance(msg, (str, bytes)):
        raise RejectedNotification(f"notification of type {type(msg).__name__}")
    if len(msg) > MAX_NOTIF_BYTES:
        raise RejectedNotification(f"notification of {len(msg)} characters (at most {MAX_NOTIF_BYTES})")
    if not msg.isascii():
        raise RejectedNotification(f"notification {msg[:64]!r} is not ASCII")
    text = msg.decode("ascii") if isinstance(msg, bytes) else msg
    if not text.startswith(NOTIF_PREFIX):
        return None
    m = _NOTIF.fullmatch(text)
    if m is None:
        raise RejectedNotification(f"notification {text[:64]!r} is not 'sgd2 <tag> <count> <mac>'")
    tag, count, mac = int(m[1]), int(m[2]), m[3]
    if tag >= 2**32 or count > MAX_NOTIFY:
        raise RejectedNotification(f"notification {text[:64]!r}: tag or count out of range")
    if not hmac.compare_digest(mac, _mac(key, tag, count) if key else "-"):
        raise ForgedNotification(f"notification for tag {tag} without the deployment secret's MAC")
    return tag, count


class NotifDrops:
    """The notifications a backend dropped, counted by reason ("forged", "malformed", "foreign":
    not ours), and the log line about them: at most one every `every_s` seconds, saying how many
    it did not log (anyone who reaches the data plane can send them as fast as they like)."""

    REASONS = ("forged", "malformed", "foreign")

    def __init__(self, backend: str, every_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._backend, self._every_s, self._clock = backend, every_s, clock
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.REASONS, 0)
        self._next_log = float("-inf")
        self._unlogged = 0

    def drop(self, reason: str, why: object) -> None:
        with self._lock:
            self._counts[reason] += 1
            now = self._clock()
            if now < self._next_log:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._next_log = self._unlogged, 0, now + self._every_s
            totals = dict(self._counts)
        log.warning("%s: dropped a %s notification (%s); %d more dropped since the last such line; "
                    "totals %s (no peer is blamed: a notification's sender names itself)",
                    self._backend, reason, why, unlogged, totals)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {f"{reason}_notifications_dropped": n for reason, n in self._counts.items()}
