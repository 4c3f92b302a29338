"""Rails end to end: a prefill host and a decode host with two rails each (eth0 on 10.77.0.0/24,
rail1 on 10.77.1.0/24, harness/hosts/netns.py), the deployment started with `--rails eth0,rail1`
on both servers, libfabric tcp, prefill TP 2 -> decode TP 1.

What is judged: tokens exact against colocated; the KV bytes leaving the prefill host split over
its two interfaces, read from the kernel's counters (`tx_bytes` of each veth, so control
traffic on eth0 is counted too: the prompts are long, so KV dominates), each within 35-65 % of
the total; the prefill server's own per-rail metrics agree. A lost rail: rail1 into the decode host capped
so a transfer is slow, its link cut right after the request's first writes crossed it (the decode
host's rail1 counter, not a timer) and restored 3 s later: the request fails (the router may
retry it, then it must be exact) within the fault deadline by the decoder's own clock, neither
server holds a page after, the rail is back in use once it answers (its metric and the kernel's
counters), tokens exact. Then the prefill server is restarted with
one rail (`--rails eth0`; the decoder and router stay): the two sides link (the decoder's rail1
shares no network with the prefill's one rail and is left out), tokens stay exact and rail1
carries nothing. Issue 42's lost
rail (a link cut mid-transfer) is not built yet: docs/backends.md, Rails.
"""

from __future__ import annotations

import re
import sys
import time

import pytest

from harness.hosts import netns
from harness.hosts.deployment import Deployment, Layout
from sglang_disagg.launch.config import Ports

from e2e.faultlib import FAULT_DEADLINE_S, scrape, value, wait_for, wait_released
from harness.hosts import inside
from sglang_disagg.messenger.entry import LATE_WRITES_S

from .conftest import COMMON_ARGS, LONG_OUTPUT, ask
from .netfaults import HostCall

pytestmark = pytest.mark.e2e

LAYOUT = Layout(prefill_tp=2)
RAILS = ("--rails", "eth0,rail1")
CAP_MBIT = 20  # rail1 into the decode host, while a rail is lost: 1500 tokens' KV half there takes ~1.2 s
CUT_S = 3.0
RAIL_BYTES = re.compile(r'^sglang_disagg_rail_bytes\{rail="(\d+)"\} ([0-9.e+]+)$', re.M)
SCRAPE = ("import sys, urllib.request\n"
          "print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())\n")


@pytest.fixture(scope="module")
def dep(hosts_possible, colocated, tmp_path_factory):
    with netns.Network.create("rl", LAYOUT.names, rails=2) as net:
        d = Deployment.write(tmp_path_factory.mktemp("rails") / "deployment", net, LAYOUT, backend="libfabric",
                             provider="tcp", extra_args=COMMON_ARGS)
        try:
            d.start(flags={"prefill-0": RAILS, "decode-0": RAILS})
            d.wait_links_ready(30.0)
            yield d
        finally:
            d.close()


@pytest.fixture(scope="module")
def rail_prompts(colocated):
    longs = colocated["long"]
    return [longs[f"rails-{i}"] for i in range(6)]


def _tx(dep: Deployment) -> dict[str, int]:
    host = dep.net[dep.layout.prefill[0]]
    return {i: host.counters(i)["tx_bytes"] for i in ("eth0", "rail1")}


def _rail_metrics(dep: Deployment) -> dict[int, float]:
    host = dep.net[dep.layout.prefill[0]]
    url = f"http://{host.address}:{Ports(dep.port).prefill_metrics}/metrics"
    r = host.run([sys.executable, "-c", SCRAPE, url], timeout=30)
    assert r.returncode == 0, r.stderr
    return {int(k): float(v) for k, v in RAIL_BYTES.findall(r.stdout)}


def _send(dep: Deployment, pairs: list[tuple[list[int], list[int]]]) -> dict[str, int]:
    """The prompts through the router, tokens checked; bytes each prefill interface sent meanwhile."""
    before = _tx(dep)
    out = ask(dep, [p for p, _ in pairs], max_new_tokens=LONG_OUTPUT)
    assert out["outputs"] == [want for _, want in pairs], "rails changed the tokens"
    after = _tx(dep)
    return {i: after[i] - before[i] for i in after}


def test_two_rails_each_carry_a_share_and_tokens_are_exact(dep, rail_prompts, reference):
    prompts, want = reference
    out = ask(dep, prompts)  # the short e2e prompts first: exact, whatever rails they took
    assert out["outputs"] == want
    m0 = _rail_metrics(dep)
    sent = _send(dep, rail_prompts[:2])
    m1 = _rail_metrics(dep)
    total = sum(sent.values())
    shares = {i: round(v / total, 3) for i, v in sent.items()}
    posted = {k: m1[k] - m0.get(k, 0) for k in m1}
    print(f"\nrails: prefill host sent {sent} bytes (shares {shares}); its rail metrics {posted}")
    assert total > 4 << 20, sent  # two 1500-token prompts' KV: megabytes, not control chatter
    assert all(0.35 <= s <= 0.65 for s in shares.values()), shares
    assert set(posted) == {0, 1} and all(0.35 <= v / sum(posted.values()) <= 0.65 for v in posted.values()), posted


