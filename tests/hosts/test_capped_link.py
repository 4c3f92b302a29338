"""Streaming hides the transfer behind the forward on a slow link between hosts; --no-stream does not.

Prefill, decode and the router on three hosts, the link into the decode host capped at
100 Mbit/s (the KV flows that way), small-llama (16 KiB of KV per token: 32 MiB for a
2048-token prompt, ~2.7 s on that link; each of its 8 layers computes for longer than
the layer's 4 MiB take to cross). One 2048-token request with the prefill streaming each
layer's KV, then the same deployment with only the prefill server restarted with
--no-stream (the cheapest way to a second configuration: the decoder and router stay, its
link reconnects), and one more request. The tail is "prefill forward end -> decoder
ready" (harness/hosts/tail.py).

Asserted is only what noise cannot produce: streaming's tail is shorter than --no-stream's
by at least half the predicted time of all layers but one. A loaded machine slows the
forward, which only widens the gap; the link's rate is the cap's, not the CPU's. The figures
themselves are the benchmark's (benchmarks/hosts.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from harness.hosts import shaping
from harness.hosts.deployment import Deployment, Layout
from harness.hosts.tail import Geometry, Probe, transfer_ms

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from single_request import prompt_of  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = "small-llama"
TOKENS = 2048
RATE_MBIT = 100
WARM_UP_TOKENS = 64


def test_streaming_tail_beats_no_stream_on_a_capped_link(tmp_path, network):
    geo = Geometry.of(MODEL)
    dep = Deployment.write(tmp_path / "deployment", network, Layout(), model=MODEL, backend="libfabric",
                           provider="tcp", max_total_tokens=3 * TOKENS,
                           extra_args=("--chunked-prefill-size", str(TOKENS), "--dtype", "float32"))
    probe = Probe(dep)
    rows = {}
    try:
        t0 = time.monotonic()
        dep.start()
        shaping.cap(network, "decode", RATE_MBIT)
        probe.warm_up(prompt_of(WARM_UP_TOKENS, 0), time.monotonic() + 60)
        rows["streaming"] = probe.measure(prompt_of(TOKENS, 1), "capped-streaming")
        dep.nodes["prefill-0"].stop()
        deadline = time.monotonic() + 120
        dep.launch("prefill-0", "prefill", "--no-stream").wait_up(deadline)
        dep.wait_links_ready(max(0.0, deadline - time.monotonic()))
        probe.warm_up(prompt_of(WARM_UP_TOKENS, 2), deadline)
        rows["no_stream"] = probe.measure(prompt_of(TOKENS, 3), "capped-no-stream")
        print(f"wall {time.monotonic() - t0:.0f} s")
    finally:
        dep.close()
    kv = rows["no_stream"]["kv_bytes"]
    predicted = transfer_ms(kv, RATE_MBIT)
    for name, r in rows.items():
        forward = f"{r['forward_ms']:.0f} ms" if r["forward_ms"] is not None else "not timed (--no-stream)"
        print(f"{name}: tail {r['tail_ms']:.0f} ms, TTFT {r['ttft_ms']:.0f} ms, KV {r['kv_bytes'] / 2**20:.1f} MiB, "
              f"forward {forward}; predicted transfer {predicted:.0f} ms at {RATE_MBIT} Mbit/s")
    assert kv >= (TOKENS - 1) * geo.bytes_per_token, f"the decoder counted {kv:.0f} KV bytes for {TOKENS} tokens"
    margin = 0.5 * predicted * (geo.layers - 1) / geo.layers
    gap = rows["no_stream"]["tail_ms"] - rows["streaming"]["tail_ms"]
    assert gap >= margin, (f"streaming's tail ({rows['streaming']['tail_ms']:.0f} ms) is only {gap:.0f} ms shorter "
                           f"than --no-stream's ({rows['no_stream']['tail_ms']:.0f} ms); at least {margin:.0f} ms "
                           f"(half the predicted {predicted:.0f} ms of all layers but one) was expected")
