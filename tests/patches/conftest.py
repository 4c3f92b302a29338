"""Fixtures for the patch-tool tests: real SGLang wheels (cached), temp repos, fake site-packages.

The wheels come from the tool's own download cache (``$SGLANG_DISAGG_CACHE``, default
``~/.cache/sglang-disagg``); only the first run needs PyPI. Without network and cache the
tests that need a wheel are skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_disagg.patchtool.cli import main
from sglang_disagg.patchtool.errors import PatchError
from sglang_disagg.patchtool.model import SERIES_HEADER, Upstream
from sglang_disagg.patchtool.releases import cache_dir, fetch_release

OLD, NEW = "0.5.22", "0.5.23"
AUTHOR_ENV = {
    "GIT_AUTHOR_NAME": "Test Author",
    "GIT_AUTHOR_EMAIL": "author@example.invalid",
    "GIT_AUTHOR_DATE": "2026-01-02T03:04:05+0000",
    "GIT_COMMITTER_NAME": "Test Author",
    "GIT_COMMITTER_EMAIL": "author@example.invalid",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


@pytest.fixture(scope="session")
def releases() -> dict[str, Upstream]:
    """Pins of the two real releases used by the tests (downloaded once into the cache)."""
    try:
        return {v: fetch_release(v) for v in (OLD, NEW)}
    except PatchError as exc:
        pytest.skip(f"sglang wheels not available (offline, empty cache {cache_dir()}): {exc}")


@dataclass(frozen=True)
class Cli:
    rc: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Cli]:
    def run(*args: str) -> Cli:
        capsys.readouterr()
        rc = main(list(args))
        cap = capsys.readouterr()
        return Cli(rc, cap.out, cap.err)

    return run


def git_commit_all(ws: Path, subject: str, body: str = "") -> None:
    env = {**os.environ, **AUTHOR_ENV}
    msg = ["-m", subject] + (["-m", body] if body else [])
    subprocess.run(["git", "commit", "-q", "-a", *msg], cwd=ws, env=env, check=True)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def _wanted(name: str) -> bool:
    return ".dist-info/" in name or name.count("/") == 1 or name.startswith("sglang/srt/disaggregation/")


def _new_repo(root: Path, up: Upstream) -> Path:
    (root / "patches").mkdir(parents=True)
    up.save(root / "patches" / "UPSTREAM")
    (root / "patches" / "series").write_text(SERIES_HEADER)
    (root / "CHANGELOG.md").write_text("# Changelog\n\n## [0.1.0]\n\n- First release.\n")
    return root


@pytest.fixture
def make_repo(tmp_path: Path, releases: dict[str, Upstream]) -> Callable[..., Path]:
    """A checkout-like directory: patches/{UPSTREAM,series} pinned to ``version`` + CHANGELOG.md.

    ``patch_set`` copies one of the session's exported series (see ``patch_sets``) into it.
    """

    def make(version: str, patch_set: Path | None = None, name: str = "repo") -> Path:
        root = _new_repo(tmp_path / name, releases[version])
        if patch_set is not None:
            for f in patch_set.iterdir():
                shutil.copyfile(f, root / "patches" / f.name)
        return root

    return make


def _export(root: Path, ws: Path, dest: Path) -> Path:
    assert main(["--repo-root", str(root), "export", "--from", str(ws)]) == 0
    shutil.copytree(root / "patches", dest)
    (dest / "UPSTREAM").unlink()
    return dest


DISAGG_UTILS = "sglang/srt/disaggregation/utils.py"
# unchanged between 0.5.22 and 0.5.23, but one line further down in 0.5.23
STABLE_LINE = "from sglang.srt.utils import is_npu\n"
# unchanged, but its diff context spans a line 0.5.23 inserted ("import hashlib")
NEAR_CHANGE_LINE = "from contextlib import nullcontext\n"
# changed between 0.5.22 and 0.5.23
CHANGED_LINE = '    tensor_to_reduce = torch.tensor(polls, dtype=torch.uint8, device="cpu")\n'


@pytest.fixture(scope="session")
def patch_sets(releases: dict[str, Upstream], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Exported series (patch files + series, no UPSTREAM), authored once per session.

    * ``new-version``: on NEW, appends a comment to sglang/version.py
    * ``new-version-v2``: the same patch, edited (another comment)
    * ``new-stacked``: that edited patch + one whose context is its line (a stacked series)
    * ``old-clean``: on OLD, that patch + a comment on a line that only moved in NEW
    * ``old-conflict``: on OLD, that patch + an edit of a line that NEW changed
    * ``old-3way``: on OLD, that patch + an edit whose context NEW changed (3-way merge needed)
    """
    base = tmp_path_factory.mktemp("patch-sets")
    sets: dict[str, Path] = {}
    for version, name in ((NEW, "new"), (OLD, "old")):
        root, ws = _new_repo(base / f"repo-{name}", releases[version]), base / f"ws-{name}"
        assert main(["--repo-root", str(root), "workspace", str(ws)]) == 0
        with (ws / "sglang" / "version.py").open("a") as f:
            f.write("# sglang-disagg: test patch\n")
        git_commit_all(ws, "test: mark version.py", "Why: exercise the patch tool.")
        if version == NEW:
            sets["new-version"] = _export(root, ws, base / "new-version")
            edit(ws / "sglang" / "version.py", "# sglang-disagg: test patch\n", "# sglang-disagg: test patch v2\n")
            env = {**os.environ, **AUTHOR_ENV}
            subprocess.run(["git", "commit", "-q", "-a", "--amend", "--no-edit"], cwd=ws, env=env, check=True)
            sets["new-version-v2"] = _export(root, ws, base / "new-version-v2")
            # A second patch whose context is the first one's line: it applies only after it.
            edit(ws / "sglang" / "version.py", "# sglang-disagg: test patch v2\n",
                 "# sglang-disagg: test patch v2\n# sglang-disagg: stacked\n")
            git_commit_all(ws, "test: stack on the mark", "Needs the patch before it.")
            sets["new-stacked"] = _export(root, ws, base / "new-stacked")
            continue
        edit(ws / DISAGG_UTILS, STABLE_LINE, STABLE_LINE.rstrip("\n") + "  # sglang-disagg: stable\n")
        git_commit_all(ws, "disagg: comment a stable import", "Applies to 0.5.22 and 0.5.23.")
        sets["old-clean"] = _export(root, ws, base / "old-clean")
        subprocess.run(["git", "reset", "-q", "--hard", "HEAD~1"], cwd=ws, check=True)
        edit(ws / DISAGG_UTILS, CHANGED_LINE, CHANGED_LINE.replace("device=\"cpu\")", "device=\"cpu\")  # disagg"))
        git_commit_all(ws, "disagg: tag the poll reduction", "Conflicts with 0.5.23.")
        sets["old-conflict"] = _export(root, ws, base / "old-conflict")
        subprocess.run(["git", "reset", "-q", "--hard", "HEAD~1"], cwd=ws, check=True)
        edit(ws / DISAGG_UTILS, NEAR_CHANGE_LINE, NEAR_CHANGE_LINE.rstrip("\n") + "  # sglang-disagg: 3-way\n")
        git_commit_all(ws, "disagg: comment near an upstream change", "Needs a 3-way merge onto 0.5.23.")
        sets["old-3way"] = _export(root, ws, base / "old-3way")
    return sets


