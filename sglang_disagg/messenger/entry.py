"""One request on the decoder, from intake to hand-off, and the leader's pure decisions about
a request that failed or waits to release its pages (no I/O, no scheduler: unit-tested).

Phases: MEMORY (pages allocated on every rank alike) -> ROUTE (the leader picks a prefill
server and a fresh tag) -> TRANSFER (the writes are expected) -> handed to SGLang. A failure
moves a request to RELEASE (pages held until no write can land any more) and, when its
prefill server does not confirm the cancel in CANCEL_TIMEOUT_S, to QUARANTINE.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .links import LinkState
from .metrics import Cause

CANCEL_TIMEOUT_S = 5.0
# An unanswered cancel goes out again this often on the same connection (a prefill server
# answers one for an order it no longer holds at once). Added for a quarantine after a dropped
# control connection, on the theory that the Released went to the old connection; the cause
# proved to be the prefill's writes stuck after that drop (CHANGELOG), which this does not cure.
CANCEL_RESEND_S = 1.0
LOST_VERDICT_S = 1.0  # how long a request lost before any write waits to learn whether its server is gone
# How long, after its prefill server answered, a failed request's pages wait for the writes it
# posted that have not arrived. A connection a partition interrupted delivers them once the
# network heals (seen: 1.8 s after the answer); one that broke never will. Past this the pages
# are freed (logged, counted): a write still on its way after that would land in reused pages.
LATE_WRITES_S = 30.0
# Such a request is looked at this often at most while it waits: each look of a DP group asks its
# owner for the tag's count (a round trip), and a scheduler steps far more often than this.
SETTLE_POLL_S = 0.02


class Phase(enum.Enum):
    MEMORY = "waiting for KV pages"
    ROUTE = "waiting for a prefill server"
    TRANSFER = "waiting for its KV writes"
    RELEASE = "failed; pages held until no write can land"
    QUARANTINE = "cancel unconfirmed; pages out of use until the prefill server answers or is gone"


class Lost(enum.Enum):
    """What a failed TRANSFER request does next (leader's decision)."""

    FAIL = "fail"        # the client gets the error
    WAIT = "wait"        # lost before any write landed: is its server gone (re-route) or alive (fail)?
    REROUTE = "reroute"  # its server is gone and nothing of it landed: ask another one


class Release(enum.IntEnum):
    """The leader's word on a failed request's pages (summed across ranks, so ints)."""

    UNDECIDED = 0
    FREE = 1        # no write can land any more
    QUARANTINE = 2  # a live connection may still carry writes


class Settle(enum.Enum):
    """A failed request its prefill server answered: may its pages go?"""

    WAIT = "wait"        # writes it posted may still land
    FREE = "free"        # every write it posted arrived (or it could not say how many)
    GIVE_UP = "give up"  # some never came within LATE_WRITES_S


class Cancel(enum.Enum):
    """What the leader does for a RELEASE/QUARANTINE request this iteration."""

    NOTHING = "nothing"
    SEND = "send"    # (re)send the cancel on the link's current connection


@dataclass(slots=True, eq=False)
class Entry:
    seq: int
    req: Any
    n_tokens: int                 # prompt tokens whose KV comes from prefill (all but the last)
    phase: Phase
    since: float
    pages: tuple[int, ...] = ()
    start_page: int = 0           # pages before it were already in this decoder's radix tree
    tag: int = -1
    link: str = ""
    expected: int = 0             # writes this rank counts
    writes: int = 0               # writes the whole request takes (all ranks)
    routed: bool = False          # leader: a Route for it is on its way
    landed: bool = False          # this rank: every expected write arrived
    failed: str = ""              # this rank: why it failed
    cause: Cause | None = None    # ... as a metric label
    bytes: int = 0                # bytes the whole request's writes move
    release: Release = Release.UNDECIDED  # leader's decision
    cancel_sent: float = 0.0
    cancel_peer: Any = None       # leader: the connection the cancel went out on (resent after a reconnect)
    cancel_last: float = 0.0      # leader: when the cancel last went out
    first_landed: bool = False    # leader: at least one write of the current tag arrived
    lost: float = 0.0             # leader: when its prefill server's connection was lost (0: it was not)
    route_peer: Any = None        # leader: the link's connection when the order went out
    rerouted: bool = False        # it was re-routed once already
    answered: float = 0.0         # leader: when its prefill server said Released/OrderFailed (0: not yet)
    posted: int | None = None     # leader: writes that server posted with the tag (None: it did not know)
    settle_looked: float = 0.0    # leader: when its late writes were last counted (settle_due)
    source: Any = None            # migration/room.Source: a request migrating here, its KV from that decoder
    times: dict = field(default_factory=dict)  # monotonic timestamps of the lifecycle


def lost_verdict(e: Entry, links: dict[str, Any], now: float) -> Lost:
    """Leader, for a failed TRANSFER request: fail it, or re-route it once when its prefill
    server is gone before any write landed and another one is ready."""
    if not e.lost or e.first_landed or e.rerouted or e.cause is not Cause.TRANSFER:
        return Lost.FAIL
    link = links[e.link]
    if link.state is LinkState.GONE:
        others = any(x.alive() for a, x in links.items() if a != e.link)
        return Lost.REROUTE if others else Lost.FAIL
    # The loss may reach the expectation (through the server's other connection) before
    # the link's own connection: only a link on a NEW connection proves the server lives.
    reconnected = link.alive() and link.peer is not e.route_peer
    if reconnected or now - e.lost > LOST_VERDICT_S:
        return Lost.FAIL  # the server lives and may still write, or no verdict in time
    return Lost.WAIT


def settle(e: Entry, landed: int, now: float, gone: bool = False) -> Settle:
    """Leader, for a failed request whose prefill server answered: `landed` is what the backend
    counted of its (retired) tag, -1 when it no longer knows the tag. The first write, taken by
    the first expectation when it fired, is not in that count. `gone`: that server's process is
    known gone since (its link is GONE): what it did not deliver never will be."""
    if gone or e.posted is None or landed < 0:
        return Settle.FREE
    if landed + int(e.first_landed) >= min(e.posted, e.writes):
        return Settle.FREE
    return Settle.GIVE_UP if now - e.answered > LATE_WRITES_S else Settle.WAIT


def settle_due(e: Entry, now: float) -> bool:
    """Leader: whether to count a waiting failed request's late writes now (SETTLE_POLL_S)."""
    if now - e.settle_looked < SETTLE_POLL_S:
        return False
    e.settle_looked = now
    return True


def release_step(e: Entry, link: Any, now: float) -> Cancel:
    """Leader, for a RELEASE/QUARANTINE request not decided yet: decide (sets e.release) or
    say that the cancel must go out on the link's current connection."""
    if link is None or link.state is LinkState.GONE:
        e.release = Release.FREE  # never asked, or its process is gone: no write can land any more
    elif e.phase is Phase.RELEASE and e.cancel_sent and now - e.cancel_sent > CANCEL_TIMEOUT_S:
        e.release = Release.QUARANTINE
    elif link.alive() and (e.cancel_peer is not link.peer  # first cancel, or the link came back
                           or e.phase is Phase.RELEASE and now - e.cancel_last >= CANCEL_RESEND_S):
        e.cancel_sent, e.cancel_peer, e.cancel_last = e.cancel_sent or now, link.peer, now
        return Cancel.SEND
    elif e.phase is Phase.RELEASE and now - (e.cancel_sent or e.since) > CANCEL_TIMEOUT_S:
        e.release = Release.QUARANTINE
    return Cancel.NOTHING
