"""The decoder's /drain door (messenger/migration/drain.py) in isolation, through the bounded
metrics server it is served by: the admin key is required (constant-time compare; a decoder
without one refuses every drain), the body is untrusted (targets must be http://host:port,
bounded in number and size), a valid POST hands the targets to the scheduler once and says
so, GET returns what the scheduler published, and the metrics stay keyless beside it."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from sglang_disagg.messenger import metrics_http
from sglang_disagg.messenger.migration.drain import MAX_TARGETS, DrainDoor, DrainError, targets_of

KEY = "admin-key-123"


@pytest.fixture
def served():
    reg = CollectorRegistry()
    Counter("some_total", "a metric", registry=reg).inc()
    woke = threading.Event()
    door = DrainDoor(KEY, woke.set)
    srv = metrics_http.serve("127.0.0.1", 0, reg)
    srv.routes.add("/drain", door)
    yield srv.server_address[1], door, woke
    srv.shutdown()
    srv.server_close()


def _call(port: int, method: str, path: str = "/drain", body: bytes | None = None, key: str | None = KEY):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(method, path, body, {"Authorization": f"Bearer {key}"} if key is not None else {})
    r = conn.getresponse()
    return r.status, r.read()


def test_a_drain_needs_the_admin_key_and_hands_its_targets_over_once(served):
    port, door, woke = served
    assert _call(port, "POST", body=b'{"to": ["http://b:1"]}', key=None)[0] == 401
    assert _call(port, "POST", body=b'{"to": ["http://b:1"]}', key="admin-key-12")[0] == 401
    assert door.take() is None and not woke.is_set()
    status, body = _call(port, "POST", body=b'{"to": ["http://b:1/", "http://c:2", "http://b:1"]}')
    assert status == 202 and json.loads(body) == {"draining": True, "to": ["http://b:1", "http://c:2"]}
    assert woke.is_set() and door.take() == ("http://b:1", "http://c:2") and door.take() is None
    door.publish({"draining": True, "running": 3, "done": False})
    status, body = _call(port, "GET")
    assert status == 200 and json.loads(body)["running"] == 3
    assert _call(port, "DELETE")[0] == 405
    status, body = _call(port, "GET", "/metrics", key=None)  # the metrics stay keyless
    assert status == 200 and b"some_total 1.0" in body


def test_a_decoder_without_an_admin_key_refuses_every_drain():
    door = DrainDoor(None, lambda: None)
    status, body = door({"REQUEST_METHOD": "POST", "HTTP_AUTHORIZATION": "Bearer "})
    assert status.startswith("403") and "no admin key" in body["error"]


@pytest.mark.parametrize("body,why", [
    (b"not json", "not JSON"), (b"[]", '"to" must list'), (b'{"to": []}', '"to" must list'),
    (b'{"to": "http://b:1"}', '"to" must list'),
    (json.dumps({"to": [f"http://b:{i}" for i in range(MAX_TARGETS + 1)]}).encode(), '"to" must list'),
    (b'{"to": ["file:///etc/passwd"]}', "not a decoder URL"), (b'{"to": ["http://b:1/x"]}', "not a decoder URL"),
    (b'{"to": [5]}', "not a decoder URL"), (b'{"to": ["https://b:1"]}', "not a decoder URL"),
])
def test_a_bad_body_is_refused_with_the_reason(served, body, why):
    with pytest.raises(DrainError, match=why):
        targets_of(body)
    port, door, _ = served
    status, answer = _call(port, "POST", body=body)
    assert status == 400 and why in json.loads(answer)["error"] and door.take() is None


def test_a_stop_waits_for_relays_through_a_silent_door_and_not_past_it(served, monkeypatch):
    """launch/drain.relaying: Stack.stop's hold. A door that stops answering for a moment (a
    scheduler busy on one core) still means relays run; silent for UNREACHABLE_S, it does not."""
    from sglang_disagg.launch import drain as launch_drain

    port, door, _ = served
    monkeypatch.setattr(launch_drain, "UNREACHABLE_S", 0.5)
    monkeypatch.setattr(launch_drain, "headers", lambda key: {"Authorization": f"Bearer {key}"})
    target = launch_drain.DrainTarget("http://127.0.0.1:1", f"http://127.0.0.1:{port}/drain")
    still = launch_drain.relaying(target, KEY)
    door.publish({"draining": True, "running": 0, "relaying": 2, "done": True})
    assert still() is True
    door.publish({"draining": True, "running": 1, "relaying": 2, "done": False})
    assert still() is False, "something still runs here: not only relays"
    door.publish({"draining": True, "running": 0, "waiting": 1, "relaying": 2, "done": False})
    assert still() is False, "a request still waits for its first token here: not only relays"
    door.publish({"draining": True, "running": 0, "relaying": 2, "done": True})
    assert still() is True
    silent = launch_drain.relaying(launch_drain.DrainTarget("http://127.0.0.1:1", "http://127.0.0.1:9/drain"), KEY)
    assert silent() is True, "one unanswered poll is not the end of the relays"
    t0 = time.monotonic()
    while silent() and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert 0.5 <= time.monotonic() - t0 < 2.0, "a door silent for UNREACHABLE_S ends the wait"
    door.publish({"draining": True, "running": 0, "relaying": 0, "done": True})
    assert still() is False
