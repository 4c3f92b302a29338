"""``apply`` and ``status``: the patch series against an installed SGLang.

State of each patch is found by walking the series backwards on a scratch copy of the
touched files: a patch that reverse-applies is *applied* (and is reversed, to look at the
one before it), one that forward-applies is *not applied*, anything else is *conflicting*.
After a successful apply a marker ``sglang/.sglang_disagg_patches.json`` records the series
digest and the resulting file hashes, so ``status`` can answer without running git.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from sglang_disagg.patches.errors import PatchError
from sglang_disagg.patches.model import PatchDir
from sglang_disagg.patches.releases import Installed, require_version
from sglang_disagg.patches.scratch import scratch, series_paths

MARKER = ".sglang_disagg_patches.json"


class State(StrEnum):
    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    CONFLICTING = "conflicting"


@dataclass(frozen=True)
class Report:
    installed: Installed
    pinned_version: str
    states: tuple[tuple[str, State], ...]
    marker_ok: bool

    @property
    def all_applied(self) -> bool:
        return all(s is State.APPLIED for _, s in self.states)

    @property
    def none_applied(self) -> bool:
        return all(s is State.NOT_APPLIED for _, s in self.states)

    def lines(self) -> list[str]:
        inst = self.installed
        match = "matches" if inst.version == self.pinned_version else "DIFFERS from"
        out = [f"installed sglang {inst.version} at {inst.site_packages} ({match} pinned {self.pinned_version})"]
        if not self.states:
            out.append("series is empty")
        out += [f"  {state.value:<12} {name}" for name, state in self.states]
        if self.marker_ok:
            out.append(f"marker {MARKER}: up to date")
        return out


def _file_hashes(root: Path, paths: list[str]) -> dict[str, str | None]:
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() if (root / p).is_file() else None for p in paths}


def _marker_path(inst: Installed) -> Path:
    return inst.package_dir / MARKER


def _marker_matches(inst: Installed, pd: PatchDir, paths: list[str]) -> bool:
    try:
        data = json.loads(_marker_path(inst).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("series_digest") == pd.digest()
        and data.get("files") == _file_hashes(inst.site_packages, paths)
    )


def _write_marker(inst: Installed, pd: PatchDir, names: list[str], paths: list[str]) -> None:
    data = {
        "tool": "python -m sglang_disagg.patches",
        "upstream_version": pd.upstream().version,
        "series_digest": pd.digest(),
        "patches": names,
        "files": _file_hashes(inst.site_packages, paths),
    }
    _marker_path(inst).write_text(json.dumps(data, indent=2) + "\n")


def analyze(inst: Installed, pd: PatchDir, *, use_marker: bool = True) -> Report:
    patches = pd.patch_paths()
    paths = series_paths(patches)
    pinned = pd.upstream().version
    if use_marker and patches and _marker_matches(inst, pd, paths):
        return Report(inst, pinned, tuple((p.name, State.APPLIED) for p in patches), True)
    states: list[tuple[str, State]] = []
    with scratch() as sc:
        sc.copy_from(inst.site_packages, paths)
        for patch in reversed(patches):
            if sc.try_apply(patch, reverse=True, check_only=True)[0]:
                sc.try_apply(patch, reverse=True)
                states.append((patch.name, State.APPLIED))
            elif sc.try_apply(patch, check_only=True)[0]:
                states.append((patch.name, State.NOT_APPLIED))
            else:
                states.append((patch.name, State.CONFLICTING))
    return Report(inst, pinned, tuple(reversed(states)), False)


def status(inst: Installed, pd: PatchDir) -> Report:
    return analyze(inst, pd)


def apply(inst: Installed, pd: PatchDir) -> list[str]:
    """Apply the whole series to ``inst``; returns messages. Idempotent; all-or-nothing."""
    up = pd.upstream()
    require_version(inst, up)
    patches = pd.patch_paths()
    paths = series_paths(patches)
    report = analyze(inst, pd)
    names = [p.name for p in patches]
    if report.all_applied:
        if not report.marker_ok and patches:
            _write_marker(inst, pd, names, paths)
        return [f"already applied: {len(patches)} patch(es) on sglang {inst.version} in {inst.site_packages}"]
    if not report.none_applied:
        raise PatchError(
            "the installed sglang is partially patched or modified; not touching it:\n"
            + "\n".join(report.lines()[1:])
            + f"\nrestore it with `pip install --force-reinstall --no-deps sglang=={up.version}`, then apply again",
        )
    with scratch() as sc:
        sc.copy_from(inst.site_packages, paths)
        for patch in patches:
            ok, err = sc.try_apply(patch)
            if not ok:
                raise PatchError(f"{patch.name} does not apply after the patches before it:\n{err}")
        changed = sc.sync_to(inst.site_packages, paths)
    _write_marker(inst, pd, names, paths)
    return [f"applied {len(patches)} patch(es) to sglang {inst.version} in {inst.site_packages}"] + [
        f"  {p}" for p in changed
    ]
