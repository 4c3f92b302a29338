"""apply / status / check against fake site-packages directories unpacked from the real wheel."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

from conftest import NEW, OLD, Cli, edit

from sglang_disagg.patchtool.installed import MARKER

VERSION_PY = "sglang/version.py"
LINE = "# sglang-disagg: test patch\n"


def bytecode_is_fresh(src: Path) -> bool:
    """The interpreter would use the cached .pyc instead of compiling the source again."""
    pyc = Path(importlib.util.cache_from_source(str(src)))
    if not pyc.exists():
        return False
    flags, mtime, size = struct.unpack("<III", pyc.read_bytes()[4:16])
    st = src.stat()
    return flags == 0 and mtime == int(st.st_mtime) & 0xFFFFFFFF and size == st.st_size & 0xFFFFFFFF


def test_apply_is_idempotent(
    version_patch_repo: Path, make_site_packages: Callable[..., Path], cli: Callable[..., Cli]
) -> None:
    sp = make_site_packages(NEW)
    repo = ("--repo-root", str(version_patch_repo))
    pristine = (sp / VERSION_PY).read_text()
    res = cli(*repo, "status", "--site-packages", str(sp))
    assert res.rc == 1 and "not applied  test-mark-version.py.patch" in res.out
    assert f"installed sglang {NEW}" in res.out and f"pinned {NEW}" in res.out

    res = cli(*repo, "apply", "--site-packages", str(sp))
    assert res.rc == 0 and "applied 1 patch(es)" in res.out and VERSION_PY in res.out
    assert (sp / VERSION_PY).read_text() == pristine + LINE
    assert bytecode_is_fresh(sp / VERSION_PY)  # patched modules are not compiled again in every process
    marker = json.loads((sp / "sglang" / MARKER).read_text())
    assert marker["patches"] == ["test-mark-version.py.patch"] and marker["upstream_version"] == NEW

    res = cli(*repo, "apply", "--site-packages", str(sp))
    assert res.rc == 0 and "already applied" in res.out
    assert (sp / VERSION_PY).read_text() == pristine + LINE

    res = cli(*repo, "status", "--site-packages", str(sp))
    assert res.rc == 0 and "applied      test-mark-version.py.patch" in res.out and "up to date" in res.out
    (sp / "sglang" / MARKER).unlink()  # status falls back to checking the files themselves
    res = cli(*repo, "status", "--site-packages", str(sp))
    assert res.rc == 0 and "applied      test-mark-version.py.patch" in res.out and "marker" not in res.out

    res = cli(*repo, "check", "--site-packages", str(sp))
    assert res.rc == 0 and "matches pristine + series" in res.out, res.out


def test_apply_refuses_other_version(
    version_patch_repo: Path, make_site_packages: Callable[..., Path], cli: Callable[..., Cli]
) -> None:
    sp = make_site_packages(NEW, fake_version="0.5.99")
    before = (sp / VERSION_PY).read_bytes()
    res = cli("--repo-root", str(version_patch_repo), "apply", "--site-packages", str(sp))
    assert res.rc == 2
    assert "installed sglang is 0.5.99" in res.err and f"pinned to {NEW}" in res.err
    assert "Traceback" not in res.err
    assert (sp / VERSION_PY).read_bytes() == before
    res = cli("--repo-root", str(version_patch_repo), "status", "--site-packages", str(sp))
    assert res.rc == 1 and f"DIFFERS from pinned {NEW}" in res.out


def test_apply_refuses_real_other_release(
    version_patch_repo: Path, make_site_packages: Callable[..., Path], cli: Callable[..., Cli]
) -> None:
    sp = make_site_packages(OLD)
    res = cli("--repo-root", str(version_patch_repo), "apply", "--site-packages", str(sp))
    assert res.rc == 2 and f"installed sglang is {OLD}" in res.err and NEW in res.err


def test_apply_refuses_modified_copy(
    version_patch_repo: Path, make_site_packages: Callable[..., Path], cli: Callable[..., Cli]
) -> None:
    sp = make_site_packages(NEW)
    with (sp / VERSION_PY).open("a") as f:
        f.write("local_edit = 1\n")
    before = (sp / VERSION_PY).read_bytes()
    res = cli("--repo-root", str(version_patch_repo), "apply", "--site-packages", str(sp))
    assert res.rc == 1 and "partially patched or modified" in res.err and "conflicting" in res.err
    assert "--force-reinstall" in res.err
    assert (sp / VERSION_PY).read_bytes() == before
    res = cli("--repo-root", str(version_patch_repo), "check", "--site-packages", str(sp))
    assert res.rc == 1 and f"    {VERSION_PY}" in res.out


def test_apply_inside_git_work_tree(
    version_patch_repo: Path, make_site_packages: Callable[..., Path], cli: Callable[..., Cli], tmp_path: Path
) -> None:
    outer = tmp_path / "checkout"
    outer.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=outer, check=True)
    sp = make_site_packages(NEW, outer / ".venv" / "lib" / "python3.11" / "site-packages")
    patch = version_patch_repo / "patches" / "test-mark-version.py.patch"
    # the hazard: plain `git apply` inside an enclosing repo skips the file and still exits 0
    plain = subprocess.run(["git", "apply", str(patch)], cwd=sp, capture_output=True)
    assert plain.returncode == 0 and LINE not in (sp / VERSION_PY).read_text()

    res = cli("--repo-root", str(version_patch_repo), "apply", "--site-packages", str(sp))
    assert res.rc == 0, res.err
    assert (sp / VERSION_PY).read_text().endswith(LINE)
    res = cli("--repo-root", str(version_patch_repo), "status", "--site-packages", str(sp))
    assert res.rc == 0


def test_check_series_consistency(version_patch_repo: Path, cli: Callable[..., Cli]) -> None:
    patches = version_patch_repo / "patches"
    repo = ("--repo-root", str(version_patch_repo))
    assert cli(*repo, "check", "--no-installed").rc == 0

    (patches / "stray.patch").write_text("")
    series = patches / "series"
    series.write_text(series.read_text() + "test-mark-version.py.patch\nmissing.patch\n")
    res = cli(*repo, "check", "--no-installed")
    assert res.rc == 1
    assert "FAIL duplicate in series: test-mark-version.py.patch" in res.out
    assert "FAIL listed in series but missing: missing.patch" in res.out
    assert "FAIL not listed in series: stray.patch" in res.out
    res = cli(*repo, "apply", "--site-packages", str(version_patch_repo))
    assert res.rc == 1 and "Traceback" not in res.err


def test_check_detects_patch_not_applying(version_patch_repo: Path, cli: Callable[..., Cli]) -> None:
    edit(version_patch_repo / "patches" / "test-mark-version.py.patch", '"dev0")\n', '"dev1")\n')
    res = cli("--repo-root", str(version_patch_repo), "check", "--no-installed")
    assert res.rc == 1 and "does not apply to pristine sglang" in res.out


def test_errors_have_no_traceback(tmp_path: Path) -> None:
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "sglang_disagg.patchtool", "--patches-dir", str(tmp_path), "status"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and ": missing (" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_apply_replaces_previous_series_and_reverts(
    version_patch_repo: Path, patch_sets: dict[str, Path], make_site_packages: Callable[..., Path],
    cli: Callable[..., Cli],
) -> None:
    sp = make_site_packages(NEW)
    repo = ("--repo-root", str(version_patch_repo))
    pristine = (sp / VERSION_PY).read_text()
    assert cli(*repo, "apply", "--site-packages", str(sp)).rc == 0
    v2 = patch_sets["new-version-v2"] / "test-mark-version.py.patch"
    (version_patch_repo / "patches" / v2.name).write_bytes(v2.read_bytes())  # the patch was edited

    res = cli(*repo, "status", "--site-packages", str(sp))
    assert res.rc == 1 and "conflicting  test-mark-version.py.patch" in res.out
    res = cli(*repo, "apply", "--site-packages", str(sp))
    assert res.rc == 0 and "replaced the previously applied series" in res.out, res.err
    assert (sp / VERSION_PY).read_text() == pristine + "# sglang-disagg: test patch v2\n"
    assert cli(*repo, "status", "--site-packages", str(sp)).rc == 0

    res = cli(*repo, "apply", "--revert", "--site-packages", str(sp))
    assert res.rc == 0 and "pristine" in res.out
    assert (sp / VERSION_PY).read_text() == pristine and not (sp / "sglang" / MARKER).exists()
    assert "not applied" in cli(*repo, "status", "--site-packages", str(sp)).out


def test_apply_refuses_edited_after_apply(
    version_patch_repo: Path, patch_sets: dict[str, Path], make_site_packages: Callable[..., Path],
    cli: Callable[..., Cli],
) -> None:
    sp = make_site_packages(NEW)
    repo = ("--repo-root", str(version_patch_repo))
    assert cli(*repo, "apply", "--site-packages", str(sp)).rc == 0
    edit(sp / VERSION_PY, "# sglang-disagg: test patch\n", "# sglang-disagg: test patch\nlocal = 1\n")
    v2 = patch_sets["new-version-v2"] / "test-mark-version.py.patch"
    (version_patch_repo / "patches" / v2.name).write_bytes(v2.read_bytes())
    before = (sp / VERSION_PY).read_bytes()
    res = cli(*repo, "apply", "--site-packages", str(sp))
    assert res.rc == 1 and "not as a previous apply left it" in res.err
    assert (sp / VERSION_PY).read_bytes() == before


def test_repo_root_found_from_cwd(version_patch_repo: Path) -> None:
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "sglang_disagg.patchtool", "check", "--no-installed"],
        cwd=version_patch_repo / "patches", capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ok   series: 1 patch(es)" in proc.stdout


def test_apply_a_stacked_series_to_a_pristine_copy(
    make_repo: Callable[..., Path], patch_sets: dict[str, Path], make_site_packages: Callable[..., Path],
    cli: Callable[..., Cli],
) -> None:
    """A patch built on an earlier patch's lines does not apply to pristine on its own: on a
    fresh install it reads as not applied (not conflicting) and the series applies in order."""
    repo = ("--repo-root", str(make_repo(NEW, patch_sets["new-stacked"])))
    sp = make_site_packages(NEW)
    pristine = (sp / VERSION_PY).read_text()
    res = cli(*repo, "status", "--site-packages", str(sp))
    assert res.rc == 1 and "conflicting" not in res.out and res.out.count("not applied") == 2, res.out
    res = cli(*repo, "apply", "--site-packages", str(sp))
    assert res.rc == 0 and "applied 2 patch(es)" in res.out, res.out + res.err
    assert (sp / VERSION_PY).read_text() == pristine + "# sglang-disagg: test patch v2\n# sglang-disagg: stacked\n"
    res = cli(*repo, "status", "--site-packages", str(sp))
    assert res.rc == 0 and res.out.count("applied      ") == 2, res.out
