"""The launcher's default stack against an attacker on the same host.

Every port the stack's processes listen on binds the configured interface only, and the
launcher names each of them. Then every port the messenger opens (the prefill messenger,
the decoder's transfer endpoint, both metrics endpoints) gets random bytes, another
protocol, truncated and oversized frames and wrong secrets; a peer that does hold the
secret sends orders with out-of-bounds page ids and token ids, which are refused with a
reason. Afterwards the stack still serves, token-exact, with no page left allocated. Last, a
slow-handshake connection flood (flood.py) while the decoder's control connection is dropped.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
from pathlib import Path

import psutil
import pytest

from sglang_disagg.backends import BackendConfig, TransferError, create_backend
from sglang_disagg.messenger import compat, wire
from sglang_disagg.models import ensure_model

from .conftest import DEFAULT, StackSpec, assert_same, run_sequential
from .faultlib import drop_connections, wait_until
from .flood import SlowFlood
from .test_metrics import scrape, value

pytestmark = pytest.mark.e2e
FRAME = struct.Struct("!IB")


def _stack_pids(stack) -> set[int]:
    pids = set()
    for p in stack.processes:
        root = psutil.Process(p.pid)
        pids |= {root.pid} | {c.pid for c in root.children(recursive=True)}
    return pids


def listening(stack) -> dict[int, str]:
    """port -> bound address, for every TCP socket the stack's processes listen on."""
    pids = _stack_pids(stack)
    return {c.laddr.port: c.laddr.ip for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids}


def test_every_port_binds_the_configured_interface_and_the_launcher_names_it(stack):
    found = listening(stack)
    assert found, "no listening socket found for the stack's processes"
    wildcard = {port: ip for port, ip in found.items() if ip != stack.cfg.host}
    assert not wildcard, f"ports bound beyond {stack.cfg.host}: {wildcard}"
    # Servers on one machine meet their TP ranks through a file, so dist-init ports stay closed.
    named = {port for what, port in stack.cfg.ports.all(stack.cfg.role, stack.cfg.mode).items()
             if "dist-init" not in what}
    assert named <= set(found), f"ports the launcher names but nothing listens on: {named - set(found)}"
    log = (Path(stack.log_dir) / "ports.txt").read_text()
    for port in named:
        assert f":{port}" in log


def held_pages(stack, role: str) -> float:
    """Pages allocated beyond what the radix cache holds (evictable): those of live requests."""
    samples = scrape(stack, role)
    return (value(samples, "sglang_disagg_kv_pages", state="allocated")
            - value(samples, "sglang_disagg_kv_pages", state="cached"))


def _decoder_control(stack) -> str:
    deadline = time.monotonic() + 10
    while not (stats := stack.messenger_stats("decode") or {}).get("address"):
        assert time.monotonic() < deadline, "the decoder published no address"
        time.sleep(0.2)
    return stats["address"]


def _hostile(address: str, payload: bytes) -> float:
    """Send `payload` without authenticating; seconds until the server hung up."""
    host, port = address.rsplit(":", 1)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(payload)
        s.settimeout(5)
        try:
            while s.recv(4096):
                pass
        except (ConnectionResetError, socket.timeout):
            pass
    return time.monotonic() - start


PAYLOADS = [random.Random(3).randbytes(1 << 16), b"GET / HTTP/1.1\r\n\r\n", FRAME.pack(0xFFFFFFFF, 1),
            FRAME.pack(20, 1) + b'{"v": 1, "backend":', b"SGDA\x01" + b"\x00" * 32 + b"\xff" * 32]


def _hello_for(stack, backend, pages: int) -> tuple[wire.Hello, list]:
    """A decoder's Hello as the real one would say it, with `pages` pages per region."""
    import torch

    from sglang_disagg.ipc import shm

    path = ensure_model(stack.cfg.model)
    c = json.loads((path / "config.json").read_text())
    page = stack.cfg.kv_page_size
    kv = wire.KVSpec(model=stack.cfg.model, fingerprint=compat.fingerprint(str(path)),
                     num_layers=c["num_hidden_layers"], kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                     v_head_dim=c["head_dim"], page_size=page, dtype="float32", layout="hnd", tp=1)
    buffers = [shm.shared_zeros((pages * page * kv.kv_heads * kv.head_dim,), torch.float32)
               for _ in range(kv.num_layers * 2)]
    descs = [backend.register(b.data_ptr(), b.numel() * 4)[1].decode() for b in buffers]
    ranks = (wire.RankEndpoint(0, backend.address, backend.instance, tuple(descs)),)
    return wire.Hello(decoder="fuzzer", backend=backend.name, provider=backend.provider, kv=kv, ranks=ranks), buffers


