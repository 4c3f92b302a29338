"""``apply`` and ``status``: the patch series against an installed SGLang.

State of each patch is found by walking the series backwards on a scratch copy of the
touched files: a patch that reverse-applies is *applied* (and is reversed, to look at the
one before it), one that forward-applies is *not applied*, anything else is *conflicting*
(unless nothing is applied and the series applies in order: a patch may build on the lines of
an earlier one).
After a successful apply a marker ``sglang/.sglang_disagg_patches.json`` records the series
digest and the resulting file hashes, so ``status`` can answer without running git.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import py_compile
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from sglang_disagg.patchtool.errors import PatchError
from sglang_disagg.patchtool.model import PatchDir
from sglang_disagg.patchtool.releases import Installed, require_version
from sglang_disagg.patchtool.scratch import Scratch, scratch, series_paths

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


def _write_marker(inst: Installed, pd: PatchDir, patches: list[Path], paths: list[str]) -> None:
    data = {
        "tool": "python -m sglang_disagg.patchtool",
        "upstream_version": pd.upstream().version,
        "series_digest": pd.digest(),
        "patches": [p.name for p in patches],
        "files": _file_hashes(inst.site_packages, paths),
        "patch_texts": {p.name: p.read_text() for p in patches},
    }
    _marker_path(inst).write_text(json.dumps(data, indent=2) + "\n")


def _recorded_series(inst: Installed, where: Path) -> list[Path] | None:
    """The series a previous ``apply`` recorded, written to ``where``, if the files are untouched since."""
    try:
        data = json.loads(_marker_path(inst).read_text())
        names, texts, files = data["patches"], data["patch_texts"], data["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, dict) or files != _file_hashes(inst.site_packages, list(files)):
        return None
    if any(not isinstance(n, str) or "/" in n or n.startswith(".") or n not in texts for n in names):
        return None
    out = []
    for name in names:
        (where / name).write_text(texts[name])
        out.append(where / name)
    return out


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
        if all(state is not State.APPLIED for _, state in states) and all(
                sc.try_apply(patch)[0] for patch in patches):
            # Nothing is applied and the series applies in order: a patch that read as
            # conflicting only needs the ones before it (its context is theirs).
            states = [(name, State.NOT_APPLIED) for name, _ in states]
    return Report(inst, pinned, tuple(reversed(states)), False)


def status(inst: Installed, pd: PatchDir) -> Report:
    return analyze(inst, pd)


def _to_pristine(sc: Scratch, inst: Installed, report: Report, patches: list[Path]) -> list[str]:
    """Copy the touched files into ``sc`` and reverse whatever series is applied; returns all paths.

    ``patches`` is the current series; when it is only partly there, the series recorded by the
    previous ``apply`` is reversed instead (if the files are as that apply left them).
    """
    paths = series_paths(patches)
    if report.none_applied:
        sc.copy_from(inst.site_packages, paths)
        return paths
    previous = patches if report.all_applied else _recorded_series(inst, sc.root)
    if previous is None:
        raise PatchError(
            "the installed sglang is partially patched or modified (and not as a previous apply left it); "
            "not touching it:\n" + "\n".join(report.lines()[1:])
            + f"\nrestore it with `pip install --force-reinstall --no-deps sglang=={inst.version}`, then apply again"
        )
    all_paths = list(dict.fromkeys([*paths, *series_paths(previous)]))
    sc.copy_from(inst.site_packages, all_paths)
    for patch in reversed(previous):
        ok, err = sc.try_apply(patch, reverse=True)
        if not ok:
            raise PatchError(f"cannot un-apply the previously applied {patch.name}:\n{err}")
    return all_paths


def apply(inst: Installed, pd: PatchDir) -> list[str]:
    """Apply the whole series to ``inst``; returns messages. Idempotent; all-or-nothing.

    A copy patched by an earlier ``apply`` with another series (recorded in the marker, files
    untouched since) is first restored to pristine, then patched with the current series.
    """
    up = pd.upstream()
    require_version(inst, up)
    patches = pd.patch_paths()
    paths = series_paths(patches)
    report = analyze(inst, pd)
    where = f"sglang {inst.version} in {inst.site_packages}"
    if report.all_applied:
        if not report.marker_ok and patches:
            _write_marker(inst, pd, patches, paths)
        _refresh_bytecode(inst.site_packages, paths)
        return [f"already applied: {len(patches)} patch(es) on {where}"]
    with scratch() as sc:
        all_paths = _to_pristine(sc, inst, report, patches)
        for patch in patches:
            ok, err = sc.try_apply(patch)
            if not ok:
                raise PatchError(f"{patch.name} does not apply after the patches before it:\n{err}")
        changed = sc.sync_to(inst.site_packages, all_paths)
    _refresh_bytecode(inst.site_packages, all_paths)
    _write_marker(inst, pd, patches, paths)
    verb = "applied" if report.none_applied else "replaced the previously applied series with"
    return [f"{verb} {len(patches)} patch(es) on {where}"] + [f"  {p}" for p in changed]


def _refresh_bytecode(site_packages: Path, paths: list[str]) -> None:
    """Rewrite the cached bytecode of the patched modules. Otherwise their .pyc from the wheel
    is stale, and with PYTHONDONTWRITEBYTECODE (set in many containers) every SGLang process
    of every server compiles ~1.5 MB of patched source again at start-up."""
    for rel in paths:
        src = site_packages / rel
        if src.suffix == ".py" and src.exists():
            py_compile.compile(str(src), cfile=importlib.util.cache_from_source(str(src)), doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


def revert(inst: Installed, pd: PatchDir) -> list[str]:
    """Restore the pristine files: un-apply the current series, or the one the marker recorded."""
    patches = pd.patch_paths()
    report = analyze(inst, pd)
    with scratch() as sc:
        all_paths = _to_pristine(sc, inst, report, patches)
        changed = sc.sync_to(inst.site_packages, all_paths)
    _refresh_bytecode(inst.site_packages, all_paths)
    _marker_path(inst).unlink(missing_ok=True)
    return [f"reverted: sglang {inst.version} in {inst.site_packages} is pristine"] + [f"  {p}" for p in changed]
