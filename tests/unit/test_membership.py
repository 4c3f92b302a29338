"""The deployment's membership (launch/membership.py) and the drain command's order of steps
(launch/drain.py), against a stand-in for smg's admin API and a decoder's drain door: logic in
isolation (tests/e2e/test_drain_router.py drains through the real router and decoders).
The stand-in answers as smg 1.13 was measured to: GET /workers lists every worker with its id,
a DELETE marks it draining (not healthy) and keeps it listed."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_disagg.launch.config import DrainMode, LaunchConfig, Role
from sglang_disagg.launch.drain import DrainFailed, DrainTarget, drain
from sglang_disagg.launch.membership import MAX_WORKERS, Member, MemberRole, Membership, MembershipError, normal

KEY = "admin-key-for-tests"


def worker(url: str, wid: str, running: int = 0, kind: str = "regular", status: str = "ready") -> dict:
    return {"id": wid, "url": url, "worker_type": kind, "is_healthy": status == "ready", "status": status,
            "engine_load": {"loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0}]}}


class Fake:
    """smg's /workers and one decoder's /drain, on one port; every call recorded."""

    def __init__(self, workers: list) -> None:
        self.workers, self.calls, self.door = workers, [], {"draining": False}
        self.creating: set[str] = set()  # URLs the router is adding already
        self.polls = 0
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a): pass

            def _reply(self, code: int, body) -> None:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _do(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.calls.append((method, self.path, body))
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    return self._reply(401, {"error": "no key"})
                if self.path == "/workers" and method == "GET":
                    return self._reply(200, fake.workers if isinstance(fake.workers, bytes) else {"workers": fake.workers})
                if self.path == "/workers" and method == "POST" and body["url"] in fake.creating:
                    # smg 1.13 when the URL is being added already (named on its command line):
                    # 409, and the worker is listed once its first health check passed
                    threading.Timer(0.3, fake.workers.append, (worker(body["url"], "late"),)).start()
                    return self._reply(409, {"error": f"Worker creation already in progress for URL "
                                                      f"'{body['url']}'", "code": "WORKER_CREATE_IN_PROGRESS"})
                if self.path == "/workers" and method == "POST":
                    fake.workers.append(worker(body["url"], f"id-{len(fake.workers)}"))
                    return self._reply(202, {"status": "accepted"})
                if self.path.startswith("/workers/") and method == "DELETE":
                    for w in fake.workers:
                        if w["id"] == self.path.split("/")[-1]:
                            w.update(is_healthy=False, status="draining")
                    return self._reply(202, {"status": "accepted"})
                if self.path == "/drain" and method == "POST":
                    fake.door = {"draining": True, "to": body["to"], "running": 3, "migrating": 3, "migrated": 0,
                                 "failed": 0, "refused": 0, "relaying": 0, "done": False}
                    return self._reply(202, fake.door)
                if self.path == "/drain" and method == "GET":
                    fake.polls += 1
                    if fake.polls >= 3:
                        fake.door |= {"running": 0, "migrating": 0, "migrated": 3, "relaying": 3, "done": True}
                    return self._reply(200, fake.door)
                self._reply(404, {"error": "no"})

            def do_GET(self): self._do("GET")
            def do_POST(self): self._do("POST")
            def do_DELETE(self): self._do("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def fake():
    f = Fake([worker("http://10.0.0.2:30002", "a", running=5), worker("http://10.0.0.3:30002", "b", running=1),
              worker("http://10.0.0.4:30002", "c", status="draining"), worker("http://10.0.0.5:30000", "p", kind="prefill")])
    yield f
    f.server.shutdown()


def test_a_worker_entry_is_parsed_from_untrusted_json_and_junk_is_dropped():
    m = Member.of(worker("http://h:1/", "x", running=2))
    assert (m.url, m.worker_id, m.role, m.healthy, m.running, m.leaving) == ("http://h:1", "x", MemberRole.DECODE,
                                                                             True, 2, False)
    assert Member.of(worker("http://h:1", "y", kind="prefill")).role is MemberRole.PREFILL
    for junk in (None, [], {"url": 3, "id": "x"}, {"url": "http://h:1"}, "text"):
        assert Member.of(junk) is None
    odd = worker("http://h:1", "z")
    odd["engine_load"] = {"loads": [{"num_running_reqs": "9"}, 7]}
    assert Member.of(odd).running == 0  # a count that is not an integer counts nothing
    with pytest.raises(ValueError, match="not a worker URL"):
        normal("file:///etc/passwd")


def test_the_targets_are_the_other_healthy_decoders_least_loaded_first(fake):
    m = Membership(fake.url, KEY)
    assert [x.url for x in m.others("http://10.0.0.9:30002")] == ["http://10.0.0.3:30002", "http://10.0.0.2:30002"]
    assert [x.url for x in m.others("http://10.0.0.3:30002/")] == ["http://10.0.0.2:30002"]
    with pytest.raises(MembershipError, match="HTTP 401"):
        Membership(fake.url, "wrong").members()


@pytest.mark.parametrize("reply, why", [(b"[1, 2]", "not JSON with"), (b"{\"workers\": 3}", "at most"),
                                        (json.dumps({"workers": [{}] * (MAX_WORKERS + 1)}).encode(), "at most"),
                                        (b"x" * (5 << 20), "over")])
def test_a_worker_list_that_is_not_one_is_refused_with_the_reason(fake, reply, why):
    fake.workers = reply
    with pytest.raises(MembershipError, match=why):
        Membership(fake.url, KEY).members()


def test_leaving_removes_by_id_once_and_joining_adds_only_what_is_not_listed(fake):
    m = Membership(fake.url, KEY)
    assert m.leave("http://10.0.0.2:30002") is True
    assert ("DELETE", "/workers/a", None) in fake.calls and not m.find("http://10.0.0.2:30002").healthy
    assert m.leave("http://10.0.0.2:30002") is False  # already draining: a second drain sends nothing
    assert m.leave("http://10.0.0.4:30002") is False and m.leave("http://10.9.9.9:1") is False
    assert sum(c[0] == "DELETE" for c in fake.calls) == 1
    assert m.join("http://10.0.0.3:30002") is False
    assert m.join("http://10.0.0.8:30002", api_key="k") is True
    assert ("POST", "/workers", {"url": "http://10.0.0.8:30002", "api_key": "k"}) in fake.calls


def test_joining_while_the_router_adds_the_same_url_itself_waits_for_it_instead_of_failing(fake):
    """A rendered deployment names its decoders on the router's command line, and each decoder
    also joins (to be drained by migration): the first Slurm run failed on smg's 409 here."""
    fake.creating.add("http://10.0.0.9:30002")
    m = Membership(fake.url, KEY)
    assert m.join("http://10.0.0.9:30002", wait_s=5) is False  # the router added it, not this call
    assert m.find("http://10.0.0.9:30002").healthy
    with pytest.raises(MembershipError, match="HTTP 401"):
        Membership(fake.url, "wrong").join("http://10.0.0.10:30002")


