"""TP ranks hand their cuMem KV allocations to the messenger leader, over SCM_RIGHTS.

One messenger per server drives every rank's KV from rank 0 (messenger/node.py). On GPU
each rank's pool is cuMem memory (cumem.py); the leader needs the allocations' file
descriptors. The exchange, around the one gather the ranks already do:

    leader:  inbox = Inbox()                  listens on an abstract Unix socket
    all:     gather(inbox.address | exports)  the leader's (pid, name); each rank's Exports
    rank r:  give(address, r, exports)        connects, checks the listener is the leader's
                                              pid, sends "cumem-handover" messages with
                                              the allocations' fds attached
    leader:  inbox.collect(exports_by_rank)   accepts, checks each sender is the pid its
                                              Exports name (SO_PEERCRED) and that it sent
                                              exactly the allocations they name

A rank sends into the leader's listen backlog and returns at once: the kernel holds the
descriptors in flight, so neither side waits on the other beyond the gather. Body:
``{"rank": r, "items": [{"key", "size", "device"}, ...]}``, items[i] describing fds[i];
several messages when a rank has more than fdpass.MAX_FDS allocations.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from . import cumem, fdpass

KIND = "cumem-handover"


class HandoverError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Address:
    pid: int
    name: str


def _allocations(exports: Sequence[cumem.Export]) -> dict[int, tuple[int, int]]:
    """key -> (size, device) of the distinct allocations behind `exports`."""
    out: dict[int, tuple[int, int]] = {}
    for e in exports:
        if out.setdefault(e.key, (e.size, e.device)) != (e.size, e.device):
            raise HandoverError(f"allocation {e.key} is exported with two sizes or devices")
    return out


def give(address: Address, rank: int, exports: Sequence[cumem.Export], timeout_s: float = 30.0) -> None:
    """Rank side: send the descriptors of every allocation behind `exports` to the leader."""
    allocs = sorted(_allocations(exports).items())
    with fdpass.connect(address.name, timeout_s) as conn:
        conn.expect_peer(address.pid, f"rank {rank} handing its KV to the leader")
        for i in range(0, len(allocs), fdpass.MAX_FDS):
            chunk = allocs[i:i + fdpass.MAX_FDS]
            items = [{"key": k, "size": size, "device": dev} for k, (size, dev) in chunk]
            conn.send(KIND, {"rank": rank, "items": items}, [cumem.fd(k) for k, _ in chunk])


class Inbox:
    """Leader side: where the ranks' descriptors arrive."""

    def __init__(self) -> None:
        self._listener = fdpass.Listener("kv-handover")
        self.address = Address(os.getpid(), self._listener.name)

    def collect(self, exports: dict[int, Sequence[cumem.Export]], timeout_s: float = 30.0) -> dict[int, dict[int, int]]:
        """rank -> allocation key -> its descriptor (owned by the caller), for every rank in
        `exports`. On any error every descriptor received is closed."""
        want = {r: _allocations(ex) for r, ex in exports.items() if ex}
        pids = {r: ex[0].pid for r, ex in exports.items() if ex}
        got: dict[int, dict[int, int]] = {r: {} for r in want}
        deadline = time.monotonic() + timeout_s
        try:
            for _ in range(len(want)):
                conn = self._listener.accept(deadline - time.monotonic())
                with conn:
                    self._take(conn, want, pids, got, deadline)
            missing = {r: sorted(set(w) - set(got[r])) for r, w in want.items() if set(w) - set(got[r])}
            if missing:
                raise HandoverError(f"ranks did not hand over allocations {missing}")
        except BaseException:
            for fds in got.values():
                for f in fds.values():
                    os.close(f)
            raise
        return got

    def close(self) -> None:
        self._listener.close()

    def _take(self, conn: fdpass.Conn, want: dict, pids: dict, got: dict, deadline: float) -> None:
        rank = None
        while rank is None or set(got[rank]) != set(want[rank]):
            msg = conn.recv(deadline - time.monotonic())
            try:
                r = msg.body.get("rank")
                r = r if isinstance(r, int) else None
                items = msg.body.get("items")
                if (msg.kind != KIND or r not in want or (rank is not None and r != rank) or not isinstance(items, list)
                        or len(items) != len(msg.fds)):
                    raise HandoverError(f"unexpected {msg.kind!r} message for rank {r!r} (expecting ranks "
                                        f"{sorted(want)})")
                conn.expect_peer(pids[r], f"KV handover from rank {r}")
                if rank is None and got[r]:
                    raise HandoverError(f"rank {r} connected twice")
                rank = r
                seen = set(got[r])
                for item in items:
                    key = item.get("key") if isinstance(item, dict) else None
                    if (not isinstance(key, int) or key not in want[r] or key in seen
                            or (item.get("size"), item.get("device")) != want[r][key]):
                        raise HandoverError(f"rank {r} sent allocation {item!r:.100}, which its exports do not "
                                            f"name (or twice)")
                    seen.add(key)
            except BaseException:
                msg.close_fds()
                raise
            for item, f in zip(items, msg.fds):
                got[r][item["key"]] = f
