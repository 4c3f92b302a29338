"""``rebase``: move the series to another SGLang release with a 3-way merge.

The throw-away workspace history is::

    Upstream sglang A  (tag sglang-A, branch main)
           \\
            Upstream sglang B  (tags upstream, sglang-B) --- patches replayed with `git am -3` (branch rebased)

``git am -3`` finds each patch's preimage blobs (from A) in the repository, so changes
between A and B merge like a rebase. It stops at the first conflict with instructions; after
resolution ``rebase --continue --workspace WS`` exports and moves the pin.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from sglang_disagg.patchtool import check, repos, workspace
from sglang_disagg.patchtool.errors import PatchError
from sglang_disagg.patchtool.gitutil import git, git_text
from sglang_disagg.patchtool.model import PatchDir, Upstream
from sglang_disagg.patchtool.releases import fetch_release

CHANGELOG = "CHANGELOG.md"
UNRELEASED = "## [Unreleased]"
_FROM_KEY = "sglang-disagg.rebase-from"


def changelog_line(old: str, new: str) -> str:
    return f"- Patch series rebased from SGLang {old} to {new}."


def _next_heading(lines: list[str], start: int, prefix: str) -> int:
    return next((i for i in range(start, len(lines)) if lines[i].startswith(prefix)), len(lines))


def add_changelog_line(path: Path, line: str) -> None:
    """Add ``line`` under ``## [Unreleased]`` (in its ``### Changed`` part if it has one).

    The section is created before the first ``## `` heading if missing; a missing file is
    created with a ``# Changelog`` title.
    """
    lines = (path.read_text() if path.is_file() else "# Changelog\n").splitlines()
    head = next((i for i, text in enumerate(lines) if text.strip().lower() == UNRELEASED.lower()), None)
    if head is None:
        first = _next_heading(lines, 0, "## ")
        before = lines[:first]
        while before and not before[-1].strip():
            before.pop()
        lines = [*before, "", UNRELEASED, "", *lines[first:]]
        head = len(before) + 1
    start, end = head + 1, _next_heading(lines, head + 1, "## ")
    changed = next((i for i in range(start, end) if lines[i].strip().lower() == "### changed"), None)
    if changed is not None:
        start, end = changed + 1, _next_heading(lines, changed + 1, "#")
    filled = [i for i in range(start, end) if lines[i].strip()]
    at = filled[-1] + 1 if filled else start
    new = [line] if filled else ["", line]
    if at >= len(lines) or lines[at].strip():
        new.append("")
    lines[at:at] = new
    path.write_text("\n".join(lines).rstrip("\n") + "\n")


def _instructions(ws: Path, pd: PatchDir, repo_root: Path, old: str, new: str) -> str:
    where = f"--repo-root {repo_root}"
    if pd.root != repo_root / "patches":
        where += f" --patches-dir {pd.root}"
    return (
        f"\nrebase {old} -> {new} stopped; workspace kept at {ws}\n"
        "to continue:\n"
        f"  cd {ws}\n"
        "  git status                       # files with conflict markers\n"
        "  $EDITOR <files> && git add <files>\n"
        "  git am --continue                # repeat for later patches; `git am --skip` drops a patch\n"
        f"  python -m sglang_disagg.patchtool {where} rebase --continue --workspace {ws}\n"
        "to abandon: delete the workspace; nothing in the checkout was changed"
    )


def start(to: str, pd: PatchDir, repo_root: Path, ws: Path | None, no_changelog: bool) -> list[str]:
    old = pd.upstream()
    if to == old.version:
        raise PatchError(f"the series is already pinned to sglang {to}")
    target = fetch_release(to)
    auto_ws = ws is None
    ws = ws or Path(tempfile.mkdtemp(prefix=f"sglang-disagg-rebase-{old.version}-to-{to}-"))
    if auto_ws:
        ws.rmdir()
    try:
        stopped = replay(ws, pd, target)
    except BaseException:
        if auto_ws:
            shutil.rmtree(ws, ignore_errors=True)
        raise
    if stopped:
        raise PatchError(stopped + _instructions(ws, pd, repo_root, old.version, to))
    lines = finish(ws, pd, repo_root, no_changelog)
    if auto_ws:
        shutil.rmtree(ws, ignore_errors=True)
    else:
        lines.append(f"workspace {ws} (sglang {to} + series) kept")
    return lines


def _prepare(ws: Path, pd: PatchDir, old: Upstream, target: Upstream) -> None:
    """History ``Upstream old`` (main) -> ``Upstream target`` (branch rebased, checked out).

    The series is not replayed onto ``old`` (``git am -3`` only needs the old blobs, which the
    clone has); whether it applies there is checked on a scratch copy first, which is quicker.
    """
    ok, lines = check.run(pd, check_installed=False)
    if not ok:
        raise PatchError("the committed series is not consistent with its own pin; fix that first:\n"
                         + "\n".join(lines))
    repos.full_base(ws, old, checkout=False)
    git(["tag", "-f", f"sglang-{old.version}"], ws)
    repos.add_release(ws, target, git_text(["rev-parse", repos.UPSTREAM_TAG], ws), "rebased")
    git(["tag", "-f", f"sglang-{target.version}"], ws)
    git(["config", _FROM_KEY, old.version], ws)


def replay(ws: Path, pd: PatchDir, target: Upstream) -> str | None:
    """A workspace on ``target`` with the series replayed (3-way); why it stopped, or None."""
    _prepare(ws, pd, pd.upstream(), target)
    proc = workspace.am(ws, pd.patch_paths())
    return workspace.am_failure(ws, proc) if proc is not None and proc.returncode != 0 else None


def dry_run(to: str, pd: PatchDir) -> tuple[bool, list[str]]:
    """Replay each patch onto ``to`` in a temp workspace, skipping conflicts; change nothing."""
    old, patches = pd.upstream(), pd.patch_paths()
    target = fetch_release(to)
    lines = [f"dry run: {len(patches)} patch(es) pinned to sglang {old.version}, replayed onto {to}:"]
    clean = merged = 0
    with tempfile.TemporaryDirectory(prefix="sglang-disagg-dry-run-") as tmp:
        ws = Path(tmp) / "ws"
        _prepare(ws, pd, old, target)
        for patch in patches:
            proc = workspace.am(ws, [patch], quiet=False)
            assert proc is not None
            if proc.returncode == 0:
                three_way = b"3-way merge" in proc.stdout + proc.stderr
                merged += three_way
                clean += not three_way
                lines.append(f"  {'3-way merge' if three_way else 'clean':<12} {patch.name}")
                continue
            files = git_text(["diff", "--name-only", "--diff-filter=U"], ws, check=False).split()
            lines.append(f"  {'CONFLICT':<12} {patch.name}: {', '.join(files) or 'does not apply'}")
            git(["am", "--skip"], ws)
    failed = len(patches) - clean - merged
    lines.append(f"{clean} clean, {merged} with a 3-way merge, {failed} conflicting "
                 "(later patches are tried with the conflicting ones skipped); nothing was changed")
    return failed == 0, lines


def finish(ws: Path, pd: PatchDir, repo_root: Path, no_changelog: bool) -> list[str]:
    """Export the rebased workspace, move the pin and add the CHANGELOG line."""
    new = workspace.workspace_upstream(ws)
    old = pd.upstream()
    from_version = git_text(["config", "--get", _FROM_KEY], ws, check=False) or old.version
    if from_version != old.version:
        raise PatchError(f"workspace {ws} rebased from sglang {from_version}, but patches/UPSTREAM pins "
                         f"{old.version}; the pin moved meanwhile: start the rebase again")
    exported = workspace.export(ws)
    changes = workspace.write_export(exported, pd.root, pd.series())
    new.save(pd.upstream_path)
    lines = [f"rebased {len(exported.names)} patch(es) from sglang {old.version} to {new.version}"]
    lines += [f"  {c}" for c in changes] + [f"  updated  UPSTREAM ({new.archive})"]
    lines += [f"warning: {w}" for w in exported.warnings]
    if not no_changelog and old.version != new.version:
        add_changelog_line(repo_root / CHANGELOG, changelog_line(old.version, new.version))
        lines.append(f"  updated  {CHANGELOG}")
    return lines
