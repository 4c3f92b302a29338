"""Token-exact disaggregation across separate hosts, with proof the KV crossed the link.

Each case starts prefill, decode and the router on three hosts (netns.py) from one
deployment file with the public launcher, sends the e2e prompts through the router from
inside the router's host, and compares with the colocated reference. The KV must have
entered the decode host through its link: the decode host's eth0 received at least as
many bytes as the decoder's messenger counted as KV (sglang_disagg_kv_bytes), and that
count is at least the prompts' KV (tokens x layers x 2 x KV heads x head dim x 4 bytes,
less the pages its radix cache reused), so neither shared memory nor cross-memory
attach can have carried it. Then, with the deployment still up, a fourth host that is no
part of it probes every port of every node (exposure.py) and the stack must still serve
token-exact: its HTTP ports ask for keys (http_keys.py: SGLang's /generate, /get_server_info
and admin endpoints and the router's POST /workers refuse a request without one, the router
serves a client holding the API key), and no key shows on any process's command line.
"""

from __future__ import annotations

import pytest

from e2e.conftest import assert_same
from harness.hosts.deployment import Layout
from harness.hosts.tail import Geometry

from . import exposure
from .conftest import ask, deployment

pytestmark = pytest.mark.e2e


# Data planes that let a host outside the deployment into registered memory whatever the
# secret (their protocols carry no authentication: docs/security.md, "Exposure across hosts"). Anything
# else the exposure check finds broken fails the test; what is known open makes the test an
# expected failure (XFAIL, with the findings) once every other check passed.
KNOWN_OPEN = {"nixl": ("UCX tcp interface",), "mooncake": ("Mooncake handshake", "Mooncake TCP transport")}

CASES = {
    "libfabric-tcp-tp2": dict(backend="libfabric", provider="tcp", tp=2),
    "nixl-ucx-tcp": dict(backend="nixl", tp=1),
    "mooncake-tcp": dict(backend="mooncake", tp=1),
}


@pytest.mark.parametrize("network", [Layout(outside=("outside",)).names], indirect=True)
@pytest.mark.parametrize("case", CASES)
def test_token_exact_across_hosts_and_the_kv_crossed_the_link(tmp_path, network, reference, case):
    c = CASES[case]
    prompts, expected = reference
    dep = deployment(tmp_path, network, Layout(prefill_tp=c["tp"], outside=("outside",)), backend=c["backend"],
                     provider=c.get("provider"))
    try:
        dep.start()
        before = network["decode"].counters()
        got = ask(dep, prompts)
        after = network["decode"].counters()
        _, broken = exposure.probe(dep, network, "outside", reference)
    finally:
        dep.close()
    known = KNOWN_OPEN.get(c["backend"], ())
    unexpected = [b for b in broken if not (known and "registered memory" in b and any(k in b for k in known))]
    for b in broken:
        print(("UNEXPECTED " if b in unexpected else "known open: ") + b)
    assert not unexpected, f"{len(unexpected)} exposure promise(s) broken:\n" + "\n".join(unexpected)
    open_now = [b for b in broken if b not in unexpected]
    # A backend known to be open that the probe found closed: fixed upstream, or a probe that
    # did not reach it. Either way the list and docs/security.md must be looked at again.
    assert bool(open_now) == bool(known), f"{c['backend']}: known open {known}, the probe found {open_now or 'none'}"
    assert_same(got["outputs"], expected, prompts)
    kv = got["kv_bytes"] - got["kv_bytes_before"]
    # Every prompt but the 1-token one leaves the decoder; the repeated long prompt and the
    # shared prefix are served partly from the decoder's radix cache: count only the first
    # long prompt and the short ones as the floor.
    floor = sum(len(p) - 1 for p in prompts[1:7]) * Geometry.of("tiny-llama").bytes_per_token
    assert kv >= floor, f"the decoder counted {kv:.0f} KV bytes, less than the prompts' {floor}"
    rx = after["rx_bytes"] - before["rx_bytes"]
    tx = after["tx_bytes"] - before["tx_bytes"]
    print(f"{case}: KV {kv:.0f} B, decode eth0 rx {rx} B ({rx / kv:.2f}x), tx {tx} B")
    assert rx >= kv, f"decode host's link received {rx} B, less than the {kv:.0f} B of KV the decoder counted"
    if open_now:  # reported as an expected failure, with its reason, once everything else held
        pytest.xfail(f"known open ({len(open_now)}), by the library's design (docs/security.md, \"Exposure across "
                     f"hosts\"): " + "; ".join(open_now))