def _answer(backend, timeout: float = 5.0) -> wire.Message:
    _, raw = backend.recv(timeout)
    return wire.decode(raw)


def test_hostile_input_to_every_messenger_port_leaves_the_stack_serving_token_exact(stack, references):
    prompts, expected = references("tiny-llama")
    secret = Path(stack.cfg.secret_file).read_bytes().strip()
    cfg = stack.cfg
    control = [f"{cfg.host}:{cfg.ports.bootstrap}", _decoder_control(stack)]
    metrics = [f"{cfg.host}:{cfg.ports.prefill_metrics}", f"{cfg.host}:{cfg.ports.decode_metrics}"]
    # The junk flows, round after round, while legitimate requests are served token-exact.
    sent: list[tuple[str, bytes, float]] = []
    stop = threading.Event()

    def junk() -> None:
        while not stop.is_set() or not sent:
            for address in control + metrics:
                for payload in PAYLOADS:
                    sent.append((address, payload, _hostile(address, payload)))

    flow = threading.Thread(target=junk, daemon=True)
    flow.start()
    try:
        during = run_sequential(stack.url, prompts[2:5])
    finally:
        stop.set()
        flow.join(120)
    assert not flow.is_alive()
    assert_same(during, expected[2:5], prompts[2:5])
    assert len(sent) >= len(PAYLOADS) * len(control + metrics)
    for address, payload, took in sent:
        if address in control:  # ours close at once (metrics is HTTP: it may answer 400 first)
            assert took < 2.5, (address, payload[:20], took)
    for address in control:  # a wrong secret, from a real backend
        with create_backend(cfg.transfer_backend, BackendConfig(provider=cfg.transfer_provider,
                                                                secret=b"x" * 32)) as intruder:
            with pytest.raises(TransferError, match="shared secret|refused our proof"):
                intruder.connect(address, 5)

    # A peer holding the secret: orders naming pages or tokens out of bounds are refused.
    with create_backend(cfg.transfer_backend, BackendConfig(provider=cfg.transfer_provider, secret=secret)) as be:
        peer = be.connect(control[0], 5)
        hello, _buffers = _hello_for(stack, be, pages=4)
        other_version = json.loads(wire.encode(hello)) | {"v": wire.WIRE_VERSION + 98}
        peer.send(json.dumps(other_version).encode())  # another build: refused, with both versions named
        answer = _answer(be)
        assert isinstance(answer, wire.Refuse) and f"wire version {wire.WIRE_VERSION + 98}" in answer.reason, answer
        peer.send(wire.encode(hello))
        assert isinstance(_answer(be), wire.Welcome)
        bad = [wire.PrefillOrder(rid="oob-page", tag=1, token_ids=tuple(range(1, 20)), dst_pages=(1, 1 << 40),
                                 start_page=0),
               wire.PrefillOrder(rid="oob-token", tag=2, token_ids=(1, 1 << 20), dst_pages=(1,), start_page=0),
               wire.PrefillOrder(rid="bad-count", tag=3, token_ids=(1, 2, 3), dst_pages=(1, 2), start_page=0)]
        for order in bad:
            peer.send(wire.encode(order))
            answer = _answer(be)
            assert isinstance(answer, wire.OrderFailed) and answer.tag == order.tag, answer
        peer.send(b"not a wire message")  # logged and dropped; the connection stays
        peer.send(wire.encode(bad[0]))
        assert isinstance(_answer(be), wire.OrderFailed)

    got = run_sequential(stack.url, prompts[2:5])
    assert_same(got, expected[2:5], prompts[2:5])
    deadline = time.monotonic() + 5
    while (held := [held_pages(stack, role) for role in ("prefill", "decode")]) != [0, 0]:
        assert time.monotonic() < deadline, f"pages held by no request (prefill, decode): {held}"
        time.sleep(0.2)
    assert not stack.dead()


