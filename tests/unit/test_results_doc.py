"""benchmarks/results_doc.py, the one writer of benchmark results documents, and that every
benchmark script writes its results document through it.

The writer: a document records the command as run (shell-quoted), the date (ISO-8601 UTC), the
machine (CPU model, cores, memory, kernel, Python, torch), the script's own keys unchanged, every
repeat's raw values and notes. The scripts (read as source, AST): none writes JSON to a file by
itself (json.dump, write_text/write_bytes of json.dumps, .write of it to anything but a JSON-lines
pipe), none builds a "machine"/"command"/"date" header of its own or asks `platform` itself, and
every script that names a DIR/*.json path begins a results_doc.Run.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import results_doc  # noqa: E402

WRITER = "results_doc.py"
# Writes of json.dumps(...) with .write() that are a JSON-lines protocol to another process,
# not a results document: (script, the receiver as source text).
PIPES = {("jsonl_worker.py", "out"), ("transfer.py", "self.p.stdin")}
CONSOLE = {"tqdm", "sys.stdout", "sys.stderr"}  # progress lines, not files


def _run(args=("--out", "dir with space", "--repeats", "3")) -> results_doc.Run:
    return results_doc.Run.begin(list(args), BENCH / "dp.py")


def test_command_is_the_script_and_its_arguments_shell_quoted():
    run = _run()
    assert run.command == "python benchmarks/dp.py --out 'dir with space' --repeats 3"
    assert shlex.split(run.command)[1:] == ["benchmarks/dp.py", "--out", "dir with space", "--repeats", "3"]
    # A script outside the repository keeps its path as given.
    assert results_doc.command_line(["-x"], "/elsewhere/b.py") == "python /elsewhere/b.py -x"


def test_date_is_the_start_in_iso8601_utc():
    before = time.time()
    run = _run()
    parsed = datetime.strptime(run.date, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert before - 1 <= parsed.timestamp() <= time.time() + 1


def test_machine_fields():
    m = _run().machine.to_dict()
    assert isinstance(m["cpu_model"], str) and m["cpu_model"]
    assert m["cores"] >= 1 and 1 <= m["cores_usable"] <= m["cores"]
    assert m["cpus"] == m["cores"]  # the key documents had before the writer
    assert m["memory_gib"] is None or m["memory_gib"] > 0
    if Path("/proc/meminfo").exists():
        assert m["memory_gib"] > 0
    assert m["kernel"] == platform.release() and m["platform"] == platform.platform()
    assert m["python"] == platform.python_version()
    assert "torch" in m and "sglang" in m and len(m["load_average_at_start"]) == 3


def test_written_document_has_header_body_raw_repeats_and_notes(tmp_path):
    run = _run()
    rows = [{"config": "a", "repeat": 0, "ttft_ms": 1.5}, {"config": "b", "repeat": 0, "ttft_ms": 9.0},
            {"config": "a", "repeat": 1, "ttft_ms": 2.5}, {"config": "b", "repeat": 1}]
    raw = results_doc.group_repeats(rows, ("config",), ("repeat", "ttft_ms"))
    assert raw == [{"config": "a", "repeat": [0, 1], "ttft_ms": [1.5, 2.5]},
                   {"config": "b", "repeat": [0, 1], "ttft_ms": [9.0, None]}]  # aligned with the repeats
    path = run.write(tmp_path / "sub" / "x.json", {"model": "m", "rows": rows}, raw_repeats=raw,
                     notes=["medians over repeats"])
    doc = json.loads(path.read_text())
    assert list(doc) == ["schema", "command", "date", "machine", "model", "rows", "raw_repeats", "notes"]
    assert doc["schema"] == results_doc.SCHEMA
    assert doc["command"] == run.command and doc["date"] == run.date
    assert doc["machine"] == json.loads(json.dumps(run.machine.to_dict()))
    assert doc["rows"] == rows and doc["raw_repeats"] == raw and doc["notes"] == ["medians over repeats"]
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary file left


def test_no_repeats_is_null_and_a_bare_note_is_one_note(tmp_path):
    doc = json.loads(_run().write(tmp_path / "x.json", {"rows": []}, notes="one run").read_text())
    assert doc["raw_repeats"] is None and doc["notes"] == ["one run"]


def test_the_writer_owns_its_keys():
    for key in results_doc.OWNED:
        with pytest.raises(ValueError, match=key):
            _run().document({key: 1})


def test_dataclasses_paths_and_sets_are_written(tmp_path):
    @dataclasses.dataclass
    class Idle:
        pages: int

    doc = json.loads(_run().write(tmp_path / "x.json", {"idle": Idle(3), "p": Path("/a"), "s": {2, 1}}).read_text())
    assert doc["idle"] == {"pages": 3} and doc["p"] == "/a" and doc["s"] == [1, 2]


# --- every benchmark script goes through the writer -------------------------------------------------------


def _scripts() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if p.name != WRITER)


def _is_json_dumps(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "dumps"
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "json" for n in ast.walk(node))


def _hand_writes(path: Path) -> list[str]:
    """Every place `path` writes JSON to a file itself, as 'line: source'."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        args = [*node.args, *(k.value for k in node.keywords)]
        if f.attr == "dump" and isinstance(f.value, ast.Name) and f.value.id == "json":
            found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
        elif f.attr in ("write_text", "write_bytes") and any(_is_json_dumps(a) for a in args):
            found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
        elif f.attr == "write" and any(_is_json_dumps(a) for a in args) \
                and (path.name, ast.unparse(f.value)) not in PIPES and ast.unparse(f.value) not in CONSOLE:
            found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def _header_keys(path: Path) -> list[str]:
    """Dict literals that carry a header key the writer owns: a document built by hand."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{node.lineno}: {k.value}" for node in ast.walk(tree) if isinstance(node, ast.Dict)
            for k in node.keys if isinstance(k, ast.Constant) and k.value in results_doc.OWNED]


def _json_paths(path: Path) -> bool:
    """Whether the script builds a `... / "name.json"` path (a results document it writes or reads)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right = node.right
            parts = right.values if isinstance(right, ast.JoinedStr) else [right]
            if parts and isinstance(parts[-1], ast.Constant) and str(parts[-1].value).endswith(".json"):
                return True
    return False


