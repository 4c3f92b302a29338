"""Live migration between decoders (issue 43), on real SGLang servers, over shmem and libfabric
tcp: a greedy request cut on decoder A at an exact output count (a test hook keyed by the
request id, not timing) continues on decoder B, and the client, still connected to A, gets
exactly the tokens of a request that never moved; nothing is recomputed (no prefill order for
it, the bytes A wrote are the request's KV, the floor) and both decoders hold nothing after.
Then the client leaving mid-relay, a target decoder that dies on the request (it stays on A,
exact), B killed and the A-B link cut mid-migration (half of the KV written: the request stays on
A, exact, nothing leaked), and A killed after the hand-over (B aborts it and frees its pages).

Stack: a prefill server and decoder A (launcher --role all; A is asked directly, as its router
would) and decoder B (--role decode) on the same prefill server. A's hook sends requests named
migrate-after-K-* to B after K outputs (migrate-after-K-port-P-* to 127.0.0.1:P)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time

import pytest

from sglang_disagg.launch import LaunchConfig, Role, Stack
from sglang_disagg.launch.client import RequestError, generate_ids, greedy, post_json
from sglang_disagg.launch.config import Ports
from sglang_disagg.messenger.planner import pages_for

from .conftest import COMMON_ARGS, JSON_SCHEMA, OUTPUT_TOKENS, next_port, structured_refs
from .faultlib import FAULT_DEADLINE_S, drop_connections, scrape, signal_group, value, wait_for, wait_released

pytestmark = pytest.mark.e2e

LONG = 80  # output tokens of the requests cut after 5 and after 50
BACKENDS = [("shmem", None), ("libfabric", "tcp")]


@contextlib.contextmanager
def decoder_pair(root, model: str, backend: str, provider: str | None = None, a_tp: int = 1, extra=(), env=(),
                 b_to_a: bool = False, **a_cfg):
    """A prefill server and decoder A (--role all, its test hook aimed at B; decode TP `a_tp`,
    more of its LaunchConfig in `a_cfg`) and decoder B (--role decode, TP 1) on the same
    prefill server, both with SGLang arguments `extra` and environment `env` too (`b_to_a`: B's
    test hook aimed at A); stopped on the way out."""
    a_port, b_port = next_port(), next_port()
    b_url = f"http://127.0.0.1:{Ports(b_port).decode}"
    common = dict(model=model, backend=backend, provider=provider, max_total_tokens=4096,
                  extra_args=COMMON_ARGS + tuple(extra))
    a = Stack.for_config(LaunchConfig(role=Role.ALL, port=a_port, log_dir=str(root / "a"), decode_tp=a_tp, **a_cfg,
                                      env=(("SGLANG_DISAGG_TEST_MIGRATE", f"to={b_url}"), *env), **common))
    b = None
    try:
        a.start()
        b = Stack.for_config(LaunchConfig(role=Role.DECODE, port=b_port, log_dir=str(root / "b"),
                                          secret_file=a.cfg.secret_file, env=tuple(env) + (
                                              (("SGLANG_DISAGG_TEST_MIGRATE", f"to={_decoder(a).url}"),)
                                              if b_to_a else ()),
                                          prefill_messengers=(f"127.0.0.1:{a.cfg.ports.bootstrap}",), **common))
        b.start()
        assert b.url == b_url, f"decoder B serves at {b.url}, the hook names {b_url}"
        yield a, b
    finally:
        if b is not None:
            b.stop()
        a.stop()


@pytest.fixture(scope="module", params=BACKENDS, ids=["shmem", "libfabric-tcp"])
def decoders(request, tmp_path_factory, references):
    backend, provider = request.param
    references("tiny-llama")  # the colocated reference first: one stack at a time on 2 cores
    with decoder_pair(tmp_path_factory.mktemp(f"migration-{backend}"), "tiny-llama", backend, provider) as pair:
        yield pair


def _decoder(a: Stack):
    return next(p for p in a.servers if p.spec.name == Role.DECODE.value)


def _m(stack: Stack, role: str = "decode") -> dict:
    port = stack.cfg.ports.prefill_metrics if role == "prefill" else stack.cfg.ports.decode_metrics
    return scrape(stack.cfg.host, port)


def _served(a: Stack) -> float:
    return value(_m(a, "prefill"), "sglang_disagg_requests_total", outcome="served")


def _migrations(a: Stack, outcome: str) -> float:
    return value(_m(a), "sglang_disagg_migrations_total", outcome=outcome)


def _traced(a: Stack, n: int) -> dict:
    """A's published stats once they hold `n` migration traces (a hand-over is published at once)."""
    wait_for(f"{n} migration traces published", lambda: len((a.messenger_stats("decode") or {}).get(
        "migrations", [])) >= n, 5, 0.05)
    return a.messenger_stats("decode")


