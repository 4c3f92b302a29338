"""The messenger's metrics port under a connection flood (messenger/metrics_http.py): the
real MessengerMetrics listener, real sockets. Idle and trickling connections neither hold
threads nor keep a scraper out; what was cut is counted in the exported metrics."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from sglang_disagg.messenger import metrics_http
from sglang_disagg.messenger.metrics import MessengerMetrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def metrics():
    m = MessengerMetrics("decode", "127.0.0.1", _free_port())
    yield m
    m.close()


def _scrape(m: MessengerMetrics, timeout: float = 1.0) -> str:
    port = m.server.server_address[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.read().decode()


def _dropped(text: str, why: str) -> float:
    line = next(ln for ln in text.splitlines()
                if ln.startswith(f'sglang_disagg_metrics_connections_dropped{{why="{why}"}}'))
    return float(line.split()[-1])


def _closed(sock: socket.socket, timeout: float) -> bool:
    """True when the server closed or reset `sock` within `timeout`."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_flood_of_idle_connections_neither_holds_threads_nor_keeps_a_scraper_out(metrics):
    port = metrics.server.server_address[1]
    threads_before = threading.active_count()
    flood = []
    try:
        for _ in range(10 * metrics_http.MAX_CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"G")  # a request head begun, never finished
            flood.append(s)
        t0 = time.monotonic()
        text = _scrape(metrics)  # a newcomer: it evicts the oldest idle one
        took = time.monotonic() - t0
        assert "sglang_disagg_kv_writes_total" in text
        assert took < 1.0, f"a scrape during the flood took {took:.2f} s"
        assert metrics.server.live() <= metrics_http.MAX_CONNECTIONS
        # One handler thread per live connection at most (plus ours); 320 connections were opened.
        grown = threading.active_count() - threads_before
        assert grown <= metrics_http.MAX_CONNECTIONS + 2, f"{grown} threads for {len(flood)} connections"
        evicted = _dropped(text, "evicted")
        assert evicted >= len(flood) - metrics_http.MAX_CONNECTIONS, (evicted, len(flood))
        assert _closed(flood[0], 1.0), "the oldest idle connection was not cut"
    finally:
        for s in flood:
            s.close()


def test_one_byte_at_a_time_does_not_hold_a_connection_past_the_request_deadline(metrics):
    port = metrics.server.server_address[1]
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    cut_after = None
    try:
        # A byte every 0.3 s: a per-recv timeout would never fire; the whole-request deadline does.
        for ch in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 40:
            try:
                s.sendall(bytes([ch]))
            except OSError:
                cut_after = time.monotonic() - t0
                break
            if _closed(s, 0.3):
                cut_after = time.monotonic() - t0
                break
    finally:
        s.close()
    assert cut_after is not None, "a trickling request held its connection for 12 s"
    limit = metrics_http.REQUEST_DEADLINE_S + 1.0  # the deadline plus the serving loop's sweep, with room
    assert cut_after < limit, f"cut after {cut_after:.2f} s (deadline {metrics_http.REQUEST_DEADLINE_S} s)"
    assert _dropped(_scrape(metrics), "deadline") >= 1


def test_an_answer_slower_than_the_deadline_is_still_sent(metrics, monkeypatch):
    """The deadline is the client's: a GET read whole is answered however long the answer
    takes (a scheduler busy on one core renders a scrape late; a cut connection there once
    failed a drain's progress poll)."""
    monkeypatch.setattr(metrics_http, "REQUEST_DEADLINE_S", 0.3)
    slow = metrics_http.REQUEST_DEADLINE_S + 4 * metrics_http._SWEEP_S

    def late(environ):
        time.sleep(slow)
        return "200 OK", {"late": True}

    metrics.server.routes.add("/late", late)
    port = metrics.server.server_address[1]
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/late", timeout=5) as r:
        assert r.read() == b'{"late": true}'
    assert time.monotonic() - t0 >= slow, "the answer really came after the deadline"
    assert _dropped(_scrape(metrics), "deadline") == 0
    # the client's part stays under it: a request line that never ends is cut
    s = socket.create_connection(("127.0.0.1", port))
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert _closed(s, metrics_http.REQUEST_DEADLINE_S + 1.0), "headers never ended, the connection stayed"
    finally:
        s.close()
    assert _dropped(_scrape(metrics), "deadline") == 1
