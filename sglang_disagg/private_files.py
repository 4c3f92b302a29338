"""Files only their owner may read (a secret, a key, a config file holding keys), written so
that nobody else on the machine can read them, redirect them or swap them.

``write(path, text)``: the text goes to a fresh name beside `path` (``O_CREAT|O_EXCL|O_NOFOLLOW``,
mode 0600, ``fchmod`` 0600 whatever the umask), is fsynced, then renamed onto `path` with
``os.replace``: a symlink planted at `path` is replaced, never followed; an older file at `path`
is replaced whole, so no older mode or owner survives. Every step is relative to the
directory's file descriptor, so a path component swapped halfway does not redirect the rest.

The directory must be ours (or root's) and writable by no one else unless sticky (like /tmp):
whoever can rename entries in it can swap the file after it is written. ``PrivateFileError``
names the directory and the way out otherwise. ``make_dir`` makes a directory for such files
(0700, whatever the umask).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

MODE = 0o600


class PrivateFileError(ValueError):
    """The directory of a private file is not safe to write it in, or the file cannot be
    written there (the launcher says so and exits 2, as for any refused configuration)."""


def make_dir(path: str | Path) -> Path:
    """`path` as a directory: made 0700 if missing (parents with the umask's mode); an existing
    one is left as it is (``write`` checks it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    if not path.is_dir():
        raise PrivateFileError(f"{path}: not a directory")
    return path


def check_dir(st: os.stat_result, where: str | Path) -> None:
    """Refuse a directory that someone else could rename entries in."""
    if st.st_uid not in (os.geteuid(), 0):
        raise PrivateFileError(f"{where}: owned by uid {st.st_uid}, not by this user; a private file there could be "
                               f"replaced by its owner: choose a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        who = "anyone" if st.st_mode & stat.S_IWOTH else "its group"
        raise PrivateFileError(f"{where}: writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}), so a private file "
                               f"there could be swapped: `chmod go-w {where}` or choose another directory")


def write(path: str | Path, text: str) -> Path:
    """Write `text` to `path`, mode 0600, replacing whatever is there (a symlink included, not
    followed). Raises PrivateFileError naming the path and the reason."""
    path = Path(path)
    try:
        return _write(path, text)
    except OSError as e:
        raise PrivateFileError(f"{path}: cannot write this private file: {e.strerror or e}") from None


def _write(path: Path, text: str) -> Path:
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        check_dir(os.fstat(dir_fd), path.parent)
        tmp = f".{path.name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, MODE, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), MODE)  # the umask may have taken bits away (0400 under umask 0277)
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
    return path


def remove(paths: list[Path]) -> None:
    """Remove what a run wrote; one already gone is fine."""
    for p in paths:
        p.unlink(missing_ok=True)
