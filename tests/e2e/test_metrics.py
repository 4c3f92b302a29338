"""Each messenger server's Prometheus endpoint (prometheus_client's exposition format):
scraped before, during and after a request on the launcher's default stack, the values
move as the request's pages, writes and phases say they must."""

from __future__ import annotations

import threading
import time

import pytest

from sglang_disagg.launch.client import generate_ids
from sglang_disagg.messenger.planner import pages_for
from sglang_disagg.models import BUILTIN_MODELS

from . import faultlib
from .faultlib import value

pytestmark = pytest.mark.e2e

LAYERS, PAGE = 4, 16  # tiny-llama


def scrape(stack, role: str) -> dict[tuple, float]:
    port = stack.cfg.ports.prefill_metrics if role == "prefill" else stack.cfg.ports.decode_metrics
    return faultlib.scrape(stack.cfg.host, port)


def test_a_request_moves_both_servers_metrics(stack):
    n_tokens = 150  # a prompt no other test sends: no page is cached on either side
    prompt = [1] + [3000 + (i * 7) % 900 for i in range(n_tokens - 1)]
    dec0, pre0 = scrape(stack, "decode"), scrape(stack, "prefill")
    seen_running = []

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            seen_running.append(value(scrape(stack, "decode"), "sglang_disagg_queue_depth", queue="running"))
            time.sleep(0.05)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    try:
        out = generate_ids(stack.url, prompt, 48)
    finally:
        stop.set()
        watcher.join()
    assert len(out) == 48
    assert max(seen_running) >= 1, "the decoder's running batch was never seen holding the request"

    writes = pages_for(n_tokens - 1, PAGE) * LAYERS * 2
    deadline = time.monotonic() + 5
    while True:  # gauges and the prefill's release follow the request by a step or two
        dec, pre = scrape(stack, "decode"), scrape(stack, "prefill")
        if value(pre, "sglang_disagg_requests_total", outcome="served") > value(
                pre0, "sglang_disagg_requests_total", outcome="served") or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def moved(samples, before, name, **labels):
        return value(samples, name, **labels) - value(before, name, **labels)

    assert moved(dec, dec0, "sglang_disagg_requests_total", outcome="carried") == 1
    assert moved(dec, dec0, "sglang_disagg_kv_writes_total") == writes
    assert moved(pre, pre0, "sglang_disagg_kv_writes_total") == writes
    spec = BUILTIN_MODELS["tiny-llama"]  # one write = one page of K or V, float32
    assert moved(dec, dec0, "sglang_disagg_kv_bytes_total") == writes * PAGE * spec.num_kv_heads * \
        spec.resolved_head_dim * 4
    assert moved(pre, pre0, "sglang_disagg_kv_bytes_total") == moved(dec, dec0, "sglang_disagg_kv_bytes_total")
    assert moved(pre, pre0, "sglang_disagg_requests_total", outcome="served") == 1
    for phase in ("memory", "prefill", "first_step"):
        assert moved(dec, dec0, "sglang_disagg_ttft_phase_seconds_count", phase=phase) == 1, phase
    for phase in ("queue", "compute", "tail"):
        assert moved(pre, pre0, "sglang_disagg_ttft_phase_seconds_count", phase=phase) == 1, phase
    assert moved(dec, dec0, "sglang_disagg_request_transfer_seconds_count") == 1
    assert moved(pre, pre0, "sglang_disagg_layer_write_seconds_count") >= LAYERS  # streamed layer by layer
    for samples, before in ((dec, dec0), (pre, pre0)):
        failed = [k for k in samples if k[0] == "sglang_disagg_failures_total"]
        assert len(failed) >= 5 and all(samples[k] == before.get(k, 0.0) for k in failed)
    # Nothing held once it is over: no request in flight, pages back to the cache or the free list.
    assert sum(v for k, v in dec.items() if k[0] == "sglang_disagg_requests_in_flight") == 0
    pages = {k[1][1]: v for k, v in dec.items() if k[0] == "sglang_disagg_kv_pages"}
    assert pages["locked"] == 0 and pages["allocated"] == pages["cached"], pages


def test_a_prefix_the_decoder_reuses_is_unlocked_once_the_request_is_done(stack):
    prompt = [1] + [3500 + (i * 11) % 400 for i in range(149)]
    for _ in range(2):  # the second time, 9 of its pages come from the decoder's own radix tree
        assert len(generate_ids(stack.url, prompt, 8)) == 8
    time.sleep(0.5)
    pages = {k[1][1]: v for k, v in scrape(stack, "decode").items() if k[0] == "sglang_disagg_kv_pages"}
    assert pages["locked"] == 0 and pages["allocated"] == pages["cached"], pages