def _free(*stacks: Stack) -> None:
    for s in stacks:
        t, leaked = wait_released(s.cfg.host, s.cfg.ports.decode_metrics, time.monotonic(), FAULT_DEADLINE_S)
        assert leaked == 0, f"{leaked} pages or requests held on {s.log_dir.name} {t:.2f}s after"


def test_a_request_cut_after_5_and_after_50_tokens_continues_on_the_other_decoder_exact(decoders, references):
    a, b = decoders
    prompts, outputs = references("tiny-llama")
    url, prompt = _decoder(a).url, prompts[-2]  # longer than a prefill chunk
    plain = generate_ids(url, prompt, LONG, rid="plain-1")
    assert plain[:OUTPUT_TOKENS] == outputs[-2], "the unmigrated run is the colocated one"
    carried_b = value(_m(b), "sglang_disagg_requests_total", outcome="carried")
    for n, k in enumerate((5, 50), 1):
        served, moved = _served(a), value(_m(a), "sglang_disagg_migration_bytes_total")
        got = generate_ids(url, prompt, LONG, rid=f"migrate-after-{k}-1")
        assert got == plain, f"migrated after {k} tokens: {got} != unmigrated {plain}"
        assert _served(a) == served + 1, "one prefill order (A's own); B's KV came from A, recomputing nothing"
        stats = _traced(a, n)
        trace = stats["migrations"][-1]
        assert trace["outputs_at_cut"] == k and trace["kv_tokens"] == len(prompt) + k - 1, trace
        floor = pages_for(trace["kv_tokens"], stats["page_size"]) * stats["kv_page_bytes"]
        assert trace["bytes"] == floor, f"A wrote {trace['bytes']} bytes, the request's KV is {floor}"
        assert value(_m(a), "sglang_disagg_migration_bytes_total") - moved == floor
        print(f"\nmigration | {a.cfg.transfer_backend} after {k}: {trace['kv_tokens']} tokens of KV, "
              f"{trace['bytes']} bytes ({trace['writes']} writes), hand-over {trace['hand_over_s'] * 1000:.1f} ms")
    assert value(_m(b), "sglang_disagg_requests_total", outcome="carried") == carried_b + 2
    assert _migrations(a, "failed") == 0 and value(_m(a), "sglang_disagg_migration_relays") == 0
    _free(a, b)


def test_a_json_schema_request_cut_after_5_tokens_ends_as_on_one_colocated_server(decoders, references):
    """B compiles the schema and replays A's 5 outputs through it before its first step: the
    constrained output is the colocated one, token for token."""
    a, b = decoders
    prompts, _ = references("tiny-llama")
    want = structured_refs["tiny-llama"]
    handed = _migrations(a, "handed_over")
    got = post_json(f"{_decoder(a).url}/generate", {
        "input_ids": prompts[-1], "rid": "migrate-after-5-json",
        "sampling_params": {"max_new_tokens": 48, "temperature": 0.0, "json_schema": json.dumps(JSON_SCHEMA)}}, 120)
    assert len(want["output_ids"]) > 5, "the reference outlives the cut"
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], (got["text"], want["text"])
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert _migrations(a, "handed_over") == handed + 1, "it moved (a refusal would have kept it on A)"
    _free(a, b)


