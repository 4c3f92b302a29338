"""The one writer of benchmark results documents: the command as run, the date, the machine,
every repeat's raw values and notes, beside a script's own figures.

Every DIR/*.json results document a script of benchmarks/ leaves is written here:

    record = results_doc.Run.begin(argv, __file__)     # at the start: the command, the date
    ...measure...
    record.write(out / "x.json", {"model": ..., "rows": rows},
                 raw_repeats=results_doc.group_repeats(runs, ("config",), ("ttft_ms",)),
                 notes=["..."])

The document (a JSON object, `SCHEMA`):
- ``schema``: this layout's number;
- ``command``: the script and its arguments as run, shell-quoted (``python benchmarks/x.py ...``);
- ``date``: when the run started, ISO-8601 UTC (``2026-12-06T09:45:00Z``);
- ``machine``: CPU model, cores (and those this process may use), memory GiB, kernel, platform,
  Python, torch and SGLang versions, host name, load average at the start (other work on a
  shared machine moves every figure); ``cpus`` and ``platform`` as the documents before had them;
- the script's own keys, unchanged (plots, docs and tests read them);
- ``raw_repeats``: every repeat's raw values where the figures above are medians of repeats: a
  list of records, each the fields that name a series and, per metric, one value per repeat in
  run order; null where every figure is one measurement (nothing was aggregated over repeats);
- ``notes``: what a reader needs to interpret the figures (a list of sentences, maybe empty).
The writer owns ``schema``, ``command``, ``date``, ``machine``, ``raw_repeats`` and ``notes``: a
script's body may not carry them (so no script keeps writing its own, differently).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = 1
ROOT = Path(__file__).resolve().parent.parent
OWNED = ("schema", "command", "date", "machine", "raw_repeats", "notes")


def _cpu_model() -> str:
    # /proc/cpuinfo names the model on x86 and most arm64 kernels; platform.processor() is
    # often empty or just the architecture on Linux, hence only the fallback.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model", "Processor") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 2)  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 2)
    except (ValueError, OSError, AttributeError):
        return None


def _version(dist: str) -> str | None:
    # The installed distribution's metadata: importing torch to ask would cost seconds.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Machine:
    """Where a run ran, read once at its start."""

    cpu_model: str
    cores: int                    # logical CPUs of the machine
    cores_usable: int             # those this process may run on (affinity, cgroup cpusets)
    memory_gib: float | None
    kernel: str
    platform: str
    python: str
    torch: str | None
    sglang: str | None
    host: str
    load_average_at_start: tuple[float, float, float]

    @classmethod
    def here(cls) -> Machine:
        cores = os.cpu_count() or 0
        try:
            usable = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            usable = cores
        try:
            load = tuple(round(x, 2) for x in os.getloadavg())
        except OSError:
            load = (0.0, 0.0, 0.0)
        return cls(cpu_model=_cpu_model(), cores=cores, cores_usable=usable, memory_gib=_memory_gib(),
                   kernel=platform.release(), platform=platform.platform(), python=platform.python_version(),
                   torch=_version("torch"), sglang=_version("sglang"), host=platform.node(),
                   load_average_at_start=load)

    def to_dict(self) -> dict:
        # "cpus": the key every document before this writer had (docs quote it).
        return {"cpus": self.cores, **dataclasses.asdict(self)}


def command_line(args: Sequence[str] | None = None, script: str | os.PathLike | None = None) -> str:
    """The command that ran: ``python`` + the script (relative to the repository when inside
    it, so that documents of different checkouts compare) + its arguments, shell-quoted so it
    can be pasted back into a shell."""
    script = Path(script if script is not None else sys.argv[0])
    args = list(sys.argv[1:] if args is None else args)
    try:
        shown = script.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        shown = str(script)
    return shlex.join(["python", shown, *map(str, args)])


def iso_utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass(frozen=True)
class Run:
    """One run of a benchmark script: what it was asked (command), when it started, where."""

    command: str
    started: float                # time.time() at the start
    machine: Machine

    @classmethod
    def begin(cls, args: Sequence[str] | None = None, script: str | os.PathLike | None = None) -> Run:
        """Call at the script's start: the date is the run's start, the load average the one
        the run met, not what is left once it is over."""
        return cls(command_line(args, script), time.time(), Machine.here())

    @property
    def date(self) -> str:
        return iso_utc(self.started)

    def document(self, body: Mapping[str, Any], *, raw_repeats: list[dict] | None = None,
                 notes: Iterable[str] = ()) -> dict:
        """The results document: the header, the script's keys in its order, then the raw
        repeats and the notes."""
        clash = sorted(set(body) & set(OWNED))
        if clash:
            raise ValueError(f"the results writer owns {clash}: pass them as arguments, not in the body")
        if isinstance(notes, str):  # one note given bare would become a list of characters
            notes = [notes]
        return {"schema": SCHEMA, "command": self.command, "date": self.date, "machine": self.machine.to_dict(),
                **body, "raw_repeats": raw_repeats, "notes": [str(n) for n in notes]}

    def write(self, path: str | os.PathLike, body: Mapping[str, Any], *, raw_repeats: list[dict] | None = None,
              notes: Iterable[str] = (), indent: int = 1) -> Path:
        """Write the document to `path` (its folder created) and return the path. Writes a
        temporary file then renames it: a script that rewrites its document after every
        configuration never leaves half a document when it is killed midway."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.document(body, raw_repeats=raw_repeats, notes=notes), indent=indent,
                          default=_plain) + "\n"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        return path


def _plain(o: Any) -> Any:
    """What json cannot write by itself: dataclasses (load.py's idle snapshots), paths, sets."""
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def group_repeats(rows: Iterable[Mapping[str, Any]], by: Sequence[str], metrics: Sequence[str]) -> list[dict]:
    """Per distinct value of the `by` fields (in first-seen order), each metric's values over
    the rows of that series in row order (one row per repeat): the raw values behind a median.
    A metric a row lacks is recorded as null, so lists stay aligned with the repeats."""
    out: dict[tuple, dict] = {}
    for row in rows:
        key = tuple(row.get(k) for k in by)
        entry = out.setdefault(key, {**dict(zip(by, key)), **{m: [] for m in metrics}})
        for m in metrics:
            entry[m].append(row.get(m))
    return list(out.values())