def _begins_a_run(path: Path) -> bool:
    src = path.read_text()
    return "import results_doc" in src and "results_doc.Run.begin(" in src


def test_no_script_writes_json_to_a_file_by_itself():
    offenders = {p.name: w for p in _scripts() if (w := _hand_writes(p))}
    assert not offenders, f"write results documents through benchmarks/results_doc.py: {offenders}"


def test_no_script_builds_a_header_or_reads_the_machine_itself():
    offenders = {p.name: k for p in _scripts() if (k := _header_keys(p))}
    assert not offenders, f"command/date/machine/notes are the writer's: {offenders}"
    asking = [p.name for p in _scripts() if "import platform" in p.read_text()]
    assert not asking, f"the machine is results_doc.Machine's to read: {asking}"


def test_every_script_with_a_json_results_file_begins_a_run():
    writers = [p.name for p in _scripts() if _json_paths(p)]
    # The detector is right if it finds the known writers (and so would find a new one).
    assert {"decode_tax.py", "transfer.py", "streaming.py", "single_request.py", "poller_cost.py",
            "speculative.py", "load_checks.py"} <= set(writers), writers
    missing = [name for name in writers if not _begins_a_run(BENCH / name) and name != "load_checks.py"]
    assert not missing, f"scripts that write DIR/*.json without results_doc.Run: {missing}"
    # load.json: load_checks.write_report takes load.py's Run and writes through it.
    assert _begins_a_run(BENCH / "load.py") and "record.write(" in (BENCH / "load_checks.py").read_text()


def test_the_detectors_catch_a_hand_written_document(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('import json, platform\nfrom pathlib import Path\n'
                   'doc = {"machine": platform.platform(), "rows": []}\n'
                   '(Path("o") / "x.json").write_text(json.dumps(doc))\n'
                   'json.dump(doc, open("y.json", "w"))\nopen("z", "w").write(json.dumps(doc))\n')
    assert len(_hand_writes(bad)) == 3
    assert _header_keys(bad) == ["3: machine"]
    assert _json_paths(bad) and not _begins_a_run(bad)
