"""What the leader injects into SGLang's request broadcast so every TP rank applies the
same messenger decision in the same scheduler iteration (see ranks.py).

They reach each rank's messenger through the scheduler's request dispatcher (registered
for ``MessengerInput`` and its subclasses), in the order the leader injected them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .wire import Hello, PrefillOrder


@dataclass(frozen=True, slots=True)
class MessengerInput:
    pass


# Prefill side ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DecoderKey:
    """Which decoder an order is for: the decoder leader's backend instance id (the peer it
    says Hello from) and its DP group whose pool the Hello described (0 without DP; each
    group of a DP decoder says Hello on a connection of its own)."""

    instance: str
    group: int = 0

    def __str__(self) -> str:  # for logs: enough of the instance to tell decoders apart
        return f"{self.instance[:12]}/{self.group}"


@dataclass(frozen=True, slots=True)
class DecoderJoined(MessengerInput):
    """A decoder passed first contact: every rank learns its ranks and regions."""

    key: DecoderKey
    hello: Hello


@dataclass(frozen=True, slots=True)
class DecoderLeft(MessengerInput):
    """A decoder's control connection was lost (or replaced by a later Hello on it), its
    orders' cancels already out: every rank forgets its link (decoderlinks.py)."""

    key: DecoderKey


@dataclass(frozen=True, slots=True)
class OrderTicket(MessengerInput):
    key: DecoderKey
    order: PrefillOrder


@dataclass(frozen=True, slots=True)
class CancelTicket(MessengerInput):
    key: DecoderKey | None  # None: from a connection that said no Hello (nothing of it is open)
    tag: int


# Decode side -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Route(MessengerInput):
    """Send admitted request `seq` to prefill server `link` with immediate `tag`; or, with
    `error`, fail it (no prefill server can take it)."""

    seq: int
    tag: int
    link: str
    prefill_tp: int
    prefill_instances: tuple[str, ...]
    error: str = ""
