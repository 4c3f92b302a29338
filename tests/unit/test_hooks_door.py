"""hooks.py is the only door between SGLang and sglang_disagg, and it opens one way.

- every SGLang patch (``patches/*.patch``, added lines) imports from sglang_disagg only
  ``sglang_disagg.hooks``, and calls on it only functions defined at the top of hooks.py
  (read with ast: no re-exported modules, classes or names);
- the layers under hooks (messenger/, backends/, devices/) never import it, checked in a
  fresh interpreter (an import anywhere in their graph would show in sys.modules);
- both messenger sides implement the written contract (messenger/contract.py), and a
  side missing a method is refused by it.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sglang_disagg import hooks
from sglang_disagg.messenger.contract import Messenger
from sglang_disagg.messenger.decode import DecodeMessenger
from sglang_disagg.messenger.prefill import PrefillMessenger

ROOT = Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
HOOKS_PY = ROOT / "sglang_disagg" / "hooks.py"
HOOKS = "sglang_disagg.hooks"


def _hooks_functions() -> set[str]:
    tree = ast.parse(HOOKS_PY.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def _added_lines(patch: Path) -> list[str]:
    """The patch's added lines (without the '+'), in order."""
    return [line[1:] for line in patch.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]


def _code(line: str) -> str:
    return line.split("#", 1)[0]


def _imports(lines: list[str]) -> list[ast.stmt]:
    """The import statements among `lines` that name sglang_disagg (continued over lines
    until their parentheses close), parsed."""
    out = []
    for i, line in enumerate(lines):
        if not re.match(r"\s*(from|import)\s+sglang_disagg\b", line):
            continue
        stmt = line
        while stmt.count("(") > stmt.count(")"):
            i += 1
            stmt += "\n" + lines[i]
        out.append(ast.parse(textwrap.dedent(stmt).strip()).body[0])
    return out


def _door_names() -> tuple[dict[str, str], dict[str, set[str]]]:
    """(names bound to the hooks module -> first patch; hooks function -> patches using it)."""
    assert PATCHES, "no patches found"
    functions = _hooks_functions()
    aliases: dict[str, str] = {}
    used: dict[str, set[str]] = {}
    problems = []
    for patch in PATCHES:
        for node in _imports(_added_lines(patch)):
            if isinstance(node, ast.ImportFrom) and node.module == "sglang_disagg":
                for a in node.names:
                    if a.name != "hooks":
                        problems.append(f"{patch.name}: from sglang_disagg import {a.name}")
                    aliases.setdefault(a.asname or a.name, patch.name)
            elif isinstance(node, ast.ImportFrom) and node.module == HOOKS:
                for a in node.names:
                    if a.name not in functions:
                        problems.append(f"{patch.name}: from {HOOKS} import {a.name} (not a hooks function)")
                    used.setdefault(a.name, set()).add(patch.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name != HOOKS:
                        problems.append(f"{patch.name}: import {a.name}")
                    aliases.setdefault(a.asname or a.name, patch.name)
            else:
                problems.append(f"{patch.name}: {ast.unparse(node)}")
    assert not problems, "patches import sglang_disagg other than through hooks:\n" + "\n".join(problems)
    return aliases, used


def test_patches_import_nothing_of_ours_but_hooks():
    aliases, used = _door_names()
    assert aliases or used
    for patch in PATCHES:
        for line in _added_lines(patch):
            for module in re.findall(r"\bsglang_disagg\.(\w+)", _code(line)):
                assert module == "hooks", f"{patch.name} reaches sglang_disagg.{module}: {line.strip()}"


def test_patches_call_only_functions_defined_in_hooks():
    aliases, used = _door_names()
    functions = _hooks_functions()
    for patch in PATCHES:  # an alias bound by an earlier patch is used by later ones (same file)
        for line in _added_lines(patch):
            for alias in aliases:
                for name in re.findall(rf"(?<![\w.]){re.escape(alias)}\.(\w+)", _code(line)):
                    used.setdefault(name, set()).add(patch.name)
    unknown = {name: sorted(p) for name, p in used.items() if name not in functions}
    assert not unknown, f"patches use hooks attributes that are not its top-level functions: {unknown}"
    # Every patch that touches sglang_disagg does so through these; a sanity floor on the scan.
    assert {"scheduler_ready", "cpu_op", "attention_gather", "attention_new_rows", "extend_view"} <= set(used)


def test_hooks_reexports_nothing():
    """hooks.py defines functions (and constants); it binds no module or class of ours at
    its top level, so `hooks.X` can only ever be one of its own functions."""
    tree = ast.parse(HOOKS_PY.read_text())
    for node in tree.body:
        assert not isinstance(node, ast.ClassDef), f"hooks.py defines class {node.name}"
        if isinstance(node, ast.ImportFrom):
            assert node.module in ("__future__", "typing"), f"hooks.py imports from {node.module}"
        if isinstance(node, ast.Import):
            assert all(not a.name.startswith("sglang_disagg") for a in node.names)


def test_layers_under_hooks_never_import_it():
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        failed = []
        for pkg in ("sglang_disagg.messenger", "sglang_disagg.backends", "sglang_disagg.devices"):
            mod = importlib.import_module(pkg)
            for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
                if info.name.endswith(".__main__"):  # a command line, not a module to import
                    continue
                try:
                    importlib.import_module(info.name)
                except Exception as e:
                    failed.append(f"{{info.name}}: {{e!r}}")
        print("FAILED", failed)
        print("LOADED", len([m for m in sys.modules if m.startswith("sglang_disagg.")]))
        print("HOOKS", {HOOKS!r} in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["FAILED"] == "[]", lines["FAILED"]
    assert int(lines["LOADED"]) > 40  # the walk really imported the packages
    assert lines["HOOKS"] == "False", "a module under messenger/, backends/ or devices/ imports hooks"


def _bare(cls: type) -> object:
    """An instance without running __init__ (that needs a scheduler): methods are what the
    runtime Protocol checks."""
    return object.__new__(cls)


@pytest.mark.parametrize("side", [PrefillMessenger, DecodeMessenger])
def test_both_messenger_sides_implement_the_contract(side):
    assert isinstance(_bare(side), Messenger)
    for name, proto in inspect.getmembers(Messenger, inspect.isfunction):
        if name.startswith("_"):
            continue
        want = list(inspect.signature(proto).parameters)[1:]  # without self
        got = list(inspect.signature(getattr(_bare(side), name)).parameters)
        assert len(got) == len(want), f"{side.__name__}.{name}{got} vs contract {want}"


def _double(without: str | None) -> object:
    members = {name: (lambda self, *a: None) for name, _ in inspect.getmembers(Messenger, inspect.isfunction)
               if not name.startswith("_") and name != without}
    return type("Double", (), members)()


def test_a_side_missing_a_method_is_refused():
    assert isinstance(_double(None), Messenger)
    assert not isinstance(_double("draft_tail_tokens"), Messenger)
    assert not isinstance(_double("has_leader_work"), Messenger)


def test_hooks_call_the_contract_without_probing(monkeypatch):
    """draft_tail_tokens is a method of both sides: the decoder hands SGLang's tokens back."""
    tail = object()
    monkeypatch.setattr(hooks, "_messenger", None)
    assert hooks.draft_tail_tokens(None, tail) is tail
    monkeypatch.setattr(hooks, "_messenger", _bare(DecodeMessenger))
    assert hooks.draft_tail_tokens(None, tail) is tail
    assert not re.search(r"getattr\(\s*_messenger", HOOKS_PY.read_text())
