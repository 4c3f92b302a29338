"""Private files (sglang_disagg/private_files.py): a secret or key file is 0600 whatever was at
its path before (a planted symlink is replaced, never followed), in a directory nobody else can
swap it in; and a stopped stack removes those it wrote (stack.py), keeping a secret it was given."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sglang_disagg import private_files
from sglang_disagg.backends.auth import SECRET_FILE_ENV
from sglang_disagg.launch import keys
from sglang_disagg.launch.config import LaunchConfig, Role
from sglang_disagg.launch.stack import Stack

SECRET = "0123456789abcdef" * 4


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_symlink_planted_at_the_path_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    victim.chmod(0o644)
    target = tmp_path / "d" / "secret"
    target.parent.mkdir(mode=0o700)
    target.symlink_to(victim)
    private_files.write(target, "s3cret\n")
    assert victim.read_text() == "someone else's file\n" and mode(victim) == 0o644
    assert not target.is_symlink() and target.read_text() == "s3cret\n" and mode(target) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["secret"]  # no temporary file left


def test_an_older_file_of_another_mode_ends_0600_with_the_new_text_whatever_the_umask(tmp_path):
    target = tmp_path / "api-key"
    target.write_text("an older, longer key that must not show through\n")
    target.chmod(0o644)
    old = os.umask(0o277)
    try:
        private_files.write(target, "new\n")
    finally:
        os.umask(old)
    assert target.read_text() == "new\n" and mode(target) == 0o600


@pytest.mark.parametrize("dir_mode, refused", [(0o700, False), (0o755, False), (0o770, True), (0o757, True),
                                               (0o1777, False)])
def test_a_directory_others_can_rename_entries_in_is_refused(tmp_path, dir_mode, refused):
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(dir_mode)
    if refused:
        with pytest.raises(private_files.PrivateFileError, match=r"writable by .*chmod go-w"):
            private_files.write(d / "secret", "x\n")
        assert not list(d.iterdir())
    else:
        assert mode(private_files.write(d / "secret", "x\n")) == 0o600


def test_a_directory_of_another_user_is_refused(tmp_path):
    st = os.stat(tmp_path)
    theirs = os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, os.geteuid() + 4242, st.st_gid,
                             st.st_size, 0, 0, 0))
    with pytest.raises(private_files.PrivateFileError, match=f"owned by uid {os.geteuid() + 4242}"):
        private_files.check_dir(theirs, tmp_path)
    private_files.check_dir(st, tmp_path)  # ours


def test_a_path_that_cannot_be_written_says_which_and_leaves_nothing(tmp_path):
    (tmp_path / "secret").mkdir()
    with pytest.raises(private_files.PrivateFileError, match=r"secret: cannot write this private file"):
        private_files.write(tmp_path / "secret", "x\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]
    assert private_files.make_dir(tmp_path / "new" / "logs").stat().st_mode & 0o077 == 0


def _stack(tmp_path: Path, **kw) -> Stack:
    """--role all bound beyond loopback: a secret (unless given) and keys, no server started."""
    return Stack.for_config(LaunchConfig(**{"role": Role.ALL, "model": "tiny-llama", "host": "10.0.0.1",
                                            "log_dir": str(tmp_path / "logs")} | kw))


KEY_FILES = ["admin-key", "api-key", "decode.keys.yaml", "prefill.keys.yaml"]


def test_a_stopped_stack_removes_the_key_files_and_the_secret_it_made(tmp_path):
    stack = _stack(tmp_path)
    logs = tmp_path / "logs"
    made = sorted(p.name for p in stack.private_paths)
    assert made == sorted(KEY_FILES + ["secret"]) and all(mode(p) == 0o600 for p in stack.private_paths)
    assert dict(stack.servers[0].spec.env)[SECRET_FILE_ENV] == str(logs / "secret")
    (logs / "prefill.log").write_text("kept\n")
    stack.stop()
    assert sorted(p.name for p in logs.iterdir()) == ["prefill.log"]  # logs stay
    stack.stop()  # twice is fine


def test_a_stopped_stack_keeps_the_secret_file_it_was_given(tmp_path):
    given = tmp_path / "logs" / "secret"  # even where the stack would put its own
    given.parent.mkdir(mode=0o700)
    given.write_text(SECRET + "\n")
    stack = _stack(tmp_path, secret_file=str(given))
    assert sorted(p.name for p in stack.private_paths) == KEY_FILES
    assert stack.keys == keys.HttpKeys.derive(SECRET.encode())
    stack.stop()
    assert sorted(p.name for p in given.parent.iterdir()) == ["secret"] and given.read_text() == SECRET + "\n"


def test_a_stack_refused_after_making_its_secret_leaves_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        _stack(tmp_path, model=str(tmp_path / "no-model"))
    assert not list((tmp_path / "logs").iterdir())
