"""A scratch copy of just the files a series touches, to apply/reverse patches on safely.

Patches are tried on the scratch copy (``git apply`` with an isolated GIT_DIR, so an
enclosing repository cannot make git skip files), and only the final result is written
back to site-packages: an apply either happens completely or not at all.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sglang_disagg.patchtool.gitutil import git, isolated_apply_env
from sglang_disagg.patchtool.model import touched_paths
from sglang_disagg.patchtool.releases import extract


def series_paths(patches: Iterable[Path]) -> list[str]:
    """Union of the files touched by the patches, relative to site-packages, in first-seen order."""
    out: list[str] = []
    for patch in patches:
        for p in touched_paths(patch.read_text(errors="replace")):
            if p not in out:
                out.append(p)
    return out


class Scratch:
    """A temporary tree holding copies of selected files (relative paths as in site-packages)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tree = root / "tree"
        self.tree.mkdir()
        self._env = isolated_apply_env(root / "git", self.tree)

    def copy_from(self, src_root: Path, paths: Iterable[str]) -> None:
        for rel in paths:
            src = src_root / rel
            if src.is_file():
                dst = self.tree / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)

    def extract_from(self, wheel: Path, paths: Iterable[str]) -> None:
        extract(wheel, self.tree, only=set(paths))

    def try_apply(self, patch: Path, *, reverse: bool = False, check_only: bool = False) -> tuple[bool, str]:
        args = ["apply", "--whitespace=nowarn"]
        args += ["--reverse"] if reverse else []
        args += ["--check"] if check_only else []
        proc = git([*args, str(patch.resolve())], self.tree, env=self._env, check=False)
        return proc.returncode == 0, proc.stderr.decode(errors="replace").strip()

    def read(self, rel: str) -> bytes | None:
        path = self.tree / rel
        return path.read_bytes() if path.is_file() else None

    def sync_to(self, dest_root: Path, paths: Iterable[str]) -> list[str]:
        """Make ``dest_root``'s copies of ``paths`` equal to the scratch ones; returns changed paths."""
        changed: list[str] = []
        for rel in paths:
            src, dst = self.tree / rel, dest_root / rel
            if src.is_file():
                if dst.is_file() and dst.read_bytes() == src.read_bytes():
                    continue
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = dst.with_name(dst.name + ".sglang-disagg-tmp")
                shutil.copyfile(src, tmp)
                shutil.copymode(src, tmp)
                tmp.replace(dst)
                changed.append(rel)
            elif dst.exists():
                dst.unlink()
                changed.append(rel)
        return changed


@contextmanager
def scratch() -> Iterator[Scratch]:
    with tempfile.TemporaryDirectory(prefix="sglang-disagg-scratch-") as tmp:
        yield Scratch(Path(tmp))