def test_a_forged_migration_source_is_refused_without_contacting_anything(decoders):
    _, b = decoders
    with pytest.raises(RequestError, match="HTTP 400.*not authenticated"):
        post_json(f"{b.url}/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4},
                                       "bootstrap_host": "127.0.0.1", "bootstrap_port": 9,
                                       "bootstrap_room": 12345}, 30, api_key=b.api_key)
    links = (b.messenger_stats("decode") or {}).get("links", {})
    assert "127.0.0.1:9" not in links, "a forged source was contacted"


def _stream(url: str, prompt: list[int], n: int, rid: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"input_ids": prompt, "sampling_params": greedy(n), "stream": True, "rid": rid}).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_a_client_leaving_a_relayed_stream_aborts_it_on_the_new_decoder(decoders, references):
    a, b = decoders
    prompts, _ = references("tiny-llama")
    handed = _migrations(a, "handed_over")
    sock = _stream(_decoder(a).url, prompts[3], 3000, "migrate-after-5-leaves")
    got = b""
    while got.count(b"data:") < 20:  # past the cut: these tokens come from B
        got += sock.recv(65536)
    assert _migrations(a, "handed_over") == handed + 1
    running = lambda: value(_m(b), "sglang_disagg_queue_depth", queue="running")  # noqa: E731
    assert running() == 1, "the relayed request runs on B"
    sock.close()
    t0 = time.monotonic()
    wait_for("B aborting the request", lambda: running() == 0, FAULT_DEADLINE_S, 0.02)
    print(f"\nmigration | client left mid-relay: B stopped it {time.monotonic() - t0:.3f}s after")
    _free(a, b)


class FaultyTarget:
    """A fault injector in place of decoder B: it accepts A's request, reads it, and then dies
    (closes the connection without an answer, as a decoder killed mid-migration does) or, with
    `hang`, never answers."""

    def __init__(self, hang: bool = False) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port, self.hits, self.hang, self.conns = self.srv.getsockname()[1], 0, hang, []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            conn.recv(65536)
            self.hits += 1
            self.conns.append(conn) if self.hang else conn.close()

    def close(self) -> None:
        self.srv.close()
        for c in self.conns:
            c.close()


def dying_target_leaves_it_on_a(a: Stack, prompt: list[int], expected: list[int], tag: str) -> None:
    """A request sent by the hook to a FaultyTarget that dies on it continues on A, exact."""
    dying = FaultyTarget()
    failed = _migrations(a, "failed")
    got = generate_ids(_decoder(a).url, prompt, OUTPUT_TOKENS, rid=f"migrate-after-5-port-{dying.port}-{tag}")
    dying.close()
    assert dying.hits == 1, "the migration never reached the target"
    assert got == expected, "the request continued on A, exact"
    assert _migrations(a, "failed") == failed + 1


def test_a_target_that_dies_on_the_request_leaves_it_on_the_first_decoder_exact(decoders, references):
    a, b = decoders
    prompts, outputs = references("tiny-llama")
    dying_target_leaves_it_on_a(a, prompts[4], outputs[4], "x")
    _free(a, b)


def test_a_client_leaving_before_the_hand_over_frees_the_first_decoder(decoders, references):
    a, b = decoders
    prompts, _ = references("tiny-llama")
    hang = FaultyTarget(hang=True)
    try:
        sock = _stream(_decoder(a).url, prompts[3], 3000, f"migrate-after-5-port-{hang.port}-leaves")
        got = b""
        while got.count(b"data:") < 5:
            got += sock.recv(65536)
        wait_for("the target asked", lambda: hang.hits == 1, 10, 0.01)
        sock.close()  # the request is held on A for a target that never orders its KV
        t0 = time.monotonic()
        t, leaked = wait_released(a.cfg.host, a.cfg.ports.decode_metrics, t0, FAULT_DEADLINE_S)
        assert leaked == 0, f"{leaked} pages or requests still held on A {t:.2f}s after the client left"
        print(f"\nmigration | client left before the hand-over: A free {t:.3f}s after")
    finally:
        hang.close()


