"""The batch notifications NIXL and Mooncake carry for us are sealed by the sender's live control
connection: their transports deliver a notification from anyone who reaches the port, under whatever
name the sender gives itself. So authentication comes first: anything that is not a well-formed one
of ours, naming a live peer, with that connection's MAC and a sequence number not seen before, is
dropped and counted, never credited (it could complete a request whose KV has not landed), and never
fails any peer (it could drop a live prefill server, again and again).

The pure tests check parse_notif, the MAC and the replay window; the backend tests send forgeries
through the libraries' own APIs (NIXL send_notif, Mooncake's TransferNotify), from a third process
naming itself as the receiver's live peer, replay a real notification captured in one run to the
same receiver and to a restarted one expecting that very tag, then check that the peer is still
connected and that a real transfer still lands byte-exact and completes its expectation.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import random
import sys
from pathlib import Path

import pytest

from sglang_disagg.backends.errors import TransferError
from sglang_disagg.backends.messages import MAX_NOTIFY
from sglang_disagg.backends.notifications import (MAX_NOTIF_BYTES, ForgedNotification, NotifDrops,
                                                  RejectedNotification, ReplayWindow, notif_text, parse_notif)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from transfer_harness import Proc, until  # noqa: E402
from transfer_worker import pattern  # noqa: E402

KEY = b"k" * 32
OTHER = b"x" * 32
SENDER = "5e" * 16


def _sealed(tag: int = 7, count: int = 3, seq: int = 0, key: bytes = KEY, sender: str = SENDER) -> str:
    return notif_text(sender, seq, tag, count, key)


def test_a_sealed_notification_round_trips():
    for msg in (_sealed(), _sealed().encode()):
        n = parse_notif(msg)
        assert (n.sender, n.seq, n.tag, n.count) == (SENDER, 0, 7, 3)
        n.verify(KEY)
    n = parse_notif(_sealed(2**32 - 1, MAX_NOTIFY, seq=2**63 - 1))
    assert (n.tag, n.count, n.seq) == (2**32 - 1, MAX_NOTIFY, 2**63 - 1)
    n.verify(KEY)


def test_we_never_send_what_we_would_refuse():
    for tag, count, seq in [(-1, 1, 0), (2**32, 1, 0), (0, 0, 0), (0, MAX_NOTIFY + 1, 0), (0, 1, -1), (0, 1, 2**63)]:
        with pytest.raises(TransferError):
            notif_text(SENDER, seq, tag, count, KEY)


def forgeries(tag: int, count: int, sender: str) -> dict[str, list[bytes]]:
    """Messages a sender without the link's key can make, by the reason a receiver whose live peer
    is `sender` drops them for."""
    return {
        "forged": [f"sgd3 {sender} 0 {tag} {count} {'0' * 32}".encode(),        # a guessed MAC
                   _sealed(tag, count, key=OTHER, sender=sender).encode(),       # another key (run, deployment)
                   _sealed(tag, count, key=b"", sender=sender).encode(),         # no key at all
                   _sealed(tag, 1, sender=sender).encode().replace(f" {tag} 1 ".encode(),
                                                                  f" {tag} {count} ".encode())],  # count changed
        "unbound": [_sealed(tag, count, sender="0" * 32).encode(),              # a sender with no live link
                    _sealed(tag, count, sender=sender.replace(sender[0], "f" if sender[0] != "f" else "e")).encode()],
        "malformed": [b"sgd3 x 1 -", b"sgd3 " + SENDER.encode() + b" 0 1 2", b"sgd3  7 1 -",
                      f"sgd3 {SENDER} 0 07 1 {'0' * 32}".encode(), f"sgd3 {SENDER} 0 7 +1 {'0' * 32}".encode(),
                      f"sgd3 {SENDER} 0 7 1 {'0' * 32}\n".encode(), f"sgd3 {SENDER} 0 4294967296 1 {'0' * 32}".encode(),
                      f"sgd3 {SENDER} 0 7 0 {'0' * 32}".encode(), f"sgd3 {SENDER} 0 7 {MAX_NOTIFY + 1} {'0' * 32}".encode(),
                      f"sgd3 {SENDER} 0 7 1 {'A' * 32}".encode(), f"sgd3 {SENDER.upper()} 0 7 1 {'0' * 32}".encode(),
                      f"sgd3 {SENDER} 9223372036854775808 7 1 {'0' * 32}".encode(),
                      b"sgd3 \xff 1 -", "sgd3 \u0667 1 -".encode(),          # not ASCII (an Arabic-Indic 7)
                      b"sgd3 " + b"9" * 300, b"x" * 5000],                   # over-long, ours or not
        "foreign": [b"hello", b"sgd2 7 1 -", b"SGD3 7 1 -"],
    }


def _pure_forgeries() -> list:
    return [pytest.param(m, reason, id=f"{reason}-{i}")
            for reason, ms in forgeries(7, 3, SENDER).items() for i, m in enumerate(ms) if reason != "unbound"]


@pytest.mark.parametrize("msg,reason", _pure_forgeries())
@pytest.mark.parametrize("as_text", [False, True], ids=["bytes", "str"])
def test_a_forgery_is_rejected_for_its_reason(msg: bytes, reason: str, as_text: bool):
    m = msg.decode("utf-8", errors="replace") if as_text else msg
    if reason == "foreign":
        assert parse_notif(m) is None
        return
    with pytest.raises(RejectedNotification) as e:
        parse_notif(m).verify(KEY)
    assert e.value.reason == reason
    assert isinstance(e.value, ForgedNotification) == (reason == "forged")


def test_the_mac_covers_every_field():
    n = parse_notif(_sealed(7, 3, seq=5))
    for field, value in (("sender", "0" * 32), ("seq", 6), ("tag", 8), ("count", 4)):
        text = _sealed(7, 3, seq=5).replace(f" {getattr(n, field)} ", f" {value} ", 1) if field != "sender" \
            else _sealed(7, 3, seq=5).replace(SENDER, value)
        with pytest.raises(ForgedNotification):
            parse_notif(text).verify(KEY)


def test_the_replay_window_takes_each_number_once_in_any_order():
    w = ReplayWindow(width=8)
    assert [w.take(s) for s in (0, 2, 1, 2, 0, 5)] == [True, True, True, False, False, True]
    assert w.take(12) and not w.take(4)          # 12 - 4 = 8: left the window (a replay of old)
    assert w.take(5 + 8) and w.take(11) and not w.take(11)
    assert w.take(1000) and not w.take(13) and w.take(999)   # a jump past the window forgets all
    assert not any(w.take(s) for s in (999, 1000, 992))


def test_length_is_bounded_before_anything_else():
    assert parse_notif("z" * MAX_NOTIF_BYTES) is None  # at the bound: read (and not ours)
    for big in ("z" * (MAX_NOTIF_BYTES + 1), b"sgd3 " + b"1" * MAX_NOTIF_BYTES, "\xff" * (10 << 20)):
        with pytest.raises(RejectedNotification, match="characters"):
            parse_notif(big)


@pytest.mark.parametrize("msg", [None, 7, ["sgd3 1 2 -"], bytearray(b"sgd3 1 2 -")])
def test_what_is_not_text_is_malformed(msg):
    with pytest.raises(RejectedNotification):
        parse_notif(msg)


def test_nothing_but_a_rejection_escapes_whatever_arrives():
    rng = random.Random(3)
    alphabet = b"sgd3 0123456789abcdef-\xff\x00\n"
    for _ in range(3000):
        raw = (b"sgd3 " + (SENDER.encode() + b" " if rng.random() < 0.5 else b"") if rng.random() < 0.7 else b"") \
            + bytes(rng.choice(alphabet) for _ in range(rng.randrange(80)))
        for m in (raw, raw.decode("latin-1")):
            try:
                got = parse_notif(m)
                if got is not None:
                    got.verify(KEY)
            except RejectedNotification:
                continue
            assert got is None


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_drops_are_counted_by_reason_and_logged_at_most_once_per_period(caplog):
    clock = Clock()
    drops = NotifDrops("nixl", every_s=5.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="sglang_disagg.backends.notifications"):
        for _ in range(1000):
            drops.drop("malformed", "bad")
        drops.drop("forged", "no MAC")
        assert len(caplog.records) == 1
        clock.t += 4.9
        drops.drop("foreign", "not ours")
        assert len(caplog.records) == 1
        clock.t += 0.2
        drops.drop("forged", "no MAC")
    assert drops.stats() == {"forged_notifications_dropped": 2, "malformed_notifications_dropped": 1000,
                             "foreign_notifications_dropped": 1, "unbound_notifications_dropped": 0,
                             "replayed_notifications_dropped": 0}
    assert len(caplog.records) == 2
    assert "1001 more dropped since the last such line" in caplog.records[1].getMessage()


# ----- real backends: a forger naming itself as the receiver's live peer ------------------------

SECRET = bytes(range(32))
PAGE, PAGES, SIZE = 4096, 32, 1 << 20  # the real writes land in the first half, the forger's (Mooncake) past it


def _digests(data: bytes, ranges: list) -> list[str]:
    return [hashlib.sha256(data[o:o + n]).hexdigest() for o, n in ranges]


@pytest.mark.backend
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_forged_notifications_fail_no_peer_and_a_real_transfer_still_lands(backend: str):
    procs: list[Proc] = []

    def start(**init) -> Proc:
        procs.append(Proc(backend, None, worker="notif_worker.py", **init))
        return procs[-1]

    try:
        tx, rx = start(secret=SECRET.hex()), start(secret=SECRET.hex())
        tx_peer = tx.call("connect", address=rx.address)["peer"]
        rx_peer = rx.call("accept")["peer"]
        src = tx.call("alloc", size=SIZE, seed=9)["region"]
        got = rx.call("alloc", size=SIZE)
        dst, desc = got["region"], got["desc"]
        remote = tx.call("add_remote", peer=tx_peer, desc=desc)["remote"]

        tag = 4242
        fut = rx.call("expect", tag=tag, count=PAGES, timeout=30.0, peer=rx_peer, wait=False)["future"]
        # The forger calls itself what the receiver knows its live peer as: NIXL's agent name,
        # Mooncake's session (before, a malformed notification dropped the peer of that name).
        tx_end = tx.call("endpoint")
        name = tx_end["agent"] if backend == "nixl" else tx_end["session"]
        forger = start(forger=True)
        by_reason = forgeries(tag, PAGES, tx.call("instance")["instance"])
        msgs = [m for ms in by_reason.values() for m in ms]
        sent = forger.call("forge", rpc_timeout=30, target=rx.call("endpoint"), name=name,
                           msgs=[base64.b64encode(m).decode() for m in msgs],
                           dst=json.loads(desc)["base"] + SIZE // 2)
        assert sent["sent"] == len(msgs) and not any(sent.get("rcs", [])), sent

        expected = {f"{reason}_notifications_dropped": len(ms) for reason, ms in by_reason.items()}

        def dropped() -> dict:
            stats = rx.call("stats")
            return {k: stats.get(k) for k in expected}
        def alive() -> bool:
            return rx.call("peer_state", peer=rx_peer)["state"] == "connected"
        until(lambda: dropped() == expected or not alive(), timeout=15.0)
        assert alive()
        assert tx.call("peer_state", peer=tx_peer)["state"] == "connected"
        assert dropped() == expected
        assert rx.call("stats")["peers"] == 1
        assert rx.call("arrived", tag=tag)["count"] == 0  # nothing credited

        rng = random.Random(1)
        writes = [[s * PAGE, d * PAGE, PAGE] for s, d in zip(rng.sample(range(PAGES), PAGES),
                                                             rng.sample(range(PAGES), PAGES))]
        tx.call("write", rpc_timeout=30, peer=tx_peer, region=src, remote=remote, writes=writes, imm=tag, wait=20.0)
        assert rx.call("failed_at", rpc_timeout=35, future=fut, timeout=30.0)["type"] is None
        got = rx.call("digest", region=dst, ranges=[[d, n] for _, d, n in writes])["sha"]
        assert got == _digests(pattern(9, SIZE), [[s, n] for s, _, n in writes])
        assert alive()
    finally:
        for p in procs:
            p.stop()


@pytest.mark.backend
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_captured_notification_credits_nothing_replayed_or_after_a_restart(backend: str):
    """A real notification captured in one run, sent again for the tag its receiver expects at that
    moment: to the same receiver (its number was seen: "replayed") and to a restarted receiver
    the same sender re-linked with (another connection's key: "forged"). Neither credits a
    write; the real writes that follow complete the expectation byte-exact."""
    procs: list[Proc] = []

    def start(**init) -> Proc:
        procs.append(Proc(backend, None, worker="notif_worker.py", **init))
        return procs[-1]

    def link(rx: Proc) -> tuple[str, str]:
        return tx.call("connect", address=rx.address)["peer"], rx.call("accept")["peer"]

    def run(rx: Proc, tx_peer: str, rx_peer: str, tag: int, seed: int, replay: list[bytes], reason: str) -> None:
        """`rx` expects `tag` of `tx_peer`; the forger replays `replay`; then tx writes."""
        got = rx.call("alloc", size=SIZE)
        dst, desc = got["region"], got["desc"]
        remote = tx.call("add_remote", peer=tx_peer, desc=desc)["remote"]
        fut = rx.call("expect", tag=tag, count=PAGES, timeout=30.0, peer=rx_peer, wait=False)["future"]
        if replay:
            before = rx.call("stats")[f"{reason}_notifications_dropped"]
            name = tx.call("endpoint")["agent" if backend == "nixl" else "session"]
            forger.call("forge", rpc_timeout=30, target=rx.call("endpoint"), name=name,
                        msgs=[base64.b64encode(m).decode() for m in replay], dst=json.loads(desc)["base"] + SIZE // 2)
            until(lambda: rx.call("stats")[f"{reason}_notifications_dropped"] == before + len(replay), timeout=15.0)
            assert rx.call("arrived", tag=tag)["count"] == 0, "a replayed notification was credited"
        src = tx.call("alloc", size=SIZE, seed=seed)["region"]
        writes = [[p * PAGE, p * PAGE, PAGE] for p in range(PAGES)]
        tx.call("write", rpc_timeout=30, peer=tx_peer, region=src, remote=remote, writes=writes, imm=tag, wait=20.0)
        assert rx.call("failed_at", rpc_timeout=35, future=fut, timeout=30.0)["type"] is None
        assert rx.call("digest", region=dst, ranges=[[0, PAGES * PAGE]])["sha"] == \
            _digests(pattern(seed, SIZE), [[0, PAGES * PAGE]])
        assert rx.call("peer_state", peer=rx_peer)["state"] == "connected"

    try:
        tx, rx = start(secret=SECRET.hex()), start(secret=SECRET.hex())
        forger = start(forger=True)
        tag = 4242
        peers = link(rx)
        run(rx, *peers, tag, 1, [], "")
        captured = [t.encode() for t in tx.call("sealed")["texts"]]
        assert captured and all(t.startswith(b"sgd3 ") and f" {tag} ".encode() in t for t in captured)
        run(rx, *peers, tag, 2, captured, "replayed")     # the same link: the tag expected again
        rx.stop()
        procs.remove(rx)
        restarted = start(secret=SECRET.hex())            # the decoder restarted: tags begin again
        run(restarted, *link(restarted), tag, 3, captured, "forged")
    finally:
        for p in procs:
            p.stop()
