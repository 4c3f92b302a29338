"""messenger/migration/lockstep.py in isolation (the e2e proof is tests/e2e/test_migration_tp.py):
two ranks' schedulers, stand-ins holding a running batch and a waiting queue, apply the
leader's cut and settlings and end in the same state; the leader of one rank applies at once,
of two queues for the broadcast. `release` is recorded, not SGLang's."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sglang_disagg.messenger.migration import lockstep
from sglang_disagg.messenger.migration.lockstep import Lockstep, MigrationCut, MigrationSettled, Outcome


@dataclass(eq=False)
class Req:
    rid: str
    done: bool = False
    retracted: int = 0

    def finished(self) -> bool:
        return self.done

    def reset_for_retract(self) -> None:
        self.retracted += 1


@dataclass(eq=False)
class Batch:
    reqs: list
    batch_is_full: bool = True

    def filter_batch(self, keep_indices):
        self.reqs = [self.reqs[i] for i in keep_indices]


@dataclass(eq=False)
class Sched:
    running_batch: Batch
    waiting_queue: list = field(default_factory=list)
    released: list = field(default_factory=list)


def _rank(rids, done=()) -> Sched:
    return Sched(Batch([Req(r, done=r in done) for r in rids]))


@pytest.fixture(autouse=True)
def recorded(monkeypatch):
    monkeypatch.setattr(lockstep, "release", lambda sched, req, checkpoint=False:
                        sched.released.append((req.rid, checkpoint)))


def _state(s: Sched):
    return ([r.rid for r in s.running_batch.reqs], [r.rid for r in s.waiting_queue], s.released)


def test_two_ranks_applying_the_leaders_inputs_end_alike():
    ranks = [_rank(["a", "b", "c", "d"], done={"d"}) for _ in range(2)]
    cut_seen = []
    leader = Lockstep(ranks[0], 2, on_cut=lambda item, reqs: cut_seen.append([r.rid for r in reqs]))
    other = Lockstep(ranks[1], 2)
    leader.send(MigrationCut(("b", "c", "d", "gone")))  # d finished, "gone" left: cut on no rank
    assert _state(ranks[0])[0] == ["a", "b", "c", "d"], "two ranks: nothing changes before the broadcast"
    items = leader.inputs()
    assert leader.inputs() == [], "each input is broadcast once"
    for item in items:
        leader.apply(item)
        other.apply(item)
    assert cut_seen == [["b", "c"]]
    assert not ranks[0].running_batch.batch_is_full
    for item in (MigrationSettled("b", Outcome.BACK), MigrationSettled("c", Outcome.HANDED),
                 MigrationSettled("b", Outcome.HANDED)):  # b settled already: nothing more
        leader.apply(item)
        other.apply(item)
    assert _state(ranks[0]) == _state(ranks[1]) == (["a", "d"], ["b"], [("b", True), ("c", False)])
    assert ranks[0].waiting_queue[0].retracted == 1
    assert not leader.holding() and not other.holding()


def test_one_rank_applies_at_once_and_a_request_gone_in_flight_is_not_freed_again():
    s = _rank(["a", "b"])
    lock = Lockstep(s, 1)
    lock.send(MigrationCut(("a", "b")))
    assert lock.inputs() == [] and _state(s)[0] == [] and lock.holding()
    lock.send(MigrationSettled("a", Outcome.GONE))   # SGLang finished and freed it in the batch in flight
    lock.send(MigrationSettled("b", Outcome.ENDED))  # the client left before the hand-over
    assert _state(s) == ([], [], [("b", False)]) and not lock.holding()
