"""The notifications NIXL and Mooncake deliver with a batch (our stand-in for immediate data on
those transports): ``sgd3 <sender> <seq> <tag> <count> <mac>``.

Their transports take notifications from anyone who reaches the port, under whatever agent name or
session the sender gives (measured from a host outside the deployment: a forged one was credited).
So a notification is believed only when all of this holds, checked in this order, before it can
have any effect:
1. it is short ASCII text of exactly that shape (bounded before anything is decoded);
2. `sender` is the instance id of a peer this backend has a live control connection with;
3. `mac` is HMAC-SHA256 of the other four fields under that connection's notification key for
   the sender's direction (frames.FrameKeys: derived from the secret and both nonces of that
   connection's handshake), so a notification from another run, another connection or another
   deployment fails even though its tag and count are the same;
4. `seq`, the sender's count of notifications on that connection, was not seen before
   (ReplayWindow), so a notification captured on the wire and sent again credits nothing.
Anything else is dropped and counted by reason (NotifDrops) and never blamed on a peer: the
sender's name is the sender's to choose. What a notification credits counts only for an
expectation tied to its sender (expect.py: `add(..., source=sender)`): a peer holding the secret
cannot complete another peer's order with notifications of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import TransferError
from .messages import MAX_NOTIFY

log = logging.getLogger(__name__)

NOTIF_PREFIX = "sgd3 "
MAX_NOTIF_BYTES = 256  # ours are at most 117 characters
MAX_SEQ = 2**63 - 1
_NOTIF = re.compile(r"sgd3 ([0-9a-f]{32}) (0|[1-9][0-9]{0,18}) (0|[1-9][0-9]{0,9}) ([1-9][0-9]{0,7}) ([0-9a-f]{32})")


class RejectedNotification(ValueError):
    """Not a well-formed notification of ours. `reason` names the stat it is counted under; it is
    dropped, never credited, and never blamed on anyone (its sender names itself)."""

    reason = "malformed"


class UnboundNotification(RejectedNotification):
    """Well formed, naming a sender with no live control connection here (another run's, a guess)."""

    reason = "unbound"


class ForgedNotification(RejectedNotification):
    """Well formed, from a live sender's name, but its MAC is not that connection's."""

    reason = "forged"


class ReplayedNotification(RejectedNotification):
    """Authentic, but its sequence number was seen already (or is older than the window)."""

    reason = "replayed"


@dataclass(frozen=True, slots=True)
class Notif:
    sender: str  # the sending backend's instance id
    seq: int
    tag: int
    count: int
    mac: str

    def verify(self, key: bytes) -> None:
        """Raise ForgedNotification unless `mac` is the one `key` gives."""
        if not hmac.compare_digest(self.mac, _mac(key, self.sender, self.seq, self.tag, self.count)):
            raise ForgedNotification(f"notification for tag {self.tag} not sealed by the live connection of "
                                     f"{self.sender[:8]}")


def _mac(key: bytes, sender: str, seq: int, tag: int, count: int) -> str:
    return hmac.new(key, f"notif {sender} {seq} {tag} {count}".encode(), hashlib.sha256).hexdigest()[:32]


def notif_text(sender: str, seq: int, tag: int, count: int, key: bytes) -> str:
    """`sender`: our instance id; `seq`: this connection's next notification number; `key`: the
    connection's sending notification key (Peer.seal_notification does all three)."""
    if not 0 <= tag < 2**32 or not 0 < count <= MAX_NOTIFY or not 0 <= seq <= MAX_SEQ:
        raise TransferError(f"notification for tag {tag}, {count} writes: outside 0..2^32-1, 1..{MAX_NOTIFY}")
    return f"{NOTIF_PREFIX}{sender} {seq} {tag} {count} {_mac(key, sender, seq, tag, count)}"


def parse_notif(msg: object) -> Notif | None:
    """The fields of one of our notifications, not yet authenticated; None for a message that is
    not ours (another prefix). Anything else raises RejectedNotification, and nothing else is
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
        raise RejectedNotification(f"notification {text[:64]!r} is not 'sgd3 <sender> <seq> <tag> <count> <mac>'")
    seq, tag, count = int(m[2]), int(m[3]), int(m[4])
    if seq > MAX_SEQ or tag >= 2**32 or count > MAX_NOTIFY:
        raise RejectedNotification(f"notification {text[:64]!r}: sequence, tag or count out of range")
    return Notif(m[1], seq, tag, count, m[5])


class ReplayWindow:
    """Which sequence numbers of one sender were seen: the highest, and a bitmap of the `width`
    below it. Notifications may arrive out of order (several transfers in flight), so any unseen
    number inside the window is taken; a seen one, or one older than the window, is a replay.
    Memory: `width` bits, whatever the sender sends."""

    def __init__(self, width: int = 1 << 16) -> None:
        self._width, self._top, self._seen = width, -1, 0
        self._lock = threading.Lock()

    def take(self, seq: int) -> bool:
        """True the first time `seq` is offered (inside the window), False ever after."""
        with self._lock:
            if seq > self._top:
                self._seen = ((self._seen << (seq - self._top)) | 1) & ((1 << self._width) - 1) \
                    if seq - self._top < self._width else 1
                self._top = seq
                return True
            back = self._top - seq
            if back >= self._width or self._seen >> back & 1:
                return False
            self._seen |= 1 << back
            return True


class NotifDrops:
    """The notifications a backend dropped, counted by reason, and the log line about them: at
    most one every `every_s` seconds, saying how many it did not log (anyone who reaches the data
    plane can send them as fast as they like). "foreign": not ours (another prefix)."""

    REASONS = ("forged", "malformed", "foreign", "unbound", "replayed")

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


def accept_notification(msg: object, live: Callable[[str], list[Any]], drops: NotifDrops) -> Notif | None:
    """`msg`, one batch notification as NIXL or Mooncake delivered it, if it is to be credited: one
    of ours, sealed by a live control connection of the peer it names (`live(sender)`: that peer's
    connections here) and never seen on it before (the connection takes it: its replay window).
    Else None, the drop counted in `drops` by reason; nothing is raised and no peer is blamed."""
    try:
        got = parse_notif(msg)
        if got is None:
            drops.drop("foreign", "not one of ours")
            return None
        senders = live(got.sender)
        if not senders:
            raise UnboundNotification(f"notification for tag {got.tag} from {got.sender[:8]}, "
                                      "which has no live connection here")
        # Several only while a re-link overlaps the old link: the one whose key seals it decides.
        sealer = next((p for p in senders if p.sealed(got)), None)
        if sealer is None:
            raise ForgedNotification(f"notification for tag {got.tag} not sealed by a live connection of "
                                     f"{got.sender[:8]}")
        sealer.take_notification(got)
    except RejectedNotification as e:
        drops.drop(e.reason, e)
        return None
    return got
