"""rebase between two real releases (0.5.22 -> 0.5.23): clean, and stopped at a conflict."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from conftest import DISAGG_UTILS, NEW, OLD, Cli

from sglang_disagg.patchtool.model import Upstream
from sglang_disagg.patchtool.rebase import add_changelog_line

CHANGELOG_LINE = f"- Patch series rebased from SGLang {OLD} to {NEW}."


def test_rebase_clean(
    make_repo: Callable[..., Path], patch_sets: dict[str, Path], releases: dict[str, Upstream],
    cli: Callable[..., Cli],
) -> None:
    root = make_repo(OLD, patch_sets["old-clean"])
    patches = root / "patches"
    version_patch = (patches / "test-mark-version.py.patch").read_bytes()
    stable_patch = (patches / "disagg-comment-a-stable-import.patch").read_text()
    res = cli("--repo-root", str(root), "rebase", "--to", NEW)
    assert res.rc == 0, res.err
    assert f"rebased 2 patch(es) from sglang {OLD} to {NEW}" in res.out

    assert Upstream.load(patches / "UPSTREAM") == releases[NEW]
    assert (patches / "series").read_text().splitlines()[-2:] == [
        "test-mark-version.py.patch", "disagg-comment-a-stable-import.patch"]
    # version.py did not change between the releases: same bytes; the other hunk moved one line
    assert (patches / "test-mark-version.py.patch").read_bytes() == version_patch
    new_stable = (patches / "disagg-comment-a-stable-import.patch").read_text()
    old_hunk = re.search(r"^@@ -(\d+)", stable_patch, re.M)
    new_hunk = re.search(r"^@@ -(\d+)", new_stable, re.M)
    assert old_hunk and new_hunk and int(new_hunk.group(1)) == int(old_hunk.group(1)) + 1
    changelog = (root / "CHANGELOG.md").read_text()
    assert f"## [Unreleased]\n\n{CHANGELOG_LINE}\n\n## [0.1.0]" in changelog

    # the result is canonical at the new pin, and a second export --check is stable
    assert cli("--repo-root", str(root), "export", "--check").rc == 0
    assert cli("--repo-root", str(root), "check", "--no-installed").rc == 0


def test_rebase_conflict_stops_with_instructions(
    make_repo: Callable[..., Path], patch_sets: dict[str, Path], cli: Callable[..., Cli], tmp_path: Path
) -> None:
    root = make_repo(OLD, patch_sets["old-conflict"])
    patches = root / "patches"
    before = {p.name: p.read_bytes() for p in patches.iterdir()}
    ws = tmp_path / "rebase-ws"
    res = cli("--repo-root", str(root), "rebase", "--to", NEW, "--workspace", str(ws))
    assert res.rc == 1
    assert "patch 'disagg: tag the poll reduction' does not apply" in res.err
    assert f"conflicting files:\n    {DISAGG_UTILS}" in res.err
    assert f"workspace kept at {ws}" in res.err and "git am --continue" in res.err
    assert f"rebase --continue --workspace {ws}" in res.err
    assert "Traceback" not in res.err
    assert {p.name: p.read_bytes() for p in patches.iterdir()} == before  # nothing moved yet
    assert "Unreleased" not in (root / "CHANGELOG.md").read_text()

    # resolve: keep NEW's code and re-add the comment, then continue
    target = ws / DISAGG_UTILS
    text = target.read_text()
    start, mid, end = text.index("<<<<<<< "), text.index("=======\n"), text.index(">>>>>>> ")
    ours = text[text.index("\n", start) + 1 : mid]
    resolved = ours.replace('device="cpu")\n', 'device="cpu")  # disagg\n', 1)
    target.write_text(text[:start] + resolved + text[text.index("\n", end) + 1 :])
    subprocess.run(["git", "add", DISAGG_UTILS], cwd=ws, check=True)
    early = cli("--repo-root", str(root), "rebase", "--continue", "--workspace", str(ws))
    assert early.rc == 1 and "git am --continue" in early.err  # am still in progress
    env = {"GIT_EDITOR": "true", "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "am", "--continue"],
                   cwd=ws, check=True, env=env, capture_output=True)

    res = cli("--repo-root", str(root), "rebase", "--continue", "--workspace", str(ws))
    assert res.rc == 0, res.err
    assert Upstream.load(patches / "UPSTREAM").version == NEW
    assert "# disagg" in (patches / "disagg-tag-the-poll-reduction.patch").read_text()
    assert CHANGELOG_LINE in (root / "CHANGELOG.md").read_text()
    assert cli("--repo-root", str(root), "export", "--check").rc == 0


def test_rebase_to_pinned_version_is_refused(version_patch_repo: Path, cli: Callable[..., Cli]) -> None:
    res = cli("--repo-root", str(version_patch_repo), "rebase", "--to", NEW)
    assert res.rc == 1 and "already pinned" in res.err


def test_changelog_section_created_and_appended(tmp_path: Path) -> None:
    path = tmp_path / "CHANGELOG.md"
    add_changelog_line(path, "- one.")
    assert path.read_text() == "# Changelog\n\n## [Unreleased]\n\n- one.\n"
    add_changelog_line(path, "- two.")
    assert path.read_text() == "# Changelog\n\n## [Unreleased]\n\n- one.\n- two.\n"
    path.write_text("# Changelog\n\n## [Unreleased]\n\n### Changed\n\n- a\n\n### Fixed\n\n- b\n\n## [0.1]\n")
    add_changelog_line(path, "- three.")
    assert "### Changed\n\n- a\n- three.\n\n### Fixed" in path.read_text()


def test_rebase_dry_run_reports_and_changes_nothing(
    make_repo: Callable[..., Path], patch_sets: dict[str, Path], cli: Callable[..., Cli]
) -> None:
    root = make_repo(OLD, patch_sets["old-conflict"])
    before = {p.name: p.read_bytes() for p in (root / "patches").iterdir()}
    res = cli("--repo-root", str(root), "rebase", "--to", NEW, "--dry-run")
    assert res.rc == 1, res.err
    assert "clean        test-mark-version.py.patch" in res.out
    assert f"CONFLICT     disagg-tag-the-poll-reduction.patch: {DISAGG_UTILS}" in res.out
    assert "1 clean, 0 with a 3-way merge, 1 conflicting" in res.out
    assert {p.name: p.read_bytes() for p in (root / "patches").iterdir()} == before
    assert "Unreleased" not in (root / "CHANGELOG.md").read_text()


def test_rebase_merges_three_way(
    make_repo: Callable[..., Path], patch_sets: dict[str, Path], cli: Callable[..., Cli]
) -> None:
    root = make_repo(OLD, patch_sets["old-3way"])
    res = cli("--repo-root", str(root), "rebase", "--to", NEW, "--dry-run")
    assert res.rc == 0 and "3-way merge  disagg-comment-near-an-upstream-change.patch" in res.out
    res = cli("--repo-root", str(root), "rebase", "--to", NEW)
    assert res.rc == 0, res.err
    patch = (root / "patches" / "disagg-comment-near-an-upstream-change.patch").read_text()
    assert "\n+import hashlib" not in patch and " import hashlib\n" in patch  # new context
    assert cli("--repo-root", str(root), "check", "--no-installed").rc == 0


def test_workspace_on_other_version_then_continue(
    make_repo: Callable[..., Path], patch_sets: dict[str, Path], releases: dict[str, Upstream],
    cli: Callable[..., Cli], tmp_path: Path,
) -> None:
    root = make_repo(OLD, patch_sets["old-clean"])
    ws = tmp_path / "ws-new"
    res = cli("--repo-root", str(root), "workspace", str(ws), "--version", NEW)
    assert res.rc == 0, res.err
    assert f"replayed from the pinned {OLD}" in res.out and "rebase --continue" in res.out
    res = cli("--repo-root", str(root), "export", "--from", str(ws))
    assert res.rc == 1 and f"based on sglang {NEW}" in res.err and "rebase --continue" in res.err
    res = cli("--repo-root", str(root), "rebase", "--continue", "--workspace", str(ws))
    assert res.rc == 0, res.err
    assert Upstream.load(root / "patches" / "UPSTREAM") == releases[NEW]
