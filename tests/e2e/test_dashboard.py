"""The Grafana dashboard (dashboards/sglang-disagg.json) against a live stack: every metric
name any panel's PromQL reads is exported by the endpoints that panel selects, and every label
value a panel filters on (and every label it groups by) is one those endpoints export.

The stack is the launcher's default (`--role all`, tiny-llama, shmem) with SGLang's own
metrics on (`--enable-metrics`, which the dashboard's SGLang panels need) and a 1.5 s
transfer deadline. One request is served, then one fails: its prefill server is stopped
(SIGSTOP) while writing, as in the fault matrix's hung-prefill case, so the decoder fails
it at the deadline and the router answers the client with an error. Series that exist only
once something happened (requests by outcome, TTFT phases, a 5xx from the router) are then there.
Every endpoint is scraped once, afterwards: SGLang's prefill and decode servers, the
router's metrics port and both messenger metrics ports.
"""

from __future__ import annotations

import re
import time

import pytest

from harness import dashboard as dash
from sglang_disagg.launch.client import chat, generate_ids

from .conftest import StackSpec, start_stack
from .faultlib import SIGCONT, SIGSTOP, Call, long_prompt, scrape, signal_group, value, wait_for, wait_released

pytestmark = pytest.mark.e2e

SPEC = StackSpec(backend="shmem", extra_args=("--enable-metrics",))
TRANSFER_TIMEOUT_S = 1.5
LONG = 1500  # tokens: ~24 prefill chunks, so the stop lands mid-transfer
MIN_PANELS = 15  # the six rows asked for in issue 30 need at least this many
INSTANCE_VARIABLES = ("messenger", "server", "router")
_INSTANCE = re.compile(r'instance=~"\$(\w+)"')


@pytest.fixture(scope="module")
def live(tmp_path_factory, stacks):
    stacks.close()  # one stack on the machine at a time (the pool's would share the cores)
    stack = start_stack(tmp_path_factory.mktemp("dashboard"), SPEC, transfer_timeout_s=TRANSFER_TIMEOUT_S)
    yield stack
    stack.stop()


def endpoints(stack) -> dict[str, int]:
    """Every port of the stack that serves /metrics: SGLang's servers, the router's metrics
    listener, the messenger's metrics ports."""
    return {name: port for name, port in stack.cfg.ports.all(stack.cfg.role, stack.cfg.mode).items()
            if name.endswith(("server", "metrics"))}


def hung_prefill_fails_a_request(stack) -> Call:
    pm, dm = stack.cfg.ports.prefill_metrics, stack.cfg.ports.decode_metrics
    writes = value(scrape(stack.cfg.host, pm), "sglang_disagg_kv_writes_total")
    call = Call(stack.url, long_prompt(LONG, 30), 4)
    wait_for("the prefill server writing",
             lambda: value(scrape(stack.cfg.host, pm), "sglang_disagg_kv_writes_total") > writes)
    prefill = stack.servers[0]
    assert prefill.spec.name == "prefill"
    signal_group(prefill, SIGSTOP)
    try:
        call.result()  # the router tries twice: two deadlines at most
    finally:
        signal_group(prefill, SIGCONT)
    t0 = time.monotonic()
    for port in (dm, pm):  # quiet before the scrape: gauges read as they settle
        wait_released(stack.cfg.host, port, t0, 5.0)
    return call


def server_errors(router: dict) -> float:
    return sum(v for k, v in router.items() if k[0] == "smg_http_responses_total"
               and dict(k[1:]).get("path") == "/generate" and dict(k[1:]).get("status_code", "").startswith("5"))


