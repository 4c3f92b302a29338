"""Running git reproducibly: no user/system config, fixed identities, fixed diff settings.

Every git call of the tool goes through :func:`git`, so the output of ``format-patch`` does
not depend on who runs it (``format.signoff``, ``diff.noprefix``, ``core.abbrev`` ...).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from sglang_disagg.patchtool.errors import PatchError

# Identity and date of the synthetic "Upstream sglang X" commits (deterministic hashes).
UPSTREAM_AUTHOR = ("SGLang upstream", "upstream@sglang.invalid")
UPSTREAM_DATE = "2000-01-01T00:00:00+0000"
# Committer identity inside throw-away workspaces (never exported: format-patch keeps authors).
WORKSPACE_COMMITTER = ("sglang-disagg patches", "patches@sglang-disagg.invalid")

# Settings that influence what git writes or reads, pinned for every call.
PINNED_CONFIG: tuple[tuple[str, str], ...] = (
    ("core.abbrev", "12"),
    ("core.autocrlf", "false"),
    ("core.safecrlf", "false"),
    ("core.filemode", "true"),
    ("core.quotepath", "true"),
    ("core.looseCompression", "1"),
    ("diff.noprefix", "false"),
    ("diff.mnemonicPrefix", "false"),
    ("diff.relative", "false"),
    ("diff.renames", "true"),
    ("diff.algorithm", "myers"),
    ("diff.context", "3"),
    ("diff.interHunkContext", "0"),
    ("diff.suppressBlankEmpty", "false"),
    ("diff.statGraphWidth", "20"),
    ("format.signature", ""),
    ("format.signOff", "false"),
    ("format.numbered", "false"),
    ("format.coverLetter", "false"),
    ("format.thread", "false"),
    ("am.threeWay", "true"),
    ("am.keepcr", "true"),
    ("apply.whitespace", "nowarn"),
    ("commit.gpgSign", "false"),
    ("init.defaultBranch", "main"),
    ("advice.detachedHead", "false"),
    ("gc.auto", "0"),
    ("i18n.commitEncoding", "UTF-8"),
    ("i18n.logOutputEncoding", "UTF-8"),
)


def git_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        GIT_COMMITTER_NAME=WORKSPACE_COMMITTER[0],
        GIT_COMMITTER_EMAIL=WORKSPACE_COMMITTER[1],
        LC_ALL="C",
        LANG="C",
        TZ="UTC",
    )
    if extra:
        env.update(extra)
    return env


def git(
    args: Sequence[str],
    cwd: Path,
    *,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    input_bytes: bytes | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``git <args>`` in ``cwd`` with pinned config; raise PatchError on failure if ``check``."""
    cmd = ["git"]
    for key, value in PINNED_CONFIG:
        cmd += ["-c", f"{key}={value}"]
    cmd += list(args)
    proc = subprocess.run(cmd, cwd=cwd, env=git_env(env), input=input_bytes, capture_output=True)
    if check and proc.returncode != 0:
        out = (proc.stdout + proc.stderr).decode(errors="replace").strip()
        raise PatchError(f"git {' '.join(args[:2])} failed in {cwd}:\n{out}")
    return proc


def git_text(args: Sequence[str], cwd: Path, **kw: object) -> str:
    return git(args, cwd, **kw).stdout.decode().strip()  # type: ignore[arg-type]


def isolated_apply_env(scratch_git_dir: Path, work_tree: Path) -> dict[str, str]:
    """Environment for ``git apply`` on a plain directory that may sit inside another work tree.

    Plain ``git apply`` run inside some enclosing repository (e.g. ``.venv`` inside the project
    checkout) resolves paths against that repository and silently skips files outside the
    current directory. Pointing GIT_DIR at an empty scratch repository and GIT_WORK_TREE at
    the target directory makes the target the root, whatever encloses it.
    """
    if not (scratch_git_dir / "HEAD").exists():
        scratch_git_dir.mkdir(parents=True, exist_ok=True)
        git(["init", "-q", "--bare", str(scratch_git_dir)], cwd=scratch_git_dir)
    return {"GIT_DIR": str(scratch_git_dir), "GIT_WORK_TREE": str(work_tree)}
