"""The batch notifications NIXL and Mooncake carry for us are signed with the deployment's secret:
their transports deliver a notification from anyone who reaches the port, under whatever name the
sender gives itself. So authentication comes first: anything that is not a well-formed one of ours
with the secret's MAC is dropped and counted, never credited (it could complete a request whose KV
has not landed), and never fails any peer (it could drop a live prefill server, again and again).

The pure tests check parse_notif and the drop counter; the backend tests send forgeries through the
libraries' own APIs (NIXL send_notif, Mooncake's TransferNotify), from a third process naming
itself as the receiver's live peer, then check that peer is still connected and that a real
transfer from it still lands byte-exact and completes its expectation.
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
from sglang_disagg.backends.messages import (MAX_NOTIF_BYTES, MAX_NOTIFY, ForgedNotification, NotifDrops,
                                             RejectedNotification, notif_text, parse_notif)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from transfer_harness import Proc, until  # noqa: E402
from transfer_worker import pattern  # noqa: E402

KEY = b"k" * 32
OTHER = b"x" * 32


def test_a_signed_notification_round_trips():
    assert parse_notif(notif_text(7, 3, KEY), KEY) == (7, 3)
    assert parse_notif(notif_text(7, 3, KEY).encode(), KEY) == (7, 3)
    assert parse_notif(notif_text(2**32 - 1, MAX_NOTIFY, KEY), KEY) == (2**32 - 1, MAX_NOTIFY)


def test_we_never_send_what_we_would_refuse():
    for tag, count in [(-1, 1), (2**32, 1), (0, 0), (0, MAX_NOTIFY + 1)]:
        with pytest.raises(TransferError):
            notif_text(tag, count, KEY)


def forgeries(tag: int, count: int) -> dict[str, list[bytes]]:
    """Messages a sender without the secret can make, by the reason they are dropped for."""
    return {
        "forged": [f"sgd2 {tag} {count} {'0' * 32}".encode(),                   # a guessed MAC
                   notif_text(tag, count, OTHER).encode(),                       # another deployment's secret
                   notif_text(tag, count, None).encode(),                        # no secret at all
                   notif_text(tag, 1, KEY).encode().replace(b" 1 ", f" {count} ".encode())],  # count changed
        "malformed": [b"sgd2 x 1 -", b"sgd2 1 2", b"sgd2 1 2 - extra", b"sgd2 -1 2 -", b"sgd2  7 1 -",
                      b"sgd2 07 1 -", b"sgd2 7 +1 -", b"sgd2 7 1 -\n", b"sgd2 4294967296 1 -", b"sgd2 7 0 -",
                      f"sgd2 7 {MAX_NOTIFY + 1} -".encode(), b"sgd2 7 1 " + b"A" * 32,
                      b"sgd2 \xff 1 -", "sgd2 \u0667 1 -".encode(),          # not ASCII (an Arabic-Indic 7)
                      b"sgd2 " + b"9" * 300, b"x" * 5000],                   # over-long, ours or not
        "foreign": [b"hello", b"sgd1 7 1", b"SGD2 7 1 -"],
    }


def _all_forgeries() -> list:
    return [pytest.param(m, reason, id=f"{reason}-{i}")
            for reason, ms in forgeries(7, 3).items() for i, m in enumerate(ms)]


@pytest.mark.parametrize("msg,reason", _all_forgeries())
@pytest.mark.parametrize("as_text", [False, True], ids=["bytes", "str"])
def test_a_forgery_is_rejected_for_its_reason(msg: bytes, reason: str, as_text: bool):
    m = msg.decode("utf-8", errors="replace") if as_text else msg
    if reason == "foreign":
        assert parse_notif(m, KEY) is None
        return
    with pytest.raises(RejectedNotification) as e:
        parse_notif(m, KEY)
    assert e.value.reason == reason
    assert isinstance(e.value, ForgedNotification) == (reason == "forged")


def test_without_a_secret_both_ends_accept_unsigned_ones_only():
    assert parse_notif(notif_text(1, 2, None), None) == (1, 2)
    with pytest.raises(ForgedNotification):
        parse_notif(notif_text(1, 2, KEY), None)


def test_length_is_bounded_before_anything_else():
    assert parse_notif("z" * MAX_NOTIF_BYTES, KEY) is None  # at the bound: read (and not ours)
    for big in ("z" * (MAX_NOTIF_BYTES + 1), b"sgd2 " + b"1" * MAX_NOTIF_BYTES, "\xff" * (10 << 20)):
        with pytest.raises(RejectedNotification, match="characters"):
            parse_notif(big, KEY)


@pytest.mark.parametrize("msg", [None, 7, ["sgd2 1 2 -"], bytearray(b"sgd2 1 2 -")])
def test_what_is_not_text_is_malformed(msg):
    with pytest.raises(RejectedNotification):
        parse_notif(msg, None)


def test_nothing_but_a_rejection_escapes_whatever_arrives():
    rng = random.Random(3)
    alphabet = b"sgd2 0123456789abcdef-\xff\x00\n"
    for _ in range(3000):
        raw = (b"sgd2 " if rng.random() < 0.7 else b"") + bytes(rng.choice(alphabet) for _ in range(rng.randrange(80)))
        for m in (raw, raw.decode("latin-1")):
            try:
                got = parse_notif(m, KEY)
            except RejectedNotification:
                continue
            assert got is None or got == parse_notif(notif_text(*got, KEY), KEY)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_drops_are_counted_by_reason_and_logged_at_most_once_per_period(caplog):
    clock = Clock()
    drops = NotifDrops("nixl", every_s=5.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="sglang_disagg.backends.messages"):
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
                             "foreign_notifications_dropped": 1}
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
        by_reason = forgeries(tag, PAGES)
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