def test_every_panel_reads_metrics_the_stack_exports(live):
    host = live.cfg.host
    ports = endpoints(live)
    assert len(ports) == 5, ports
    before = {name: scrape(host, port) for name, port in ports.items()}
    assert len(generate_ids(live.url, long_prompt(100, 31), 4)) == 4
    # The router's request panel filters on path=~"/generate|/v1/.*": one OpenAI-style request too.
    assert chat(live.url, "Hi", live.cfg.served_model_name, max_tokens=2)["choices"]
    call = hung_prefill_fails_a_request(live)
    samples = {name: scrape(host, port) for name, port in ports.items()}

    # The fault happened and was counted where the dashboard looks for it.
    assert call.err is not None, call.out
    dm, router = samples["decode metrics"], samples["router metrics"]
    assert value(dm, "sglang_disagg_failures_total", cause="transfer") > value(
        before["decode metrics"], "sglang_disagg_failures_total", cause="transfer"), call.err
    assert server_errors(router) > server_errors(before["router metrics"]), "the router answered no 5xx"

    names = {endpoint: {k[0] for k in s} for endpoint, s in samples.items()}
    board = dash.load()
    variables = dash.variables(board)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    # What each instance variable lists: the endpoints exporting the metric its query names.
    covers: dict[str, set[str]] = {}
    for v in INSTANCE_VARIABLES:
        selector, label = dash.variable_selector(variables[v])
        assert label == "instance", v
        (metric,) = dash.metric_names(selector)
        covers[v] = {endpoint for endpoint, have in names.items() if metric in have}
    # The messenger's counters are also on SGLang's own endpoints (SGLang's multiprocess
    # collector reads the value files of every prometheus_client metric its processes keep,
    # the messenger's included): a messenger panel summing those too would count twice.
    assert covers == {"messenger": {"prefill metrics", "decode metrics"},
                      "server": {"prefill server", "decode server"}, "router": {"router metrics"}}, covers

    panels = dash.panels(board)
    assert len(panels) >= MIN_PANELS
    missing, unscoped = [], []
    for panel in panels:
        exprs = dash.expressions(panel)
        assert exprs, f"panel {panel['title']!r} has no expression"
        for expr in exprs:
            scoped = set(_INSTANCE.findall(expr))
            if len(scoped) != 1 or not scoped <= set(INSTANCE_VARIABLES):
                unscoped.append((panel["title"], expr))
                continue
            (v,) = scoped
            have = set().union(*(names[e] for e in covers[v]))
            missing += [(panel["title"], name, v) for name in sorted(dash.metric_names(expr)) if name not in have]
    assert not unscoped, f"expressions not scoped to one instance variable: {unscoped}"
    assert not missing, f"(panel, metric, endpoints) named by the dashboard and not exported: {missing}"

    # The label values panels filter on, and the labels they group by, are the ones exported: a
    # renamed phase or path would leave a panel silently empty, its metric name still right.
    labels: dict[str, dict[str, set[str]]] = {}  # metric -> label -> values, every endpoint together
    for s in samples.values():
        for key in s:
            for label, v in key[1:]:
                labels.setdefault(key[0], {}).setdefault(label, set()).add(v)
    unmatched, ungrouped = [], []
    for panel in panels:
        for expr in dash.expressions(panel):
            for m in dash.matchers(expr):
                if m.label == "instance":  # Prometheus adds it at scrape time; covered above
                    continue
                values = labels.get(m.metric, {}).get(m.label, set())
                if m.op in ("=", "=~"):
                    pats = [m.value] if m.op == "=" else dash.alternatives(m.value)
                    for pat in pats:
                        if not any((v == pat) if m.op == "=" else re.fullmatch(pat, v) for v in values):
                            unmatched.append((panel["title"], m.metric, f'{m.label}{m.op}"{pat}"', sorted(values)))
            for label in dash.grouping_labels(expr) - {"instance"}:
                if not any(label in labels.get(name, {}) for name in dash.metric_names(expr)):
                    ungrouped.append((panel["title"], label, sorted(dash.metric_names(expr))))
    assert not unmatched, f"(panel, metric, matcher, values exported) that select nothing: {unmatched}"
    assert not ungrouped, f"(panel, label, metrics) grouped by a label no metric carries: {ungrouped}"
