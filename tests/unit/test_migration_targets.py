"""Decoder A's answers to the decoders it migrates to, when the asking decoder is already gone:
a Hello, Cancel or order whose answer cannot be sent (B closed the connection between asking and
the answer, e.g. it dropped a link whose heartbeat it lost under load) costs that link, never A's
scheduler (the exception once left the decoder's step and stopped the server)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_disagg.backends.errors import PeerLostError
from sglang_disagg.messenger import wire
from sglang_disagg.messenger.migration.targets import Targets


def _kv(model: str) -> wire.KVSpec:
    return wire.KVSpec(model=model, fingerprint="f", num_layers=1, kv_heads=1, head_dim=64, v_head_dim=64,
                       page_size=16, dtype="f", layout="hnd", tp=1)


class GonePeer:
    id, address = 7, "127.0.0.1:9"

    def __init__(self) -> None:
        self.sent = 0

    def send(self, data: bytes) -> None:
        self.sent += 1
        raise PeerLostError("control channel send failed: [Errno 9] Bad file descriptor")


def _targets() -> Targets:
    node = SimpleNamespace(spec=_kv("ours"), name="a", wakeup=SimpleNamespace(set=lambda: None))
    out = SimpleNamespace(m=SimpleNamespace(cfg=SimpleNamespace()), node=node, source=SimpleNamespace(held={}),
                          hook=None)
    return Targets(out)


@pytest.mark.parametrize("msg", [
    wire.Hello(decoder="b", backend="shmem", provider="", kv=_kv("another"), ranks=()),  # refused: Refuse lost
    wire.MigrationOrder(rid="r", tag=1, num_tokens=1, dst_pages=(0,)),  # no Hello: its OrderFailed is lost
], ids=["hello", "order"])
def test_an_answer_to_a_decoder_that_went_away_costs_its_link_not_the_scheduler(msg, caplog):
    caplog.set_level(logging.INFO, logger="sglang_disagg.migration")
    targets, peer = _targets(), GonePeer()
    targets.on(peer, msg)  # raised PeerLostError out of the scheduler's step before
    assert peer.sent == 1, "the answer was tried"
    assert peer.id not in targets.peers
    assert f"decoder {peer.address} went away before its {type(msg).__name__} was answered" in caplog.text
