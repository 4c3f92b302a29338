"""CPU time of every thread of a process tree over a window, by OS thread name.

Read from /proc/<pid>/task/<tid>/schedstat (time on a CPU, in nanoseconds; /stat's utime +
stime in clock ticks where the kernel keeps no schedstat): what the kernel charged each thread,
whatever it runs (Python, a library's C thread). Nanoseconds let a short window judge "under
1 % of a core": at 100 ticks a second, 1 % of a 2 s window would be two ticks. Our threads carry
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


def _cpu_s(task: str, stat_fields: list[str]) -> float:
    """Seconds on a CPU so far: schedstat's nanoseconds, else /stat's ticks."""
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return (int(stat_fields[11]) + int(stat_fields[12])) / HZ


def sample(pids: list[int]) -> dict[tuple[int, int], tuple[str, str, float]]:
    """(pid, tid) -> (process comm, thread comm, CPU seconds used so far)."""
    out = {}
    for pid in pids:
        try:
            process = _comm(f"/proc/{pid}/comm")
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tids:
            task = f"/proc/{pid}/task/{t}"
            try:
                with open(f"{task}/stat") as f:
                    stat = f.read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                out[(pid, int(t))] = (process, name, _cpu_s(task, stat.rsplit(")", 1)[1].split()))
            except (OSError, ValueError):
                continue
    return out


def between(before: dict, after: dict, window: float) -> list[ThreadCPU]:
    """Every thread of `after` with the share of a core it used since `before` (a thread born
    in between counts all its time)."""
    return [ThreadCPU(pid, tid, process, name, 100.0 * (used - before.get((pid, tid), ("", "", 0.0))[2]) / window)
            for (pid, tid), (process, name, used) in after.items()]


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
