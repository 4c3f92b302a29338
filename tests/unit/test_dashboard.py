"""The dashboard's PromQL reader (harness/dashboard.py) on expressions written to trip it, and
the mistakes a dashboard can make without any stack: a panel on another data source, a
quantile that lost its `le`, a counter plotted raw, a misspelt function, overlapping panels.
Whether the names it reads exist is tests/e2e/test_dashboard.py's question."""

from __future__ import annotations

import re

import pytest

from harness import dashboard as dash

CASES = [
    # histogram_quantile over an aggregation with its grouping list first, template variables
    ('histogram_quantile(0.99, sum by (le, phase) (rate(sglang_disagg_ttft_phase_seconds_bucket'
     '{instance=~"$messenger", phase=~"memory|prefill"}[$__rate_interval])))',
     {"sglang_disagg_ttft_phase_seconds_bucket"}),
    # grouping list last, a vector match, a label value holding brackets, bool and a float
    ('sum(rate(a_total{path=~"/v1/.*(x)"}[5m])) by (instance) / on(instance) group_left(peer) b > bool 1e-9',
     {"a_total", "b"}),
    # colon names (SGLang's), offset, a subquery, ${x} and [[x]] variables
    ("sglang:num_queue_reqs offset 5m + max_over_time(sglang:token_usage{instance=~\"${server}\"}[10m:1m])"
     " - rate(c[[[interval]]])", {"sglang:num_queue_reqs", "sglang:token_usage", "c"}),
    # without, increase over $__range, and a keyword that looks like a name
    ("sum without (le) (increase(h_count[$__range])) unless ignoring(x) d", {"h_count", "d"}),
    ("vector(1)", set()),
]


@pytest.mark.parametrize(("expr", "names"), CASES)
def test_metric_names(expr, names):
    assert dash.metric_names(expr) == names


def test_a_name_knows_the_functions_around_it():
    (use,) = dash.uses("histogram_quantile(0.5, sum by (le) (rate(x_bucket[1m])))")
    assert use == dash.Use("x_bucket", ("rate", "sum", "histogram_quantile"))
    assert dash.functions("sum by (le) (rate(x[1m])) / count(y)") == {"sum", "rate", "count"}


@pytest.mark.parametrize("expr", ["sum(rate(x[5m])", "x{a=\"b\"}}"])
def test_unbalanced_brackets_are_refused(expr):
    with pytest.raises(ValueError):
        dash.uses(expr)


def test_a_variable_names_the_metric_it_lists_instances_of():
    variable = {"name": "v", "query": {"query": "label_values(sglang_disagg_kv_pages, instance)"}}
    assert dash.variable_selector(variable) == ("sglang_disagg_kv_pages", "instance")
    with pytest.raises(ValueError):
        dash.variable_selector({"name": "w", "query": "label_values(instance)"})


# PromQL's functions and aggregation operators (Prometheus 2.x/3.x), for the spelling check.
PROMQL = set("""abs absent absent_over_time avg avg_over_time bottomk ceil changes clamp clamp_max clamp_min count
count_over_time count_values day_of_month day_of_week day_of_year days_in_month delta deriv exp floor group
histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar histogram_sum
holt_winters hour idelta increase irate label_join label_replace last_over_time limitk limit_ratio ln log10 log2
mad_over_time max max_over_time min min_over_time minute month predict_linear present_over_time quantile
quantile_over_time rate resets round scalar sgn sort sort_desc sqrt stddev stddev_over_time stdvar stdvar_over_time
sum sum_over_time time timestamp topk vector year""".split())


@pytest.fixture(scope="module")
def board():
    return dash.load()


def test_the_dashboard_reads_one_prometheus_chosen_at_import(board):
    variables = dash.variables(board)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert board["uid"] and board["schemaVersion"] >= 39
    for p in dash.panels(board) + [v for v in variables.values() if v["type"] == "query"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p.get("title", p.get("name"))
        for t in p.get("targets", []):
            assert t["datasource"] == p["datasource"], p["title"]


def lint(board: dict) -> list[tuple[str, str]]:
    problems = []
    for p in dash.panels(board):
        for expr in dash.expressions(p):
            unknown = dash.functions(expr) - PROMQL
            if unknown:
                problems.append((p["title"], f"unknown functions {sorted(unknown)}"))
            if "histogram_quantile" in expr and any("le" not in re.split(r"[\s,]+", g)
                                                    for g in re.findall(r"\bby\s*\(([^)]*)\)", expr)):
                problems.append((p["title"], "histogram_quantile over a sum that drops le"))
            for use in dash.uses(expr):
                if use.name.endswith(("_total", "_bucket", "_sum", "_count")) and not set(use.within) & dash.RATES:
                    problems.append((p["title"], f"{use.name} read raw (a counter: rate or increase it)"))
    return problems


def test_every_expression_is_well_formed(board):
    assert not lint(board), lint(board)


def test_the_lint_sees_each_mistake():
    exprs = {"spelling": "histogram_quantille(0.5, sum by (le) (rate(x_bucket[1m])))",
             "le": "histogram_quantile(0.5, sum by (phase) (rate(x_bucket[1m])))",
             "raw": "sum by (instance) (x_total)"}
    bad = {"panels": [{"title": t, "targets": [{"expr": e}]} for t, e in exprs.items()]}
    assert [title for title, _ in lint(bad)] == ["spelling", "le", "raw"]


def test_panels_sit_on_the_grid_without_overlapping(board):
    cells: dict[tuple[int, int], str] = {}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