def test_a_drain_leaves_the_router_before_the_door_migrates_and_waits_until_done(fake):
    said: list[str] = []
    target = DrainTarget("http://10.0.0.2:30002", fake.url + "/drain")
    status = drain(target, KEY, router=fake.url, timeout_s=10, say=said.append)
    assert status["done"] and status["migrated"] == 3
    steps = [(c[0], c[1]) for c in fake.calls if c[0] != "GET"]
    assert steps == [("DELETE", "/workers/a"), ("POST", "/drain")]
    assert fake.calls[[c[1] for c in fake.calls].index("/drain")][2] == {"to": ["http://10.0.0.3:30002"]}
    assert any("migrated 3" in s for s in said) and any("sends http://10.0.0.2:30002 nothing new" in s for s in said)


def test_a_drain_with_nowhere_to_go_says_so_and_touches_nothing(fake):
    fake.workers[1]["status"] = "draining"
    with pytest.raises(DrainFailed, match="no other decoder"):
        drain(DrainTarget("http://10.0.0.2:30002", fake.url + "/drain"), KEY, router=fake.url, say=lambda s: None)
    assert all(c[0] == "GET" for c in fake.calls)


def test_the_local_door_is_the_launchers_port_plus_9():
    t = DrainTarget.local("10.1.2.3", 30000)
    assert (t.url, t.door) == ("http://10.1.2.3:30002", "http://10.1.2.3:30009/drain")
    assert DrainTarget.local("10.1.2.3", 30000, "http://decode-1:30002").url == "http://decode-1:30002"


@pytest.mark.parametrize("kw, why", [
    (dict(role=Role.DECODE, prefill_messengers=("h:1",), drain_mode=DrainMode.MIGRATE), "needs --router"),
    (dict(role=Role.ALL, router_url="http://r:1"), "--router: a messenger decoder's"),
    (dict(role=Role.DECODE, prefill_messengers=("h:1",), router_url="ftp://r"), "--router: not a worker URL"),
])
def test_a_migrating_decoder_needs_its_router_and_only_a_decoder_has_one(kw, why):
    with pytest.raises(ValueError, match=why):
        LaunchConfig(model="tiny-llama", **kw)
    ok = LaunchConfig(model="tiny-llama", role=Role.DECODE, prefill_messengers=("h:1",), router_url="http://r:1",
                      drain_mode=DrainMode.MIGRATE)
    assert ok.member == "http://127.0.0.1:30002"
