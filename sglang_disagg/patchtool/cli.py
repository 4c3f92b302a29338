"""Command line: ``python -m sglang_disagg.patchtool {apply,status,check,workspace,export,rebase}``."""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

from sglang_disagg.patchtool import installed, workspace
from sglang_disagg.patchtool.errors import PatchError
from sglang_disagg.patchtool.model import PatchDir, Series
from sglang_disagg.patchtool.releases import find_installed
from sglang_disagg.patchtool.repos import UPSTREAM_TAG


def _find_repo_root() -> Path:
    for base in (Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[2]):
        if (base / "patches" / "UPSTREAM").is_file():
            return base
    raise PatchError("cannot find the repository (a directory with patches/UPSTREAM); pass --repo-root")


def _patch_dir(args: argparse.Namespace) -> PatchDir:
    if args.patches_dir:
        return PatchDir(Path(args.patches_dir).resolve())
    root = Path(args.repo_root).resolve() if args.repo_root else _find_repo_root()
    return PatchDir(root / "patches")


def _repo_root(args: argparse.Namespace, pd: PatchDir) -> Path:
    return Path(args.repo_root).resolve() if args.repo_root else pd.root.parent


def cmd_apply(args: argparse.Namespace) -> int:
    pd = _patch_dir(args)
    act = installed.revert if args.revert else installed.apply
    for line in act(find_installed(_opt_path(args.site_packages)), pd):
        print(line)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    pd = _patch_dir(args)
    report = installed.status(find_installed(_opt_path(args.site_packages)), pd)
    print("\n".join(report.lines()))
    return 0 if report.all_applied and report.installed.version == report.pinned_version else 1


def cmd_workspace(args: argparse.Namespace) -> int:
    pd = _patch_dir(args)
    ws = Path(args.dir).resolve()
    up = pd.upstream()
    n = len(pd.series().names)
    if args.version and args.version != up.version:  # the series replayed 3-way, as rebase does
        from sglang_disagg.patchtool import rebase
        from sglang_disagg.patchtool.releases import fetch_release

        target = fetch_release(args.version)
        stopped = rebase.replay(ws, pd, target)
        if stopped:
            raise PatchError(f"{stopped}\nworkspace {ws} kept: resolve, `git add`, `git am --continue`")
        print(f"workspace {ws}: sglang {target.version} + {n} patch commit(s) replayed from the pinned {up.version}")
        print(f"to move the pin there: python -m sglang_disagg.patchtool rebase --continue --workspace {ws}")
        return 0
    workspace.create(ws, up, pd.patch_paths())
    print(f"workspace {ws}: sglang {up.version} + {n} patch commit(s) on top of tag '{UPSTREAM_TAG}'")
    print(f"edit with git there, then: python -m sglang_disagg.patchtool export --from {ws}")
    return 0


def _diff_export(pd: PatchDir, exported: workspace.Exported) -> list[str]:
    """Unified diffs between the committed patches/series and what export would write."""
    out: list[str] = []
    want = dict(exported.patches)
    have = {p.name: p.read_bytes() for p in pd.root.glob("*.patch")}
    want_series = Series(exported.names, pd.series().header).dump()
    pairs = [("series", pd.series_path.read_text() if pd.series_path.is_file() else "", want_series)]
    pairs += [(n, have.get(n, b"").decode(errors="replace"), want.get(n, b"").decode(errors="replace"))
              for n in sorted(set(want) | set(have)) if have.get(n) != want.get(n)]
    for name, old, new in pairs:
        if old != new:
            out += difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        f"patches/{name} (committed)", f"patches/{name} (export)")
    return out


