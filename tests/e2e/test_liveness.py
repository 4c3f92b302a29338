"""On the launcher's default stack (router -> decoder -> prefill server, shmem):

- liveness apart from load: long prompts keep the prefill server busy while short requests
  flow through the router; none fails, each is token-exact, and the servers' /health
  answers at once throughout (the launcher sets SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0,
  so a busy scheduler is never probed by a generation);
- fault case 5: a client closes its streaming request mid-prefill and mid-decode; both
  servers free every page and forget the request within FAULT_DEADLINE_S. (SGLang aborts a
  departed streaming client's request after a fixed 2 s; our tokenizer_manager patch makes
  that delay sglang_disagg's, and the launcher sets 0.2 s.)
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

from sglang_disagg.launch.client import generate_ids, greedy

from .conftest import OUTPUT_TOKENS
from .faultlib import (FAULT_DEADLINE_S, SIGCONT, SIGSTOP, Call, long_prompt, row, scrape, signal_group, value,
                       wait_for, wait_released)

pytestmark = pytest.mark.e2e



def metrics(stack, role: str) -> dict:
    port = stack.cfg.ports.prefill_metrics if role == "prefill" else stack.cfg.ports.decode_metrics
    return scrape(stack.cfg.host, port)


def health_latency(url: str) -> float:
    t = time.monotonic()
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200
    return time.monotonic() - t


def test_a_busy_prefill_server_is_not_a_dead_one(stack, references):
    prompts, outputs = references("tiny-llama")
    for p in stack.servers:  # what makes /health independent of the scheduler
        environ = open(f"/proc/{p.pid}/environ", "rb").read().split(b"\0")
        assert b"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0" in environ, p.spec.name
    stop, busy_errors, long_done = threading.Event(), [], [0]

    def keep_busy(seed: int) -> None:  # back-to-back long prompts, each new to every cache
        while not stop.is_set():
            try:
                generate_ids(stack.url, long_prompt(1200, seed), 2)
                long_done[0] += 1
            except Exception as e:  # noqa: BLE001 - reported below
                busy_errors.append(e)
            seed += 100
    loaders = [threading.Thread(target=keep_busy, args=(s,)) for s in (1, 2)]
    for t in loaders:
        t.start()
    short, health = [], []
    try:
        end = time.monotonic() + 8.0  # > 2 router health checks (every 2 s, 2 failures = dead)
        i = 0
        while time.monotonic() < end:
            k = 2 + i % 4  # short reference prompts
            short.append((k, Call(stack.url, prompts[k], OUTPUT_TOKENS)))
            health.append(max(health_latency(p.url) for p in stack.servers))
            time.sleep(0.3)
            i += 1
        results = [(k, c.result(60)) for k, c in short]
    finally:
        stop.set()
        for t in loaders:
            t.join(60)
    assert not busy_errors, busy_errors[:2]
    assert long_done[0] >= 2, "the long prompts never kept the prefill server busy"
    failed = [(k, c.err) for k, c in results if c.err is not None]
    assert not failed, failed[:3]
    assert all(c.out == outputs[k] for k, c in results)
    assert max(health) < 1.0, f"/health took {max(health):.2f}s under load"
    print(f"\nliveness | {len(results)} short requests, {long_done[0]} long prompts, 0 failed, "
          f"max /health {max(health) * 1000:.0f} ms", flush=True)


def _open_stream(stack, prompt: list[int], max_new_tokens: int, port: int | None = None) -> socket.socket:
    body = json.dumps({"input_ids": prompt, "sampling_params": greedy(max_new_tokens), "stream": True}).encode()
    sock = socket.create_connection((stack.cfg.host, port or stack.cfg.port), timeout=30)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _freed(stack, since: float) -> tuple[float, float]:
    t_d, leak_d = wait_released(stack.cfg.host, stack.cfg.ports.decode_metrics, since,
                                FAULT_DEADLINE_S)
    t_p, leak_p = wait_released(stack.cfg.host, stack.cfg.ports.prefill_metrics, since, FAULT_DEADLINE_S)
    return max(t_d, t_p), leak_d + leak_p


def test_a_client_leaving_mid_prefill_frees_both_servers(stack, references):
    """Straight to the decoder: before the first token nothing flows to the client, and
    the router notices a departed client only when it next writes to it (so through the
    router this case is bounded by the first token, then the mid-decode case applies)."""
    prefill = stack.servers[0]
    aborted = value(metrics(stack, "decode"), "sglang_disagg_failures_total", cause="aborted")
    writes = value(metrics(stack, "prefill"), "sglang_disagg_kv_writes_total")
    sock = _open_stream(stack, long_prompt(1500, 5), 400, port=stack.cfg.ports.decode)
    wait_for("prefill writing", lambda: value(metrics(stack, "prefill"), "sglang_disagg_kv_writes_total") > writes)
    signal_group(prefill, SIGSTOP)  # holds the prompt mid-prefill until SGLang's abort reached the decoder
    try:
        sock.close()
        t0 = time.monotonic()
        wait_for("the decoder's abort", lambda: value(metrics(stack, "decode"), "sglang_disagg_failures_total",
                                                      cause="aborted") > aborted,
                 FAULT_DEADLINE_S, 0.02)
        t_abort = time.monotonic() - t0
    finally:
        signal_group(prefill, SIGCONT)
    t_free, leak = _freed(stack, time.monotonic())
    assert leak == 0 and t_free < FAULT_DEADLINE_S
    prompts, outputs = references("tiny-llama")
    ok = generate_ids(stack.url, prompts[3], OUTPUT_TOKENS) == outputs[3]
    assert ok
    row("5 client left mid-prefill (stream closed)", t_abort, leak, ok,
        f"abort reached the decoder after {t_abort:.3f}s; pages freed {t_free:.3f}s after")


def test_a_client_leaving_mid_decode_frees_both_servers(stack, references):
    sock = _open_stream(stack, long_prompt(300, 6), 3000)
    got = b""
    while got.count(b"data:") < 3:  # a few tokens streamed: the request is decoding
        got += sock.recv(65536)
    sock.close()
    t0 = time.monotonic()
    t_free, leak = _freed(stack, t0)
    assert leak == 0 and t_free < FAULT_DEADLINE_S, (t_free, leak)
    prompts, outputs = references("tiny-llama")
    ok = generate_ids(stack.url, prompts[4], OUTPUT_TOKENS) == outputs[4]
    assert ok
    row("5 client left mid-decode (stream closed)", t_free, leak, ok,
        "time = close until both servers hold nothing")
