"""workspace + export: deterministic round trip, export --check against hand edits."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from conftest import NEW, Cli, edit, git_commit_all

from sglang_disagg.patchtool.gitutil import git_text
from sglang_disagg.patchtool.model import Upstream
from sglang_disagg.patchtool.repos import upstream_repo


def _snapshot(patches: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(patches.iterdir())}


def test_workspace_layout(
    version_patch_repo: Path, releases: dict[str, Upstream], cli: Callable[..., Cli], tmp_path: Path
) -> None:
    ws = tmp_path / "ws2"
    res = cli("--repo-root", str(version_patch_repo), "workspace", str(ws))
    assert res.rc == 0, res.err
    assert (ws / "sglang" / "srt").is_dir()
    assert not list(ws.glob("*.dist-info"))
    log = git_text(["log", "--format=%s|%an|%ad", "--date=iso-strict"], ws).splitlines()
    assert log[-1].startswith(f"Upstream sglang {NEW}|SGLang upstream|2000-01-01")
    assert log[0] == "test: mark version.py|Test Author|2026-01-02T03:04:05+00:00"
    body = git_text(["log", "-1", "--format=%b"], ws)
    assert body == "Why: exercise the patch tool."
    # the upstream commit is the same for everyone: fixed tree, author, date, message
    assert git_text(["rev-parse", "upstream"], ws) == git_text(["rev-parse", "upstream"], upstream_repo(releases[NEW]))


def test_export_round_trip_is_deterministic(
    version_patch_repo: Path, cli: Callable[..., Cli], tmp_path: Path
) -> None:
    patches = version_patch_repo / "patches"
    first = _snapshot(patches)
    assert (patches / "series").read_text().splitlines()[-1] == "test-mark-version.py.patch"
    text = (patches / "test-mark-version.py.patch").read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n")
    assert "Subject: test: mark version.py\n" in text and "[PATCH" not in text
    assert "diff --git a/sglang/version.py b/sglang/version.py" in text
    assert not text.rstrip().endswith("2.39.5")  # no git version signature

    # rebuild a workspace from the exported series, add a second patch, export, drop it again
    ws = tmp_path / "ws2"
    assert cli("--repo-root", str(version_patch_repo), "workspace", str(ws)).rc == 0
    res = cli("--repo-root", str(version_patch_repo), "export", "--from", str(ws))
    assert res.rc == 0 and "no changes" in res.out
    assert _snapshot(patches) == first

    edit(ws / "sglang" / "__init__.py", "\n", "\n# second patch\n")
    git_commit_all(ws, "[core] second: keep [brackets] verbatim")
    assert cli("--repo-root", str(version_patch_repo), "export", "--from", str(ws)).rc == 0
    names = (patches / "series").read_text().splitlines()[-2:]
    assert names[0] == "test-mark-version.py.patch" and names[1].endswith(".patch")
    assert "Subject: [core] second: keep [brackets] verbatim" in (patches / names[1]).read_text()
    second = _snapshot(patches)
    assert cli("--repo-root", str(version_patch_repo), "export", "--check").rc == 0

    # a fresh workspace from those files round-trips both patches byte for byte
    ws3 = tmp_path / "ws3"
    assert cli("--repo-root", str(version_patch_repo), "workspace", str(ws3)).rc == 0
    assert git_text(["log", "-1", "--format=%s"], ws3) == "[core] second: keep [brackets] verbatim"
    assert cli("--repo-root", str(version_patch_repo), "export", "--from", str(ws3)).rc == 0
    assert _snapshot(patches) == second

    # dropping the commit deletes its file and its series line
    git_text(["reset", "-q", "--hard", "HEAD~1"], ws3)
    res = cli("--repo-root", str(version_patch_repo), "export", "--from", str(ws3))
    assert res.rc == 0 and f"removed  {names[1]}" in res.out
    assert _snapshot(patches) == first


def test_export_check_detects_hand_edit(version_patch_repo: Path, cli: Callable[..., Cli]) -> None:
    patch = version_patch_repo / "patches" / "test-mark-version.py.patch"
    assert cli("--repo-root", str(version_patch_repo), "export", "--check").rc == 0
    edit(patch, "+# sglang-disagg: test patch", "+# sglang-disagg: test patch (hand edited)")
    res = cli("--repo-root", str(version_patch_repo), "export", "--check")
    assert res.rc == 1
    assert "stale or hand-edited" in res.err
    # the rebuilt workspace carries the edit, so its blob id no longer matches the index line
    assert "--- patches/test-mark-version.py.patch (committed)" in res.out
    assert "-index b869775f0b33..8f952e49b6ec 100644" not in res.out
    assert "\n-index " in res.out and "\n+index " in res.out
    assert "Traceback" not in res.err


def test_export_check_detects_non_canonical_patch(version_patch_repo: Path, cli: Callable[..., Cli]) -> None:
    patch = version_patch_repo / "patches" / "test-mark-version.py.patch"
    edit(patch, " sglang/version.py | 1 +\n 1 file changed, 1 insertion(+)\n\n", "")  # diffstat removed
    res = cli("--repo-root", str(version_patch_repo), "export", "--check")
    assert res.rc == 1 and "+ sglang/version.py | 1 +" in res.out


def test_export_check_detects_stale_series(version_patch_repo: Path, cli: Callable[..., Cli]) -> None:
    series = version_patch_repo / "patches" / "series"
    series.write_text(series.read_text() + "# trailing comment\n")
    res = cli("--repo-root", str(version_patch_repo), "export", "--check")
    assert res.rc == 1 and "-# trailing comment" in res.out


def test_export_refuses_dirty_workspace(
    version_patch_repo: Path, cli: Callable[..., Cli], tmp_path: Path
) -> None:
    ws = tmp_path / "ws2"
    assert cli("--repo-root", str(version_patch_repo), "workspace", str(ws)).rc == 0
    edit(ws / "sglang" / "version.py", "# sglang-disagg: test patch", "# uncommitted")
    res = cli("--repo-root", str(version_patch_repo), "export", "--from", str(ws))
    assert res.rc == 1 and "uncommitted changes" in res.err
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=ws, check=True)
    (ws / "sglang" / "new_module.py").write_text("x = 1\n")
    res = cli("--repo-root", str(version_patch_repo), "export", "--from", str(ws))
    assert res.rc == 0 and "warning: untracked, not exported" in res.err and "sglang/new_module.py" in res.err
