"""CPU time of every thread of a process tree over a window, by OS thread name.

Read from /proc/<pid>/task/<tid>/stat (utime + stime, in clock ticks): what the kernel
charged each thread, whatever it runs (Python, a library's C thread). Our threads carry
sglang_disagg.threads.PREFIX in their names; SGLang's scheduler is the main thread of a
process whose title starts with "sglang::schedul".
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass

from sglang_disagg.threads import PREFIX

HZ = os.sysconf("SC_CLK_TCK")
SCHEDULER = "sglang::schedul"


@dataclass(frozen=True)
class ThreadCPU:
    pid: int
    tid: int
    process: str  # the process's comm
    name: str     # the thread's comm
    percent: float  # of one core, over the window

    @property
    def ours(self) -> bool:
        return self.name.startswith(PREFIX)

    @property
    def scheduler(self) -> bool:
        return self.tid == self.pid and self.process.startswith(SCHEDULER)


def tree(root: int) -> list[int]:
    """`root` and all its descendants."""
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    kids[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids[p]
    return out


def _comm(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def sample(pids: list[int]) -> dict[tuple[int, int], tuple[str, str, int]]:
    """(pid, tid) -> (process comm, thread comm, ticks used so far)."""
    out = {}
    for pid in pids:
        try:
            process = _comm(f"/proc/{pid}/comm")
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tids:
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            out[(pid, int(t))] = (process, name, int(fields[11]) + int(fields[12]))
    return out


def between(before: dict, after: dict, window: float) -> list[ThreadCPU]:
    """Every thread of `after` with the share of a core it used since `before` (a thread born
    in between counts all its ticks)."""
    return [ThreadCPU(pid, tid, process, name, 100.0 * (ticks - before.get((pid, tid), ("", "", 0))[2]) / HZ / window)
            for (pid, tid), (process, name, ticks) in after.items()]


def measure(root: int, seconds: float) -> list[ThreadCPU]:
    """Every thread of `root`'s tree, with the share of a core it used over `seconds`."""
    pids = tree(root)
    before = sample(pids)
    t0 = time.monotonic()
    time.sleep(seconds)
    after = sample(pids)
    return between(before, after, time.monotonic() - t0)


def by_name(threads: list[ThreadCPU]) -> dict[str, float]:
    """Percent of a core per thread name (threads of one name summed), largest first."""
    agg: collections.Counter[str] = collections.Counter()
    for t in threads:
        agg[t.name] += t.percent
    return dict(agg.most_common())
