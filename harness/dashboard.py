"""What the Grafana dashboard (``dashboards/sglang-disagg.json``) asks Prometheus for: its
panels, their PromQL expressions and the metric names each expression reads.

Not a PromQL parser, a tokenizer that knows which brackets hold metric names: label
matchers (``{...}``), grouping lists (``by``/``without``/``on``/``ignoring``/``group_left``/
``group_right`` ``(...)``) and range or subquery brackets (``[...]``) never do; strings,
numbers, durations and Grafana's template variables (``$__rate_interval``, ``${x}``,
``[[x]]``) are dropped before anything is read; a name followed by ``(`` is a function.
Names are returned as written (``..._bucket``, ``..._total``): they are compared with the
sample names of a scrape, which carry the same suffixes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "sglang-disagg.json"

_TOKEN = re.compile(r"""
    (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+|\[\[\w+\]\])
  | (?P<num>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:ms|[smhdwy])*)
  | (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<open>[({\[])
  | (?P<close>[)}\]])
  | (?P<other>\S)
""", re.VERBOSE)

# Words that look like names and are not metrics. `inf`/`nan` are numbers in PromQL.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
# Functions whose argument is a counter's increase, not its raw value.
RATES = {"rate", "irate", "increase"}


@dataclass(frozen=True, slots=True)
class Use:
    """One metric name in an expression and the functions it sits inside, innermost first."""

    name: str
    within: tuple[str, ...]


def _tokens(expr: str) -> list[tuple[str, str]]:
    return [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr) if m.lastgroup not in ("str", "var", "num")]


def uses(expr: str) -> list[Use]:
    found: list[Use] = []
    # Per open bracket: what it is ("(" plain, "{", "[", "labels" for a grouping list) and
    # the function that owns it, if any. Only "(" brackets hold names.
    stack: list[tuple[str, str]] = []
    tokens = _tokens(expr)
    aggregation = ""  # `sum by (le) (...)`: the name before a grouping list owns the "(" after it
    for i, (kind, text) in enumerate(tokens):
        prev_kind, prev = tokens[i - 1] if i else ("", "")
        following = tokens[i + 1][1].lower() if i + 1 < len(tokens) else ""
        if kind == "open":
            if text != "(":
                stack.append((text, ""))
            elif prev_kind == "name" and prev.lower() in _GROUPING:
                stack.append(("labels", ""))
            elif prev_kind == "name" and prev.lower() not in KEYWORDS:
                stack.append(("(", prev))
            else:
                stack.append(("(", aggregation if prev == ")" else ""))
                aggregation = ""
        elif kind == "close":
            if not stack:
                raise ValueError(f"unbalanced {text!r} in {expr!r}")
            stack.pop()
        elif kind == "name":
            if following in ("by", "without"):
                aggregation = text  # an aggregation operator, its grouping list first
                continue
            if any(k != "(" for k, _ in stack) or text.lower() in KEYWORDS or following == "(":
                continue
            found.append(Use(text, tuple(f for _, f in reversed(stack) if f)))
    if stack:
        raise ValueError(f"unclosed bracket in {expr!r}")
    return found


def metric_names(expr: str) -> set[str]:
    return {u.name for u in uses(expr)}


def functions(expr: str) -> set[str]:
    """Names called in `expr`, aggregation operators included."""
    tokens = _tokens(expr)
    return {text for (kind, text), (_, nxt) in zip(tokens, tokens[1:])
            if kind == "name" and text.lower() not in KEYWORDS and (nxt == "(" or nxt.lower() in ("by", "without"))}


def load(path: Path | None = None) -> dict:
    return json.loads((path or DASHBOARD).read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel but rows, collapsed rows' own panels included."""
    out = []
    for p in dashboard["panels"]:
        if p.get("type") == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def expressions(panel: dict) -> list[str]:
    return [t["expr"] for t in panel.get("targets", []) if t.get("expr")]


_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<selector>.*),)?\s*(?P<label>\w+)\s*\)\s*$")


def variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def variable_selector(variable: dict) -> tuple[str, str]:
    """(selector, label) of a ``label_values(selector, label)`` query variable."""
    query = variable["query"]
    query = query.get("query", "") if isinstance(query, dict) else query
    m = _LABEL_VALUES.match(query)
    if m is None or not m.group("selector"):
        raise ValueError(f"variable {variable['name']}: {query!r} is not label_values(selector, label)")
    return m.group("selector"), m.group("label")


_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


@dataclass(frozen=True, slots=True)
class Matcher:
    """One label matcher of a selector: `metric{label op "value"}`."""

    metric: str
    label: str
    op: str
    value: str


def matchers(expr: str) -> list[Matcher]:
    """The label matchers of every selector in `expr` (template variables left as written)."""
    return [Matcher(metric, label, op, value) for metric, body in _SELECTOR.findall(expr)
            for label, op, value in _MATCHER.findall(body)]


def grouping_labels(expr: str) -> set[str]:
    """Labels named in `by (...)` / `without (...)` lists."""
    return {label.strip() for group in _BY.findall(expr) for label in group.split(",") if label.strip()}


def alternatives(value: str) -> list[str]:
    """A regex matcher's top-level alternatives (`a|b|c`), each a pattern a value must fully match."""
    return value.split("|") if "(" not in value else [value]