FLOOD_SOURCES = [f"127.0.0.{i}" for i in range(2, 52)] + ["127.0.0.1"]  # 50 others, and the decoder's own


def _link(stack) -> dict:
    (link,) = (stack.messenger_stats("decode") or {}).get("links", {}).values()
    return link


# The default stack first (the module's other tests use it), then libfabric tcp: the same control
# plane in front of another data plane, whose own connections must not count against the flood.
@pytest.mark.parametrize("spec", [DEFAULT, StackSpec(backend="libfabric", provider="tcp")],
                         ids=["shmem", "libfabric-tcp"])
def test_a_slow_handshake_flood_neither_stops_serving_nor_a_relink(spec, stacks, references):
    """300 connections to the prefill messenger port that never finish a handshake (one byte
    every 1.5 s, reopened the moment the server closes one), from 51 loopback addresses, the
    decoder's own among them: the decoder's control connection dropped during the flood re-links
    within the fault deadline (2 s), requests through the router stay token-exact, and the
    server's log grows by a handful of lines. Before admission control (a 256-slot port, a 2 s
    timeout per read): every request failed with 503 for as long as the flood ran, and the log
    got ~400,000 lines in 30 s (issue "Hostile networks")."""
    prompts, expected = references("tiny-llama")
    stack = stacks.get(spec)
    cfg = stack.cfg
    log = Path(stack.log_dir) / "prefill.log"
    lines_before = len(log.read_bytes().splitlines())
    before = _link(stack)
    assert before["state"] == "ready", before
    with SlowFlood(f"{cfg.host}:{cfg.ports.bootstrap}", FLOOD_SOURCES, n=300, every_s=1.5) as flood:
        assert wait_until(lambda: flood.closed_by_server >= 300, 20.0), \
            f"the flood never filled the port: {flood.opened} opened, {flood.closed_by_server} closed by the server"
        start = time.monotonic()
        dropped = drop_connections(cfg.ports.bootstrap)  # the decoder's among them, as a network fault would
        assert wait_until(lambda: (link := _link(stack))["losses"] > before["losses"] and link["state"] == "ready",
                          10.0), f"the decoder did not re-link during the flood: {_link(stack)}"
        seen = time.monotonic() - start
        after = _link(stack)
        got = run_sequential(stack.url, prompts[:4])
        served_during = flood.opened
        evicted = value(scrape(stack, "prefill"), "sglang_disagg_control_connections_dropped", why="evicted")
    assert_same(got, expected[:4], prompts[:4])
    print(f"\nflood | {flood.opened} attacker connections from {len(FLOOD_SOURCES)} addresses, "
          f"{flood.closed_by_server} closed by the server, {evicted:g} evicted (metric) | ss -K closed {dropped} | "
          f"decoder re-linked after {after['outage_s']:.3f} s (seen by the test after {seen:.3f} s)", flush=True)
    assert after["losses"] == before["losses"] + 1, after  # one loss: ours, not a string of failed re-links
    assert after["outage_s"] < 2.0, f"re-link took {after['outage_s']:.3f} s under the flood (deadline 2 s)"
    assert served_during > 300 and evicted > 0 and all(flood.by_source.values())
    added = log.read_bytes().splitlines()[lines_before:]
    flood_lines = [x for x in added if b"control server" in x or b"control connection" in x]
    print(f"flood | prefill log: {len(added)} lines added, {len(flood_lines)} about the flood", flush=True)
    assert len(flood_lines) <= 12, b"\n".join(flood_lines[:20]).decode(errors="replace")
    assert len(added) <= 200, f"{len(added)} log lines during the flood"
    deadline = time.monotonic() + 5
    while (held := [held_pages(stack, role) for role in ("prefill", "decode")]) != [0, 0]:
        assert time.monotonic() < deadline, f"pages held by no request (prefill, decode): {held}"
        time.sleep(0.2)
    assert not stack.dead()
