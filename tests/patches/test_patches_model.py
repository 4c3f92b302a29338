"""Parsing of patches/UPSTREAM, patches/series and git patch headers."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_disagg.patchtool.errors import PatchError
from sglang_disagg.patchtool.model import Series, Upstream, touched_paths

SHA = "0" * 64


def test_upstream_round_trip(tmp_path: Path) -> None:
    up = Upstream("sglang", "0.5.23", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl", SHA)
    up.save(tmp_path / "UPSTREAM")
    assert (tmp_path / "UPSTREAM").read_text().splitlines()[0] == "package=sglang"
    assert Upstream.load(tmp_path / "UPSTREAM") == up


@pytest.mark.parametrize("text, message", [
    ("package=sglang\nversion=1\narchive=x.whl\n", "missing keys: sha256"),
    ("package=sglang\nversion=1\narchive=x.whl\nsha256=abc\n", "64 lowercase hex"),
    ("package sglang\n", "expected key=value"),
])
def test_upstream_errors(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "UPSTREAM").write_text(text)
    with pytest.raises(PatchError, match=message):
        Upstream.load(tmp_path / "UPSTREAM")


def test_series_parse_keeps_header_and_skips_comments() -> None:
    s = Series.parse("# head 1\n# head 2\n\na.patch\n# later comment\n\nb.patch\na.patch\n")
    assert s.names == ("a.patch", "b.patch", "a.patch")
    assert s.header == "# head 1\n# head 2\n"
    assert s.duplicates() == ["a.patch"]
    assert s.dump() == "# head 1\n# head 2\na.patch\nb.patch\na.patch\n"
    with pytest.raises(PatchError, match=r"expected a \*\.patch file name"):
        Series.parse("dir/a.patch\n")


def test_touched_paths() -> None:
    patch = (
        "diff --git a/sglang/a.py b/sglang/a.py\n--- a/sglang/a.py\n+++ b/sglang/a.py\n"
        "diff --git a/sglang/new.py b/sglang/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/sglang/new.py\n"
        "diff --git a/sglang/old.py b/sglang/moved.py\nsimilarity index 100%\n"
        "rename from sglang/old.py\nrename to sglang/moved.py\n"
        "diff --git a/sglang/x y.bin b/sglang/x y.bin\nGIT binary patch\n"
    )
    assert touched_paths(patch) == [
        "sglang/a.py", "sglang/new.py", "sglang/old.py", "sglang/moved.py", "sglang/x y.bin"]


def test_the_old_tool_name_still_runs_for_one_release_and_says_so() -> None:
    """`python -m sglang_disagg.patches` (the name before `patchtool`) runs the same tool and
    prints where it moved; importing it warns."""
    import subprocess
    import sys
    import warnings

    old = subprocess.run([sys.executable, "-m", "sglang_disagg.patches", "--help"], capture_output=True, text=True,
                         timeout=60)
    new = subprocess.run([sys.executable, "-m", "sglang_disagg.patchtool", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert old.returncode == new.returncode == 0, old.stderr
    assert "sglang_disagg.patchtool" in old.stderr and "sglang_disagg.patchtool" not in new.stderr
    assert {"apply", "check", "export", "rebase"} <= set(old.stdout.split()) | {w.strip(",{}") for w in old.stdout.split()}
    sys.modules.pop("sglang_disagg.patches", None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from sglang_disagg.patches.errors import PatchError as old_error
    assert any("patchtool" in str(w.message) for w in seen) and old_error is PatchError
