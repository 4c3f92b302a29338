"""MLA over rails: tiny-deepseek-v3, prefill TP 2 -> decode TP 1 on namespace hosts with two rails
each (`--rails eth0,rail1`), libfabric tcp. MLA's latent is replicated on every prefill rank, so the
planner draws the source rank per request (messenger/planner.py); the backend then stripes that
rank's batches over the rails. Over a dozen requests: tokens exact against a colocated TP 1 server,
both replicas drawn (the prefill leader's `requests_by_source`), both rails carried a share of the
posted KV (the prefill's per-rail metrics), and what rail 1 carried crossed rail1 (the kernel's
counters; the prompts are short, so control traffic on eth0 would drown a byte split)."""

from __future__ import annotations

import sys

import pytest

from e2e.conftest import StackSpec, start_stack
from e2e.deepseek_pd import MODEL, draw_prompts, run_prompts
from harness.hosts import netns
from harness.hosts.deployment import Deployment, Layout
from sglang_disagg.launch import Role

from .conftest import COMMON_ARGS, ask
from .test_rails_e2e import RAILS, _rail_metrics, _tx

pytestmark = pytest.mark.e2e

LAYOUT = Layout(prefill_tp=2)
OUTPUT = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    prompts = draw_prompts()
    stack = start_stack(tmp_path_factory.mktemp("mla-ref"), StackSpec(role=Role.COLOCATED, model=MODEL))
    try:
        return prompts, [out[:OUTPUT] for out in run_prompts(stack.url, prompts)]
    finally:
        stack.stop()


def test_mla_replicas_and_rails_are_all_used_and_tokens_are_exact(hosts_possible, reference, tmp_path):
    prompts, want = reference
    with netns.Network.create("rm", LAYOUT.names, rails=2) as net:
        dep = Deployment.write(tmp_path / "deployment", net, LAYOUT, model=MODEL, backend="libfabric", provider="tcp",
                               extra_args=COMMON_ARGS)
        try:
            dep.start(flags={"prefill-0": RAILS, "decode-0": RAILS})
            dep.wait_links_ready(30.0)
            tx0, m0 = _tx(dep), _rail_metrics(dep)
            out = ask(dep, prompts, max_new_tokens=OUTPUT)
            tx1, m1 = _tx(dep), _rail_metrics(dep)
            by_source = dep.messenger_stats("prefill-0", "prefill").get("requests_by_source", {})
        finally:
            dep.close()
    assert out["outputs"] == want, "MLA over rails changed the tokens"
    sent = {i: tx1[i] - tx0[i] for i in tx1}
    posted = {k: m1[k] - m0.get(k, 0) for k in m1}
    print(f"\nMLA over rails: requests by source rank {by_source}; prefill host sent {sent} bytes; "
          f"per-rail KV posted {posted}", file=sys.stderr)
    assert sorted(int(k) for k, v in by_source.items() if v) == [0, 1], by_source
    assert all(v > 0 for v in posted.values()) and set(posted) == {0, 1}, posted
    assert sent["rail1"] >= posted[1], (sent, posted)  # what rail 1 carried crossed rail1 (headers on top)
