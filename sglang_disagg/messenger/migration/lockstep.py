"""Every TP rank of decoder A cuts and settles the same migrating requests in the same
scheduler iteration.

SGLang keeps a server's TP ranks in lockstep (ranks.py): each holds the same batch and the
same page ids, and each rank's pages hold its own heads. A migration changes that state
twice: the cut (the request leaves the running batch, its pages kept) and the settling (the
pages go after the hand-over, or the request re-enters the waiting queue when the migration
failed). Only the leader decides either (it holds the relay, B's order, every rank's
registered regions and so every write: migration/targets.py), so its decisions travel as
inputs of SGLang's request broadcast (inputs.py) and every rank applies them alike, the
leader included. With one rank there is nothing to broadcast: the leader applies them at
once (as decode.py routes at once).

Scheduler-side contract (DecodeMessenger, every rank): ``apply(item)`` for a MigrationCut or
MigrationSettled as the broadcast delivers it; a cut calls ``on_cut(item, reqs)`` with the
requests it took out (the leader's Outgoing follows them). The leader's ``send(item)`` applies
at once (one rank) or queues for ``inputs()`` (its next broadcast).

Between its cut and its settling a request is in no batch and no queue on any rank: here,
keyed by rid (bounded by what the leader cuts: MAX_HELD).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

from ..inputs import MessengerInput
from ..requests import release


class Outcome(enum.Enum):
    HANDED = "handed"  # every write completed: the pages go, the request lives on B now
    BACK = "back"      # the migration failed: the request continues here (waiting queue, tree kept)
    ENDED = "ended"    # the client left before the hand-over: the pages go, the request ends
    GONE = "gone"      # it finished in the batch in flight at the cut: SGLang already freed it


@dataclass(frozen=True, slots=True)
class MigrationCut(MessengerInput):
    """These running requests leave the batch now (their pages are kept)."""

    rids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MigrationSettled(MessengerInput):
    rid: str
    outcome: Outcome


class Lockstep:
    def __init__(self, sched: Any, size: int, on_cut: Callable[[MigrationCut, list[Any]], None] | None = None) -> None:
        self.sched, self.size, self.on_cut = sched, size, on_cut
        self.cut: dict[str, Any] = {}
        self._queued: list[MessengerInput] = []

    # ----- leader -----------------------------------------------------------------------
    def send(self, item: MigrationCut | MigrationSettled) -> None:
        if self.size == 1:
            self.apply(item)
        else:
            self._queued.append(item)

    def inputs(self) -> list[MessengerInput]:
        out, self._queued = self._queued, []
        return out

    # ----- every rank -------------------------------------------------------------------
    def apply(self, item: MigrationCut | MigrationSettled) -> None:
        if isinstance(item, MigrationCut):
            self._cut(item)
        else:
            self._settle(item)

    def _cut(self, item: MigrationCut) -> None:
        batch = self.sched.running_batch
        wanted = set(item.rids)
        # Each rank finds the same requests: the batches are alike (one that finished or was
        # retracted since the leader decided is missing on every rank alike).
        reqs = [r for r in batch.reqs if r.rid in wanted and not r.finished()]
        if reqs:
            leaving = {id(r) for r in reqs}
            batch.filter_batch(keep_indices=[i for i, r in enumerate(batch.reqs) if id(r) not in leaving])
            batch.batch_is_full = False
            for r in reqs:
                self.cut[r.rid] = r
        if self.on_cut is not None:
            self.on_cut(item, reqs)

    def _settle(self, item: MigrationSettled) -> None:
        req = self.cut.pop(item.rid, None)
        if req is None or item.outcome is Outcome.GONE:
            return
        if item.outcome is Outcome.BACK:
            # Through SGLang's retraction path: the radix tree keeps its KV, so re-running it
            # here (prompt + outputs match the tree) recomputes little.
            release(self.sched, req, checkpoint=True)
            req.reset_for_retract()
            self.sched.waiting_queue.append(req)
        else:
            release(self.sched, req)

    def holding(self) -> bool:
        return bool(self.cut)
