"""``check``: the series is consistent, applies to the pristine pin, and is what is installed.

1. every file in ``series`` exists, no unlisted ``*.patch``, no duplicates;
2. the series applies (``git apply``, no fuzz) to the pinned wheel, sha256-verified;
3. the installed sglang's touched files equal pristine + series byte-for-byte.
"""

from __future__ import annotations

from pathlib import Path

from sglang_disagg.patchtool.errors import PatchError
from sglang_disagg.patchtool.model import PatchDir
from sglang_disagg.patchtool.releases import find_installed, pinned_wheel
from sglang_disagg.patchtool.scratch import Scratch, scratch, series_paths


def _apply_pristine(sc: Scratch, pd: PatchDir, lines: list[str]) -> bool:
    up = pd.upstream()
    patches = [pd.root / n for n in pd.series().names]
    sc.extract_from(pinned_wheel(up), series_paths(patches))
    for patch in patches:
        ok, err = sc.try_apply(patch)
        if not ok:
            lines.append(f"FAIL {patch.name} does not apply to pristine sglang {up.version}:\n    "
                         + "\n    ".join(err.splitlines()))
            return False
    lines.append(f"ok   {len(patches)} patch(es) apply cleanly to pristine sglang {up.version} ({up.archive})")
    return True


def _compare_installed(sc: Scratch, pd: PatchDir, site_packages: Path | None, lines: list[str]) -> bool:
    try:
        inst = find_installed(site_packages)
    except PatchError as exc:
        if site_packages is not None:
            raise
        lines.append(f"skip installed copy: {exc}")
        return True
    up = pd.upstream()
    if inst.version != up.version:
        lines.append(f"FAIL installed sglang is {inst.version} ({inst.site_packages}), pinned is {up.version}")
        return False
    paths = series_paths(pd.root / n for n in pd.series().names)
    differ = [p for p in paths if sc.read(p) != _read(inst.site_packages / p)]
    if differ:
        lines.append(f"FAIL installed sglang in {inst.site_packages} differs from pristine + series in:")
        lines += [f"    {p}" for p in differ]
        lines.append("    (run `python -m sglang_disagg.patchtool status` / `apply`)")
        return False
    lines.append(f"ok   installed sglang in {inst.site_packages} matches pristine + series ({len(paths)} file(s))")
    return True


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def run(pd: PatchDir, *, site_packages: Path | None = None, check_installed: bool = True) -> tuple[bool, list[str]]:
    lines: list[str] = []
    up = pd.upstream()
    series = pd.series()
    problems = pd.problems(series)
    if problems:
        lines += [f"FAIL {p}" for p in problems]
        return False, lines
    lines.append(f"ok   series: {len(series.names)} patch(es), all present, none unlisted, pinned sglang {up.version}")
    with scratch() as sc:
        if not _apply_pristine(sc, pd, lines):
            return False, lines
        if check_installed and not _compare_installed(sc, pd, site_packages, lines):
            return False, lines
    return True, lines
