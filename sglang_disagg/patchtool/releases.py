"""SGLang release wheels: the download cache, sha256 checks, unpacking, installed versions.

Wheels are fetched with ``pip download --no-deps --only-binary=:all:`` (never installed) into
``$SGLANG_DISAGG_CACHE/sglang-releases/`` (default ``~/.cache/sglang-disagg``); a wheel already
in the cache is used without touching the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import stat
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sglang_disagg.patchtool.errors import PatchError
from sglang_disagg.patchtool.model import Upstream

PACKAGE = "sglang"
CACHE_ENV = "SGLANG_DISAGG_CACHE"


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "sglang-disagg")
    path = Path(root) / "sglang-releases"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _wheel_glob(version: str) -> list[Path]:
    return sorted(cache_dir().glob(f"{PACKAGE}-{version}-*.whl"))


_SAVED_RE = re.compile(r"^(?:Saved|File was already downloaded) (.+\.whl)\s*$", re.M)


def _pip_download(version: str) -> Path:
    """``pip download`` the wheel pip would install here; returns its path in the cache."""
    cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={version}", "--no-deps",
           "--only-binary=:all:", "--disable-pip-version-check", "--progress-bar", "off",
           "-d", str(cache_dir())]
    print(f"downloading {PACKAGE}=={version} wheel into {cache_dir()} ...", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
        detail = "\n".join(line[:300] + (" ..." if len(line) > 300 else "")
                           for line in errors or proc.stderr.splitlines()[-10:])
        raise PatchError(f"pip download {PACKAGE}=={version} failed:\n{detail}")
    m = _SAVED_RE.search(proc.stdout)
    path = Path(m.group(1).strip()) if m else None
    if path is None or not path.is_file():
        wheels = _wheel_glob(version)
        if len(wheels) != 1:
            raise PatchError(f"pip download {PACKAGE}=={version}: cannot tell which wheel it fetched")
        path = wheels[0]
    return path


def fetch_release(version: str) -> Upstream:
    """The wheel of ``version`` from the cache, downloading it if needed; returns its pin.

    With several wheels of that version in the cache (other platforms), pip decides.
    """
    wheels = _wheel_glob(version)
    wheel = wheels[0] if len(wheels) == 1 else _pip_download(version)
    return Upstream(PACKAGE, version, wheel.name, sha256_file(wheel))


def pinned_wheel(up: Upstream) -> Path:
    """The pinned wheel from the cache (downloaded if needed), verified against its sha256."""
    path = cache_dir() / up.archive
    if not path.is_file():
        _pip_download(up.version)
    if not path.is_file():
        raise PatchError(
            f"pip did not produce {up.archive} (pinned in UPSTREAM) in {cache_dir()}; "
            "the pin names a wheel for another platform or Python?"
        )
    actual = sha256_file(path)
    if actual != up.sha256:
        raise PatchError(
            f"{path}: sha256 {actual} does not match UPSTREAM sha256 {up.sha256}; "
            "delete the file to re-download, or fix the pin"
        )
    return path


def _is_package_member(name: str) -> bool:
    return name.startswith(PACKAGE + "/") and ".dist-info/" not in name


def extract(wheel: Path, dest: Path, only: set[str] | None = None) -> list[str]:
    """Unpack the ``sglang/`` files of ``wheel`` into ``dest`` (exec bits as pip sets them).

    ``only`` restricts to those member paths (missing ones are ignored); returns extracted names.
    """
    done: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or not _is_package_member(name) or (only is not None and name not in only):
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, target.open("wb") as out:
                while block := src.read(1 << 20):
                    out.write(block)
            if (info.external_attr >> 16) & 0o111:
                target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            done.append(name)
    return done


# --- installed SGLang -------------------------------------------------------------------------

_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


@dataclass(frozen=True)
class Installed:
    """An SGLang installation: the site-packages directory holding ``sglang/``, and its version."""

    site_packages: Path
    version: str

    @property
    def package_dir(self) -> Path:
        return self.site_packages / PACKAGE


def default_site_packages() -> Path:
    """site-packages of the ``sglang`` importable by this interpreter (without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(
            f"no importable '{PACKAGE}' for {sys.executable}; install it or pass --site-packages DIR"
        )
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def installed_version(site_packages: Path) -> str:
    """Version from ``sglang-*.dist-info/METADATA``, else from ``sglang/_version.py``/``version.py``."""
    for dist in sorted(site_packages.glob(f"{PACKAGE}-*.dist-info")):
        meta = dist / "METADATA"
        if meta.is_file():
            for line in meta.read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
                if not line:
                    break
    for name in ("_version.py", "version.py"):
        path = site_packages / PACKAGE / name
        if path.is_file():
            m = _VERSION_RE.search(path.read_text(errors="replace"))
            if m:
                return m.group(1)
    raise PatchError(f"cannot tell the {PACKAGE} version installed in {site_packages}")


def find_installed(site_packages: Path | None) -> Installed:
    sp = (site_packages or default_site_packages()).resolve()
    if not (sp / PACKAGE).is_dir():
        raise PatchError(f"{sp}: no '{PACKAGE}' package directory there")
    return Installed(sp, installed_version(sp))


def require_version(inst: Installed, up: Upstream) -> None:
    if inst.version != up.version:
        raise PatchError(
            f"installed {PACKAGE} is {inst.version} ({inst.site_packages}), but the patch series is "
            f"pinned to {up.version} (patches/UPSTREAM); install {PACKAGE}=={up.version} or rebase "
            f"the series with `python -m sglang_disagg.patchtool rebase --to {inst.version}`",
            exit_code=2,
        )
