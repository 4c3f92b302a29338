"""Workspaces: throw-away git repositories of pristine SGLang with the series as commits.

Layout: the repository root holds the wheel's ``sglang/`` directory (no ``*.dist-info``), so
patch paths read ``a/sglang/srt/...`` like paths relative to site-packages. The first commit,
``Upstream sglang X``, has a fixed author/date (same hash for everyone) and is tagged
``upstream``; every commit after it is one patch. Export turns those commits back into
``git format-patch`` files, deterministically.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sglang_disagg.patchtool import repos
from sglang_disagg.patchtool.errors import PatchError
from sglang_disagg.patchtool.gitutil import git, git_text
from sglang_disagg.patchtool.model import Series, Upstream
from sglang_disagg.patchtool.repos import CONFIG_KEYS, UPSTREAM_TAG
from sglang_disagg.patchtool.scratch import series_paths

FORMAT_PATCH_ARGS = (
    "format-patch", "--zero-commit", "--no-signature", "--no-numbered", "--keep-subject",
    "--no-cover-letter", "--no-thread", "--no-attach", "--stat=80", "--abbrev=12", "-M",
    "--encoding=UTF-8", "--filename-max-length=64",
)


@dataclass(frozen=True)
class Exported:
    """What export writes: patch file name -> bytes, in series order."""

    patches: tuple[tuple[str, bytes], ...]
    warnings: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.patches)


def am(ws: Path, patches: list[Path], *, quiet: bool = True) -> subprocess.CompletedProcess[bytes] | None:
    """``git am -3`` the patch files (authors, dates, subjects and bodies kept verbatim)."""
    if not patches:
        return None
    args = ["am", "-3", "--keep", "--keep-cr", "--committer-date-is-author-date"] + (["--quiet"] if quiet else [])
    return git([*args, *[str(p.resolve()) for p in patches]], ws, check=False)


def am_failure(ws: Path, proc: subprocess.CompletedProcess[bytes]) -> str:
    """Describe a stopped ``git am``: the patch and the files in conflict."""
    stopped = ws / ".git" / "rebase-apply"
    patch_subject = ""
    if (stopped / "final-commit").is_file():
        patch_subject = (stopped / "final-commit").read_text().splitlines()[0]
    files = git_text(["diff", "--name-only", "--diff-filter=U"], ws, check=False)
    out = proc.stdout + proc.stderr
    lines = [f"patch '{patch_subject}' does not apply" if patch_subject else "git am stopped"]
    if files:
        lines.append("conflicting files:\n    " + "\n    ".join(files.splitlines()))
    lines.append("git am said:\n    " + "\n    ".join(out.decode(errors="replace").strip().splitlines()[-15:]))
    return "\n".join(lines)


def create(ws: Path, up: Upstream, patches: list[Path], *, sparse: bool = False) -> None:
    """A workspace for ``up`` with ``patches`` applied as commits; raises if one does not apply.

    ``sparse``: only the files the patches touch (enough to re-export them; much faster).
    """
    if sparse:
        repos.sparse_base(ws, up, series_paths(patches))
    else:
        repos.full_base(ws, up)
    proc = am(ws, patches)
    if proc is not None and proc.returncode != 0:
        hint = "" if sparse else f"; workspace left at {ws} (resolve, `git am --continue`, then export --from it)"
        raise PatchError(f"{am_failure(ws, proc)}\nthe committed series does not apply to "
                         f"{up.package} {up.version}{hint}")


def workspace_upstream(ws: Path) -> Upstream:
    if not (ws / ".git").is_dir():
        raise PatchError(f"{ws}: not a workspace (no .git)")
    values = {k: git_text(["config", "--get", f"sglang-disagg.{k}"], ws, check=False) for k in CONFIG_KEYS}
    if not all(values.values()):
        raise PatchError(f"{ws}: not a workspace made by `python -m sglang_disagg.patchtool workspace`")
    return Upstream(**values)


_NUMBER_PREFIX = re.compile(r"^\d{4}-")


def export(ws: Path) -> Exported:
    """The commits after ``upstream`` as deterministic ``git format-patch`` files."""
    if (ws / ".git" / "rebase-apply").exists() or (ws / ".git" / "rebase-merge").exists():
        raise PatchError(f"{ws}: a git am/rebase is in progress; finish it (git am --continue) first")
    dirty = git_text(["status", "--porcelain", "--untracked-files=no"], ws)
    if dirty:
        raise PatchError(f"{ws}: uncommitted changes; commit (or amend) them first:\n{dirty}")
    rng = f"{UPSTREAM_TAG}..HEAD"
    if git_text(["rev-list", "--merges", rng], ws):
        raise PatchError(f"{ws}: merge commits after '{UPSTREAM_TAG}'; keep the history linear")
    untracked = [line[3:] for line in git_text(["status", "--porcelain"], ws).splitlines() if line.startswith("??")]
    warnings = tuple(f"untracked, not exported (git add + commit it, or delete it): {u}" for u in untracked)
    patches: list[tuple[str, bytes]] = []
    with tempfile.TemporaryDirectory(prefix="sglang-disagg-export-") as tmp:
        git([*FORMAT_PATCH_ARGS, "-o", tmp, rng], ws)
        for path in sorted(Path(tmp).glob("*.patch")):
            name = _NUMBER_PREFIX.sub("", path.name)
            if name in (n for n, _ in patches):
                raise PatchError(f"two commits export to {name}; give one a different subject")
            patches.append((name, path.read_bytes()))
    return Exported(tuple(patches), warnings)


def write_export(exported: Exported, patch_dir: Path, series: Series) -> list[str]:
    """Write patch files and ``series``; delete stale *.patch files. Returns a change summary."""
    changes: list[str] = []
    for name, data in exported.patches:
        path = patch_dir / name
        if not path.is_file():
            changes.append(f"added    {name}")
        elif path.read_bytes() != data:
            changes.append(f"updated  {name}")
        else:
            continue
        path.write_bytes(data)
    keep = set(exported.names)
    for path in sorted(patch_dir.glob("*.patch")):
        if path.name not in keep:
            path.unlink()
            changes.append(f"removed  {path.name}")
    new_series = Series(exported.names, series.header).dump()
    if not (patch_dir / "series").is_file() or (patch_dir / "series").read_text() != new_series:
        (patch_dir / "series").write_text(new_series)
        changes.append("updated  series")
    return changes
