"""The on-disk format of ``patches/``: the ``UPSTREAM`` pin and the ``series`` file.

Both are small text files edited by people and by the tool:

* ``UPSTREAM``: ``key=value`` lines (``package``, ``version``, ``archive``, ``sha256``);
  the pinned upstream is the PyPI wheel of SGLang, exactly what gets installed.
* ``series``: patch file names in apply order; ``#`` comments and blank lines allowed.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from sglang_disagg.patchtool.errors import PatchError

UPSTREAM_FILE = "UPSTREAM"
SERIES_FILE = "series"
_UPSTREAM_KEYS = ("package", "version", "archive", "sha256")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

SERIES_HEADER = (
    "# SGLang patch series, in apply order (one file name per line).\n"
    "# Maintained by `python -m sglang_disagg.patchtool export`; see patches/README.md.\n"
)


@dataclass(frozen=True)
class Upstream:
    """The pinned upstream release: one wheel file identified by name and sha256."""

    package: str
    version: str
    archive: str
    sha256: str

    @classmethod
    def load(cls, path: Path) -> Upstream:
        if not path.is_file():
            raise PatchError(f"{path}: missing (the pinned upstream release)")
        values: dict[str, str] = {}
        for lineno, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise PatchError(f"{path}:{lineno}: expected key=value, got {raw!r}")
            values[key.strip()] = value.strip()
        missing = [k for k in _UPSTREAM_KEYS if not values.get(k)]
        if missing:
            raise PatchError(f"{path}: missing keys: {', '.join(missing)}")
        up = cls(**{k: values[k] for k in _UPSTREAM_KEYS})
        if not _SHA256_RE.match(up.sha256):
            raise PatchError(f"{path}: sha256 must be 64 lowercase hex digits")
        return up

    def dump(self) -> str:
        return "".join(f"{k}={getattr(self, k)}\n" for k in _UPSTREAM_KEYS)

    def save(self, path: Path) -> None:
        path.write_text(self.dump())


@dataclass(frozen=True)
class Series:
    """Patch file names in apply order, plus the leading comment block (kept on export)."""

    names: tuple[str, ...]
    header: str = SERIES_HEADER

    @classmethod
    def parse(cls, text: str, where: str = "series") -> Series:
        names: list[str] = []
        header_lines: list[str] = []
        in_header = True
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if in_header and line.startswith("#"):
                header_lines.append(raw + "\n")
                continue
            in_header = False
            if not line or line.startswith("#"):
                continue
            if "/" in line or not line.endswith(".patch"):
                raise PatchError(f"{where}:{lineno}: expected a *.patch file name, got {raw!r}")
            names.append(line)
        return cls(tuple(names), "".join(header_lines) or SERIES_HEADER)

    @classmethod
    def load(cls, path: Path) -> Series:
        if not path.is_file():
            raise PatchError(f"{path}: missing (the patch series order file)")
        return cls.parse(path.read_text(), str(path))

    def dump(self) -> str:
        return self.header + "".join(f"{n}\n" for n in self.names)

    def duplicates(self) -> list[str]:
        return sorted(n for n, count in Counter(self.names).items() if count > 1)


@dataclass(frozen=True)
class PatchDir:
    """A ``patches/`` directory: the pin, the series and the patch files."""

    root: Path

    @property
    def upstream_path(self) -> Path:
        return self.root / UPSTREAM_FILE

    @property
    def series_path(self) -> Path:
        return self.root / SERIES_FILE

    def upstream(self) -> Upstream:
        return Upstream.load(self.upstream_path)

    def series(self) -> Series:
        return Series.load(self.series_path)

    def patch_paths(self) -> list[Path]:
        """The series' patch files, in order; raises if the series is inconsistent."""
        series = self.series()
        problems = self.problems(series)
        if problems:
            raise PatchError("inconsistent patch series:\n  " + "\n  ".join(problems))
        return [self.root / n for n in series.names]

    def problems(self, series: Series) -> list[str]:
        out = [f"duplicate in series: {n}" for n in series.duplicates()]
        out += [f"listed in series but missing: {n}" for n in series.names if not (self.root / n).is_file()]
        listed = set(series.names)
        out += [
            f"not listed in series: {p.name}" for p in sorted(self.root.glob("*.patch")) if p.name not in listed
        ]
        return out

    def digest(self) -> str:
        """sha256 over the pin and the series' patch contents: identifies what gets applied."""
        h = hashlib.sha256(self.upstream().dump().encode())
        for path in self.patch_paths():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return h.hexdigest()


_DIFF_GIT_RE = re.compile(r"^diff --git (.*)$")


def _unquote(path: str) -> str:
    """Undo git's C-style quoting of unusual file names ("a/x\\ty")."""
    if len(path) >= 2 and path[0] == '"' and path[-1] == '"':
        raw = path[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
        return raw.encode("latin-1").decode("utf-8", "replace")
    return path


def touched_paths(patch_text: str) -> list[str]:
    """Files (relative to site-packages) that a git patch reads or writes."""
    found: list[str] = []

    def add(p: str) -> None:
        p = _unquote(p.rstrip("\t"))
        if p != "/dev/null":
            p = p[2:] if p[:2] in ("a/", "b/") else p
            if p not in found:
                found.append(p)

    for line in patch_text.splitlines():
        if line.startswith(("--- ", "+++ ")):
            add(line[4:])
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            add("a/" + line.split(" ", 2)[2])
        else:
            m = _DIFF_GIT_RE.match(line)
            if m and not m.group(1).startswith('"'):
                rest = m.group(1)
                half = (len(rest) - 1) // 2
                if rest[half] == " " and rest[:half][2:] == rest[half + 1 :][2:]:
                    add(rest[:half])
    return found