def _metrics(dep: Deployment, host_name: str, port: int) -> dict:
    h = dep.net[host_name]
    return inside.call(h, scrape, h.address, port)


def test_a_lost_rail_fails_its_requests_in_time_frees_everything_and_comes_back(dep, rail_prompts):
    net, ports = dep.net, Ports(dep.port)
    prefill, decode = dep.layout.prefill[0], dep.layout.decode
    port = net[decode].rails[0][2]  # rail1's switch port into the decode host
    net.tc("qdisc", "replace", "dev", port, "root", "tbf", "rate", f"{CAP_MBIT}mbit", "burst", "32kb",
           "latency", "400ms")
    before = _metrics(dep, decode, ports.decode_metrics)
    prompt, want = rail_prompts[4]
    rx0 = net[decode].counters("rail1")["rx_bytes"]
    call = HostCall(net[dep.layout.router], dep.url, prompt, LONG_OUTPUT, 60.0, api_key=dep.keys.api)
    try:
        wait_for("the request's first writes on rail1", lambda: net[decode].counters("rail1")["rx_bytes"] - rx0
                 > 256 << 10, 60, 0.005)
        net.link(decode, False, rail=1)
        cut_at, cut_unix = time.monotonic(), time.time()
        down = wait_for("the prefill server to mark rail 1 down", lambda: value(
            _metrics(dep, prefill, ports.prefill_metrics), "sglang_disagg_rail_up", rail="1") == 0, 10, 0.05)
        assert down
        time.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))
    finally:
        net.link(decode, True, rail=1)
        up_at = time.monotonic()
        net.tc("qdisc", "del", "dev", port, "root")
    call.result(60)
    after = _metrics(dep, decode, ports.decode_metrics)
    causes = {dict(k[1:])["cause"]: v - before.get(k, 0.0) for k, v in after.items()
              if k[0] == "sglang_disagg_failures_total" and v - before.get(k, 0.0)}
    failed = sum(causes.values())
    failed_at = max(v for k, v in after.items() if k[0] == "sglang_disagg_last_failure_timestamp_seconds")
    detect = failed_at - cut_unix
    print(f"\nlost rail: the decoder failed the request ({causes}) {detect:.3f} s after the cut; client "
          f"{'got ' + repr(call.err)[:160] if call.err else 'got its tokens (the router retried)'}")
    assert failed >= 1, "the lost rail failed no request"
    assert 0 < detect < FAULT_DEADLINE_S, f"failed {detect:.3f} s after the cut (deadline {FAULT_DEADLINE_S} s)"
    assert call.err is not None or call.out == want, "a retried request must be exact"
    # nothing held once the link is back: the stalled writes arrive, the decoder frees what it held for them
    for host_name, mport in ((decode, ports.decode_metrics), (prefill, ports.prefill_metrics)):
        h = net[host_name]
        took, left = inside.call(h, wait_released, h.address, mport, up_at, LATE_WRITES_S + 5,
                                 timeout=LATE_WRITES_S + 20)
        print(f"{host_name}: held nothing {took:.2f} s after the link came back (left {left})")
        assert left == 0, f"{host_name} still holds {left} pages/requests"
    back = wait_for("rail 1 back in use", lambda: value(
        _metrics(dep, prefill, ports.prefill_metrics), "sglang_disagg_rail_up", rail="1") == 1, 15, 0.1)
    assert back
    dep.wait_links_ready(15)
    sent = _send(dep, [rail_prompts[5]])
    shares = {i: v / sum(sent.values()) for i, v in sent.items()}
    print(f"after the rail came back: {sent} bytes ({shares})")
    assert all(s > 0.2 for s in shares.values()), shares


def test_one_rail_to_two_links_and_stays_exact(dep, rail_prompts):
    dep.nodes["prefill-0"].stop()
    deadline = time.monotonic() + 120
    dep.launch("prefill-0", dep.layout.prefill[0], "--rails", "eth0").wait_up(deadline)
    dep.wait_links_ready(max(1.0, deadline - time.monotonic()))
    sent = _send(dep, rail_prompts[2:])
    print(f"\nrails 1 -> 2: prefill host sent {sent} bytes")
    assert sent["eth0"] > 4 << 20 and sent["rail1"] < 64 << 10, sent  # the prefill's rail1 is not in use