def _drain(a: Stack, method: str = "GET", body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", a.cfg.ports.decode_metrics, timeout=10)
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"Bearer {a.admin_key if key is None else key}", "Content-Type": "application/json"}
    conn.request(method, "/drain", data, headers)
    r = conn.getresponse()
    return r.status, json.loads(r.read() or b"{}")


class Streamed(threading.Thread):
    """A streaming greedy request to A, read to its end: its output ids, and how many events."""

    def __init__(self, url: str, prompt: list[int], n: int, rid: str) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.n, self.rid = url, prompt, n, rid
        self.out: list[int] | None = None
        self.events, self.err = 0, None
        self.start()

    def run(self) -> None:
        try:
            host, port = self.url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            conn.request("POST", "/generate", json.dumps({"input_ids": self.prompt, "rid": self.rid, "stream": True,
                                                          "sampling_params": greedy(self.n)}),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            for line in r:
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    ev = json.loads(line[5:])
                    if "error" in ev:
                        raise RuntimeError(ev["error"])
                    self.out, self.events = ev["output_ids"], self.events + 1
        except Exception as e:  # noqa: BLE001 - the test reports it
            self.err = e


def test_drain_moves_every_running_stream_to_the_other_decoder_and_each_ends_exact(decoders, references):
    a, b = decoders
    prompts, _ = references("tiny-llama")
    url, n = _decoder(a).url, 160
    assert _drain(a, key="wrong")[0] == 401
    assert _drain(a, "POST", {"to": ["file:///etc/passwd"]})[0] == 400
    chosen = [prompts[k] for k in (2, 3, 4, 5)]
    plain = [Streamed(url, p, n, f"plain-drain-{i}") for i, p in enumerate(chosen)]
    for t in plain:
        t.join(120)
    assert all(t.err is None and len(t.out) == n for t in plain), [t.err for t in plain]
    handed = _migrations(a, "handed_over")
    streams = [Streamed(url, p, n, f"drain-{i}") for i, p in enumerate(chosen)]
    wait_for("every stream decoding", lambda: all(t.events >= 5 for t in streams), 60, 0.01)
    code, body = _drain(a, "POST", {"to": [b.url]})
    assert code == 202 and body["draining"], body
    t0 = time.monotonic()
    wait_for("the drained decoder holding nothing", lambda: _drain(a)[1].get("done"), 10, 0.05)
    t_done = time.monotonic() - t0
    t_free, leaked = wait_released(a.cfg.host, a.cfg.ports.decode_metrics, t0, 10.0)
    assert leaked == 0
    still = sum(t.is_alive() for t in streams)
    for t in streams:
        t.join(120)
    assert [t.err for t in streams] == [None] * 4
    for i, (t, p) in enumerate(zip(streams, plain)):
        assert t.out == p.out, f"stream {i}: drained {t.out} != undrained {p.out}"
    status = _drain(a)[1]
    assert (status["migrated"], status["failed"], status["refused"], status["done"]) == (4, 0, 0, True), status
    assert _migrations(a, "handed_over") == handed + 4
    print(f"\nmigration | drain of 4 streams: A held nothing {t_done:.3f}s after POST /drain (pages free "
          f"{t_free:.3f}s), {still} streams still running then on B, each ended exact")
    _free(b)


def _kill(proc) -> None:
    """SIGKILL a server's process group and return once every member is gone."""
    import psutil

    def group(p) -> int | None:
        try:
            return os.getpgid(p.pid)
        except OSError:
            return None
    def alive(p) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE  # a dead child the launcher has not reaped yet is gone
        except psutil.NoSuchProcess:
            return False
    members = [p for p in psutil.process_iter() if group(p) == proc.pid]
    signal_group(proc, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in members):
        assert time.monotonic() < deadline, f"still alive 10 s after SIGKILL: {[p for p in members if alive(p)]}"
        time.sleep(0.005)
    proc.poll()


def _mid_migration(a: Stack, b: Stack, prompt: list[int], rid: str) -> Streamed:
    """A stream whose migration stalls with half of its KV written (the hook's -stall-: the rest
    goes out 3 s later): returned once B took A's order and waits for the rest."""
    t = Streamed(_decoder(a).url, prompt, LONG, rid)
    wait_for("B waiting for the writes A holds back", lambda: t.err is not None or value(
        _m(b), "sglang_disagg_requests_in_flight", phase="transfer") == 1, 60, 0.01)
    assert t.err is None, t.err
    return t


def test_the_new_decoder_killed_mid_migration_leaves_the_request_on_the_first_exact(decoders, references):
    a, b = decoders
    prompts, _ = references("tiny-llama")
    plain = generate_ids(_decoder(a).url, prompts[-2], LONG, rid="plain-b-killed")
    failed, handed = _migrations(a, "failed"), _migrations(a, "handed_over")
    t = _mid_migration(a, b, prompts[-2], "migrate-after-5-stall-b-killed")
    _kill(_decoder(b))  # B dies with half of the request's KV written into it
    t.join(60)
    assert t.err is None and t.out == plain, f"{t.err}: {t.out} != {plain}"
    assert (_migrations(a, "failed"), _migrations(a, "handed_over")) == (failed + 1, handed)
    _free(a)
    b.restart(Role.DECODE.value)  # the module's later tests need it


def test_the_link_between_the_decoders_dropped_mid_migration_leaves_the_request_on_the_first_exact(
        decoders, references):
    """B's control connection to A is cut while A holds back half of the writes: B fails the
    request (it cannot know its KV will complete), A keeps it and continues it exactly, and B
    frees its pages once the writes A still posted drained."""
    a, b = decoders
    prompts, _ = references("tiny-llama")
    plain = generate_ids(_decoder(a).url, prompts[-2], LONG, rid="plain-link-cut")
    failed = _migrations(a, "failed")
    t = _mid_migration(a, b, prompts[-2], "migrate-after-5-stall-link-cut")
    drop_connections(int(a.messenger_stats("decode")["address"].rsplit(":", 1)[1]))
    t.join(60)
    assert t.err is None and t.out == plain, f"{t.err}: {t.out} != {plain}"
    assert _migrations(a, "failed") == failed + 1
    for s in (a, b):
        _, leaked = wait_released(s.cfg.host, s.cfg.ports.decode_metrics, time.monotonic(), 10.0)
        assert leaked == 0, f"{leaked} pages or requests held on {s.log_dir.name}"


def test_the_first_decoder_killed_after_the_hand_over_lets_the_new_one_free_everything(decoders, references):
    a, b = decoders
    prompts, _ = references("tiny-llama")
    handed = _migrations(a, "handed_over")
    sock = _stream(_decoder(a).url, prompts[3], 3000, "migrate-after-5-orphan")
    got = b""
    while got.count(b"data:") < 20:
        got += sock.recv(65536)
    assert _migrations(a, "handed_over") == handed + 1
    running = lambda: value(_m(b), "sglang_disagg_queue_depth", queue="running")  # noqa: E731
    assert running() == 1
    _kill(_decoder(a))  # A's whole server, its relay with it
    t0 = time.monotonic()  # B's reaction is timed from A's death, not from the signal (teardown takes a while)
    wait_for("B dropping the orphaned request", lambda: running() == 0, FAULT_DEADLINE_S, 0.02)
    print(f"\nmigration | A killed after the hand-over: B stopped it {time.monotonic() - t0:.3f}s after")
    sock.close()
    _free(b)
    assert generate_ids(b.url, prompts[2], OUTPUT_TOKENS) is not None  # B keeps serving
