"""Token-exact disaggregation across separate hosts, with proof the KV crossed the link.

Each case starts prefill, decode and the router on three hosts (netns.py) from one
deployment file with the public launcher, sends the e2e prompts through the router from
inside the router's host, and compares with the colocated reference. The KV must have
entered the decode host through its link: the decode host's eth0 received at least as
many bytes as the decoder's messenger counted as KV (sglang_disagg_kv_bytes), and that
count is at least the prompts' KV (tokens x layers x 2 x KV heads x head dim x 4 bytes,
less the pages its radix cache reused), so neither shared memory nor cross-memory
attach can have carried it.
"""

from __future__ import annotations

import pytest

from e2e.conftest import assert_same
from sglang_disagg.hosts.deployment import Layout

from .conftest import ask, deployment

pytestmark = pytest.mark.e2e

# tiny-llama: 4 layers, 2 KV heads of 64, float32
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4

CASES = {
    "libfabric-tcp-tp2": dict(backend="libfabric", provider="tcp", tp=2),
    "nixl-ucx-tcp": dict(backend="nixl", tp=1),
    "mooncake-tcp": dict(backend="mooncake", tp=1),
}


@pytest.mark.parametrize("case", CASES)
def test_token_exact_across_hosts_and_the_kv_crossed_the_link(tmp_path, network, reference, case):
    c = CASES[case]
    prompts, expected = reference
    dep = deployment(tmp_path, network, Layout(prefill_tp=c["tp"]), backend=c["backend"], provider=c.get("provider"))
    try:
        dep.start()
        before = network["decode"].counters()
        got = ask(dep, prompts)
        after = network["decode"].counters()
    finally:
        dep.close()
    assert_same(got["outputs"], expected, prompts)
    kv = got["kv_bytes"] - got["kv_bytes_before"]
    # Every prompt but the 1-token one leaves the decoder; the repeated long prompt and the
    # shared prefix are served partly from the decoder's radix cache: count only the first
    # long prompt and the short ones as the floor.
    floor = sum(len(p) - 1 for p in prompts[1:7]) * KV_BYTES_PER_TOKEN
    assert kv >= floor, f"the decoder counted {kv:.0f} KV bytes, less than the prompts' {floor}"
    rx = after["rx_bytes"] - before["rx_bytes"]
    tx = after["tx_bytes"] - before["tx_bytes"]
    print(f"{case}: KV {kv:.0f} B, decode eth0 rx {rx} B ({rx / kv:.2f}x), tx {tx} B")
    assert rx >= kv, f"decode host's link received {rx} B, less than the {kv:.0f} B of KV the decoder counted"
