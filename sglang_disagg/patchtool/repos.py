"""Git repositories of pristine releases: the cached upstream commit, and workspace bases.

Committing a whole wheel (~6k files) takes seconds, so each release's ``Upstream sglang X``
commit is built once into ``$SGLANG_DISAGG_CACHE/sglang-git/X-<sha>.git`` (bare) and
workspaces clone it (``--local``: hard links). The commit has a fixed author/date, so its
hash is the same on every machine. ``check`` and ``export --check`` only need the files the
series touches; they use a *sparse* base holding just those (the exported patches are the
same, since format-patch only looks at the touched blobs).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from sglang_disagg.patchtool.errors import PatchError
from sglang_disagg.patchtool.gitutil import UPSTREAM_AUTHOR, UPSTREAM_DATE, git, git_text
from sglang_disagg.patchtool.model import Upstream
from sglang_disagg.patchtool.releases import cache_dir, extract, pinned_wheel

UPSTREAM_TAG = "upstream"
CONFIG_KEYS = ("version", "archive", "sha256", "package")


def upstream_env() -> dict[str, str]:
    name, email = UPSTREAM_AUTHOR
    return {
        "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": UPSTREAM_DATE,
        "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email, "GIT_COMMITTER_DATE": UPSTREAM_DATE,
    }


def _subject(up: Upstream) -> str:
    return f"Upstream {up.package} {up.version}"


def upstream_repo(up: Upstream) -> Path:
    """The cached bare repository whose tag ``upstream`` is the pristine commit of ``up``."""
    root = cache_dir().parent / "sglang-git"
    repo = root / f"{up.version}-{up.sha256[:12]}.git"
    if (repo / "refs" / "tags" / UPSTREAM_TAG).is_file():
        return repo
    root.mkdir(parents=True, exist_ok=True)
    wheel = pinned_wheel(up)
    with tempfile.TemporaryDirectory(prefix="build-", dir=root) as tmp:
        gd, tree = Path(tmp) / "repo.git", Path(tmp) / "tree"
        git(["init", "-q", "--bare", str(gd)], Path(tmp))
        tree.mkdir()
        extract(wheel, tree)
        env = {**upstream_env(), "GIT_DIR": str(gd), "GIT_WORK_TREE": str(tree)}
        git(["add", "-A", "-f", "."], tree, env=env)
        git(["commit", "-q", "--no-verify", "-m", _subject(up)], tree, env=env)
        git(["tag", UPSTREAM_TAG], tree, env=env)
        (gd / "index").unlink(missing_ok=True)
        try:
            gd.rename(repo)
        except OSError:
            if not (repo / "refs" / "tags" / UPSTREAM_TAG).is_file():  # not a concurrent build
                raise
    return repo


def init_repo(ws: Path) -> None:
    if ws.exists() and any(ws.iterdir()):
        raise PatchError(f"{ws}: exists and is not empty; pick a new workspace directory")
    ws.mkdir(parents=True, exist_ok=True)
    git(["init", "-q", "."], ws)
    _configure(ws)


def _configure(ws: Path) -> None:
    """Ignore bytecode; commits made by people in the workspace use their own git identity."""
    (ws / ".git" / "info").mkdir(exist_ok=True)
    (ws / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n")


def mark(ws: Path, up: Upstream) -> None:
    """Tag HEAD ``upstream`` and record which release the workspace is based on."""
    git(["tag", "-f", UPSTREAM_TAG], ws)
    for key in CONFIG_KEYS:
        git(["config", f"sglang-disagg.{key}", getattr(up, key)], ws)


def full_base(ws: Path, up: Upstream, *, checkout: bool = True) -> None:
    """``ws`` becomes a clone of the cached pristine commit, on ``main`` (checked out if asked)."""
    repo = upstream_repo(up)
    if ws.exists() and any(ws.iterdir()):
        raise PatchError(f"{ws}: exists and is not empty; pick a new workspace directory")
    ws.parent.mkdir(parents=True, exist_ok=True)
    git(["clone", "-q", "--local", "--no-checkout", str(repo), str(ws)], ws.parent)
    git(["remote", "remove", "origin"], ws)
    if checkout:
        git(["checkout", "-q", "-B", "main", UPSTREAM_TAG], ws)
    _configure(ws)
    mark(ws, up)


def sparse_base(ws: Path, up: Upstream, paths: list[str]) -> None:
    """``ws`` holds only ``paths`` of the pristine release (those that exist there)."""
    init_repo(ws)
    extract(pinned_wheel(up), ws, only=set(paths))
    git(["add", "-A", "-f", "."], ws)
    git(["commit", "-q", "--allow-empty", "--no-verify", "-m", _subject(up)], ws, env=upstream_env())
    mark(ws, up)


def add_release(ws: Path, up: Upstream, parent: str, branch: str) -> str:
    """Commit ``up``'s pristine tree on top of ``parent`` and check it out as ``branch``.

    The objects are borrowed from the cached repository (git alternates): nothing is copied.
    """
    repo = upstream_repo(up)
    alternates = ws / ".git" / "objects" / "info" / "alternates"
    alternates.parent.mkdir(parents=True, exist_ok=True)
    with alternates.open("a") as f:
        f.write(f"{(repo / 'objects').resolve()}\n")
    tree = git_text(["--git-dir", str(repo), "rev-parse", f"{UPSTREAM_TAG}^{{tree}}"], ws)
    commit = git_text(["commit-tree", tree, "-p", parent, "-m", _subject(up)], ws, env=upstream_env())
    git(["branch", "-f", branch, commit], ws)
    git(["symbolic-ref", "HEAD", f"refs/heads/{branch}"], ws)
    git(["reset", "-q", "--hard"], ws)  # also fills a --no-checkout clone
    mark(ws, up)
    return commit


def remove_workspace(ws: Path) -> None:
    shutil.rmtree(ws, ignore_errors=True)
