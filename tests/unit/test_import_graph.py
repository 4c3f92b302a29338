"""The import graph of sglang_disagg, read from the source (AST): no circles, and no test rig.

Every import counts: module level, inside functions, and under `if TYPE_CHECKING:` (a
type-only circle is still two modules that each need the other to be understood). An edge
goes to the module named (`from .x import y` -> x, or x.y where y is a module); the implicit
import of a parent package's __init__ is not an edge, or every package that re-exports its
submodules would be a circle. Registry lookups by string (backends, devices) are not imports.

The harness that makes separate hosts out of namespaces (harness/hosts) is a test rig beside
the tests and benchmarks: nothing of the runtime package may import it, and the package
discovery must not ship it.
"""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "sglang_disagg"
RIGS = ("harness", "tests", "benchmarks", f"{PACKAGE}.hosts")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every module of the package."""
    out = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return out


def _imported(name: str, path: Path, is_init: bool, modules: dict | None = None) -> set[str]:
    """Every absolute module name `path` imports, anywhere in it (relative ones resolved):
    `from pkg import x` names pkg.x when that is one of `modules`, else pkg."""
    here = name if is_init else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:
                if modules is None:  # both readings: the package, and a module of that name
                    out.update((base, f"{base}.{a.name}"))
                else:
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (the nearest existing one of each name)."""
    mods = _modules()
    graph = {}
    for name, (path, is_init) in mods.items():
        edges = set()
        for target in _imported(name, path, is_init, mods):
            if target in mods:
                edges.add(target)
            elif target.startswith(PACKAGE + ".") and target.rpartition(".")[0] in mods:
                edges.add(target.rpartition(".")[0])  # `from pkg.mod import attr` -> pkg.mod
        graph[name] = edges - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_every_kind_of_import():
    # the checker itself: a type-only, a function-level and a relative import are all edges
    graph = import_graph()
    assert "sglang_disagg.backends.regions" in graph["sglang_disagg.backends.base"]
    assert "sglang_disagg.messenger.planner" in graph["sglang_disagg.launch.sharding"]  # inside functions
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_the_package_imports_itself_back():
    graph = import_graph()
    found = circles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, "import circles in sglang_disagg:\n" + "\n".join(described)


def test_the_runtime_package_imports_no_test_rig():
    mods = _modules()
    bad = {name: sorted(t for t in _imported(name, *mods[name])
                        if t.split(".")[0] in RIGS or any(t == r or t.startswith(r + ".") for r in RIGS))
           for name in mods}
    assert not {k: v for k, v in bad.items() if v}
    assert not (ROOT / PACKAGE / "hosts").exists(), "the namespace harness lives in harness/hosts"


def test_the_harness_is_not_shipped():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert (ROOT / "harness" / "hosts" / "netns.py").is_file()
    for package in ("harness", "harness.hosts"):
        assert not any(fnmatch.fnmatch(package, pattern) for pattern in find.get("include", ["*"]))


def _room(graph: dict[str, set[str]], room: str) -> dict[str, set[str]]:
    return {m: edges for m, edges in graph.items() if m == room or m.startswith(room + ".")}


def test_the_ipc_layer_imports_nothing_above_it():
    """sglang_disagg.ipc (shared memory, fd passing, cuMem, the framed stream) is the bottom
    room: the backends, the messenger and DP build on it, never the other way round."""
    graph = import_graph()
    ipc = _room(graph, f"{PACKAGE}.ipc")
    assert len(ipc) >= 6, sorted(ipc)
    above = {m: sorted(t for t in edges if not t.startswith(f"{PACKAGE}.ipc")) for m, edges in ipc.items()}
    assert not {m: t for m, t in above.items() if t}, above


def test_data_parallelism_lives_in_its_room_on_the_ipc_layer():
    """messenger/dp holds data parallelism: the rest of the messenger reaches it only through
    node.py (its groups and place), the checks only through dp.support (hooks, the launcher);
    its sockets, credential checks and framing come from sglang_disagg.ipc: no module of the
    room opens a socket or reads SO_PEERCRED itself."""
    graph = import_graph()
    dp = f"{PACKAGE}.messenger.dp"
    into = {m: sorted(t for t in edges if t.startswith(dp)) for m, edges in graph.items() if not m.startswith(dp)}
    into = {m: t for m, t in into.items() if t}
    allowed = {f"{PACKAGE}.messenger.node": {f"{dp}.groups", f"{dp}.place"},
               f"{PACKAGE}.hooks": {f"{dp}.support"}, f"{PACKAGE}.launch.config": {f"{dp}.support"}}
    assert {m: t for m, t in into.items() if not set(t) <= allowed.get(m, set())} == {}
    room = _room(graph, dp)
    assert f"{PACKAGE}.ipc.fdpass" in room[f"{dp}.owner"] and f"{PACKAGE}.ipc.fdpass" in room[f"{dp}.proxy"]
    assert f"{PACKAGE}.ipc.stream" in room[f"{dp}.wire"]
    mods = _modules()
    for name in room:
        tree = ast.parse(mods[name][0].read_text())
        raw = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in
               ("SO_PEERCRED", "socketpair", "recv_fds", "send_fds", "AF_UNIX")]
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "socket" and isinstance(n.func.value, ast.Name) and n.func.value.id == "socket"]
        assert not raw and not calls, f"{name} does its own socket work: {raw or 'socket.socket()'}"
