"""docs/modules.md, the module map harness/maps.py writes, is current and complete.

The page equals what the generator makes of the docstrings now; every module of the package,
test rig and benchmark script has a module docstring and one row; and every
``sglang_disagg/...py``, ``harness/...py`` or ``benchmarks/...py`` path that README.md or a
page of docs/ names exists.
"""

from __future__ import annotations

import re
from collections import Counter

from harness import maps

ROOT = maps.ROOT
# A repository path to a module, not the tail of a longer path (tests/harness/x.py, a/benchmarks/y.py).
MODULE_PATH = re.compile(r"(?<![\w/.-])((?:sglang_disagg|harness|benchmarks)/[\w/]*\w\.py)\b")
ROW = re.compile(r"^\| \[`([^`]+)`\]\(\.\./\1\) \| ")


def test_module_map_page_is_what_the_generator_writes():
    diff = maps.check()
    assert not diff, "docs/modules.md is not current; run `python -m harness.maps`:\n" + "\n".join(diff[:60])


def test_every_module_has_a_docstring():
    missing = [str(rel) for rel in maps.modules() if not (maps.docstring(ROOT / rel) or "").strip()]
    assert not missing, f"modules without a module docstring: {missing}"


def test_every_module_is_listed_exactly_once():
    rows = Counter(m.group(1) for line in maps.PAGE.read_text(encoding="utf-8").splitlines()
                   if (m := ROW.match(line)))
    on_disk = {rel.as_posix() for rel in maps.modules()}
    assert on_disk, "the map found no modules"
    assert {"sglang_disagg/messenger/transport.py", "harness/maps.py", "benchmarks/transfer.py"} <= on_disk
    assert sorted(p for p in on_disk if rows[p] != 1) == [], "modules not listed exactly once"
    assert sorted(set(rows) - on_disk) == [], "rows for modules that do not exist"


def test_map_covers_package_rigs_and_benchmarks_only():
    tops = {rel.parts[0] for rel in maps.modules()}
    assert tops == {"sglang_disagg", "harness", "benchmarks"}
    assert not [rel for rel in maps.modules() if rel.parts[0] == "benchmarks" and len(rel.parts) > 2]


def test_summary_is_the_first_sentence():
    assert maps.summary("One line.\n\nMore.") == "One line."
    assert maps.summary("A sentence that\nwraps here. And another.\n") == "A sentence that wraps here."
    assert maps.summary("Uses e.g. this: fine") == "Uses e.g. this: fine"


def test_module_paths_named_in_the_docs_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {(page.relative_to(ROOT).as_posix(), m.group(1)) for page in pages
             for m in MODULE_PATH.finditer(page.read_text(encoding="utf-8"))}
    assert len(named) > 10, f"the docs name too few module paths for the regex to be right: {sorted(named)}"
    stale = sorted((page, path) for page, path in named if not (ROOT / path).is_file())
    assert not stale, f"docs name module paths that do not exist: {stale}"