def cmd_export(args: argparse.Namespace) -> int:
    pd = _patch_dir(args)
    up = pd.upstream()
    if args.from_dir:
        ws = Path(args.from_dir).resolve()
        ws_up = workspace.workspace_upstream(ws)
        if ws_up.version != up.version:
            raise PatchError(
                f"workspace {ws} is based on sglang {ws_up.version} but patches/UPSTREAM pins {up.version}; "
                f"to move the pin use `python -m sglang_disagg.patchtool rebase --continue --workspace {ws}`"
            )
        exported = workspace.export(ws)
    elif args.check:
        with tempfile.TemporaryDirectory(prefix="sglang-disagg-export-check-") as tmp:
            ws = Path(tmp) / "ws"
            workspace.create(ws, up, pd.patch_paths(), sparse=True)
            exported = workspace.export(ws)
    else:
        raise PatchError("export needs --from WORKSPACE (or --check to verify the committed patches)")
    for warning in exported.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.check:
        diff = _diff_export(pd, exported)
        if diff:
            sys.stdout.writelines(diff)
            raise PatchError(
                "committed patches differ from what export writes (stale or hand-edited); "
                "edit patches in a workspace and export (see patches/README.md)"
            )
        print(f"export --check: {len(exported.names)} patch(es) up to date")
        return 0
    series = pd.series() if pd.series_path.is_file() else Series(())
    changes = workspace.write_export(exported, pd.root, series)
    print("\n".join(changes) if changes else "no changes")
    print(f"series: {len(exported.names)} patch(es) in {pd.root}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from sglang_disagg.patchtool import check

    pd = _patch_dir(args)
    sp = None if args.no_installed else _opt_path(args.site_packages)
    ok, lines = check.run(pd, site_packages=sp, check_installed=not args.no_installed)
    print("\n".join(lines))
    return 0 if ok else 1


def cmd_rebase(args: argparse.Namespace) -> int:
    from sglang_disagg.patchtool import rebase

    pd = _patch_dir(args)
    root = _repo_root(args, pd)
    if args.cont:
        if not args.workspace:
            raise PatchError("rebase --continue needs --workspace DIR (printed when the rebase stopped)")
        lines = rebase.finish(Path(args.workspace).resolve(), pd, root, args.no_changelog)
    else:
        if not args.to:
            raise PatchError("rebase needs --to VERSION (or --continue --workspace DIR)")
        if args.dry_run:
            ok, lines = rebase.dry_run(args.to, pd)
            print("\n".join(lines))
            return 0 if ok else 1
        ws = Path(args.workspace).resolve() if args.workspace else None
        lines = rebase.start(args.to, pd, root, ws, args.no_changelog)
    print("\n".join(lines))
    return 0


def _opt_path(value: str | None) -> Path | None:
    return Path(value) if value else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_disagg.patchtool", description=__doc__)
    p.add_argument("--repo-root", help="repository root (default: found from cwd; has patches/UPSTREAM)")
    p.add_argument("--patches-dir", help="patch directory (default: REPO_ROOT/patches)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("apply", help="apply the series to the installed sglang (idempotent)")
    s.add_argument("--site-packages", help="directory holding sglang/ (default: the importable one)")
    s.add_argument("--revert", action="store_true", help="un-apply instead: restore the pristine files")
    s.set_defaults(func=cmd_apply)

    s = sub.add_parser("status", help="per patch: applied / not applied / conflicting (exit 1 unless all applied)")
    s.add_argument("--site-packages", help="directory holding sglang/ (default: the importable one)")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("check", help="series consistent, applies to pristine pin, installed copy matches")
    s.add_argument("--site-packages", help="directory holding sglang/ (default: the importable one)")
    s.add_argument("--no-installed", action="store_true", help="skip comparing with the installed sglang")
    s.set_defaults(func=cmd_check)

    s = sub.add_parser("workspace", help="create a git workspace: pristine sglang + series as commits")
    s.add_argument("dir", help="new directory for the workspace")
    s.add_argument("--version", help="sglang version (default: the pinned one)")
    s.set_defaults(func=cmd_workspace)

    s = sub.add_parser("export", help="write patches/*.patch + series from a workspace's commits")
    s.add_argument("--from", dest="from_dir", help="workspace directory")
    s.add_argument("--check", action="store_true", help="fail with a diff if committed patches are stale")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("rebase", help="move the series to another sglang release (3-way)")
    s.add_argument("--to", help="target sglang version")
    s.add_argument("--workspace", help="workspace directory (default: a new temp dir; kept on conflict)")
    s.add_argument("--continue", dest="cont", action="store_true", help="finish after resolving a conflict")
    s.add_argument("--no-changelog", action="store_true", help="do not add a CHANGELOG.md line")
    s.add_argument("--dry-run", action="store_true",
                   help="only report which patches apply to --to (clean / 3-way / conflict); change nothing")
    s.set_defaults(func=cmd_rebase)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except PatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # permissions, disk full, ...: still an expected failure, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