@pytest.fixture
def version_patch_repo(make_repo: Callable[..., Path], patch_sets: dict[str, Path]) -> Path:
    """A repo pinned to NEW with one exported patch appending a comment to sglang/version.py."""
    return make_repo(NEW, patch_sets["new-version"])


@pytest.fixture
def make_site_packages(tmp_path: Path, releases: dict[str, Upstream]) -> Callable[..., Path]:
    """Unpack a release wheel as a fake site-packages directory.

    Only the dist-info, the package's top-level modules and ``srt/disaggregation/`` (all
    the test patches touch) are unpacked: the full wheel is ~6k files.
    """

    def make(version: str, where: Path | None = None, *, fake_version: str | None = None) -> Path:
        sp = where or tmp_path / f"site-packages-{version}"
        sp.mkdir(parents=True)
        with zipfile.ZipFile(cache_dir() / releases[version].archive) as zf:
            zf.extractall(sp, [n for n in zf.namelist() if _wanted(n)])
        if fake_version:
            dist = sp / f"sglang-{version}.dist-info"
            meta = dist / "METADATA"
            meta.write_text(meta.read_text().replace(f"Version: {version}", f"Version: {fake_version}", 1))
            dist.rename(sp / f"sglang-{fake_version}.dist-info")
        return sp

    return make
