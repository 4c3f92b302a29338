"""Versioned wire messages, the messenger's configuration and first-contact compatibility."""

from __future__ import annotations

import json
import pickle

import pytest

from sglang_disagg.messenger import compat, wire
from sglang_disagg.messenger.config import ENV, ConfigError, MessengerConfig, MessengerRole
from sglang_disagg.messenger.faults import Fault
from sglang_disagg.messenger.inputs import DecoderJoined, OrderTicket, Route

KV = wire.KVSpec(model="tiny-llama", fingerprint="abc", num_layers=4, kv_heads=2, head_dim=64, v_head_dim=64,
                 page_size=16, dtype="float32", layout="hnd", tp=1)
HELLO = wire.Hello(decoder="decode", backend="libfabric", provider="tcp", kv=KV,
                   ranks=(wire.RankEndpoint(0, "127.0.0.1:4000", "i0", ('{"d":1}', '{"d":2}')),))
ORDER = wire.PrefillOrder(rid="r1", tag=7, token_ids=(1, 2, 3), dst_pages=(9,), start_page=0)


@pytest.mark.parametrize("msg", [
    HELLO, ORDER,
    wire.Welcome(prefill="prefill", kv=KV, ranks=(wire.RankEndpoint(0, "h:1", "i", ()),)),
    wire.Refuse(prefill="p", reason="model differs"), wire.OrderFailed(rid="r", tag=1, reason="x", blame=wire.Blame.SERVER),
    wire.Cancel(rid="r", tag=1), wire.Released(rid="r", tag=1),
])
def test_every_message_round_trips_with_named_fields(msg):
    raw = wire.encode(msg)
    obj = json.loads(raw)
    assert obj["type"] == msg.TYPE and obj["v"] == wire.WIRE_VERSION
    assert wire.decode(raw) == msg


@pytest.mark.parametrize("raw, error", [
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"type": "cancel", "v": 99, "rid": "r", "tag": 1}', "wire version 99"),
    (b'{"type": "teleport", "v": 6}', "unknown message type"),
    (b'{"type": "cancel", "v": 6, "rid": "r"}', r"missing \['tag'\]"),
    (b'{"type": "cancel", "v": 6, "rid": "r", "tag": 1, "extra": 0}', r"unexpected \['extra'\]"),
    (b'{"type": "cancel", "v": 6, "rid": 5, "tag": 1}', "cancel.rid: expected a string"),
    (b'{"type": "cancel", "v": 6, "rid": "r", "tag": -1}', "non-negative integer"),
    (b'{"type": "cancel", "v": 6, "rid": "r", "tag": true}', "non-negative integer"),
    (b'{"type": "prefill", "v": 6, "rid": "r", "tag": 1, "token_ids": [1, "x"], "dst_pages": [], "start_page": 0, "last_token": 5}',
     r"token_ids\[1\]"),
    (b'{"type": "prefill", "v": 6, "rid": "r", "tag": 1, "token_ids": 3, "dst_pages": [], "start_page": 0, "last_token": 5}',
     "token_ids: expected a list"),
])
def test_malformed_messages_are_refused_with_the_reason(raw, error):
    assert wire.WIRE_VERSION == 6  # the cases above are written for it
    with pytest.raises(wire.WireError, match=error):
        wire.decode(raw)


def test_an_order_failure_says_whose_it_is():
    raw = json.loads(wire.encode(wire.OrderFailed(rid="r", tag=1, reason="x", blame=wire.Blame.ORDER)))
    assert raw["blame"] == "order"
    with pytest.raises(wire.WireError, match=r"failed.blame: 'nobody' is not one of \['order', 'server'\]"):
        wire.decode(json.dumps(raw | {"blame": "nobody"}))


def test_nested_fields_are_checked():
    obj = json.loads(wire.encode(HELLO))
    obj["kv"]["page_size"] = "16"
    with pytest.raises(wire.WireError, match=r"hello.kv.page_size"):
        wire.decode(json.dumps(obj))
    obj = json.loads(wire.encode(HELLO))
    del obj["ranks"][0]["instance"]
    with pytest.raises(wire.WireError, match=r"hello.ranks\[0\]"):
        wire.decode(json.dumps(obj))


def test_scheduler_inputs_survive_the_broadcast_pickle():
    for item in (DecoderJoined("k", HELLO), OrderTicket("k", ORDER), Route(3, 9, "h:1", 2, ("a", "b"))):
        assert pickle.loads(pickle.dumps(item)) == item


def test_compatibility_names_every_difference_but_tp():
    other = wire.KVSpec(**{f: getattr(KV, f) for f in KV.__dataclass_fields__})
    assert compat.differences(KV, other) == []
    tp2 = wire.KVSpec(**{f: getattr(KV, f) for f in KV.__dataclass_fields__} | {"tp": 2, "model": "alias"})
    assert compat.differences(KV, tp2) == []  # TP is what the planner reconciles
    bad = wire.KVSpec(**{f: getattr(KV, f) for f in KV.__dataclass_fields__} | {
        "fingerprint": "zzz", "model": "tiny-qwen3", "page_size": 1, "dtype": "bfloat16"})
    diffs = compat.differences(KV, bad)
    assert len(diffs) == 3
    assert any("model differs" in d and "tiny-qwen3" in d for d in diffs)
    assert any("page_size differs (decoder: 16, prefill: 1)" in d for d in diffs)
    assert any("dtype" in d for d in diffs)


def test_fingerprint_follows_config_and_weights(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"hidden_size": 8, "num_hidden_layers": 2}')
        (d / "model.safetensors").write_bytes(b"x" * 10)
    assert compat.fingerprint(str(a)) == compat.fingerprint(str(b))
    (b / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 8}')  # same content, other order
    assert compat.fingerprint(str(a)) == compat.fingerprint(str(b))
    (b / "model.safetensors").write_bytes(b"x" * 11)
    assert compat.fingerprint(str(a)) != compat.fingerprint(str(b))


def test_config_round_trip_and_validation(monkeypatch):
    cfg = MessengerConfig(role=MessengerRole.DECODE, backend="libfabric", provider="tcp", prefill=("127.0.0.1:5",))
    monkeypatch.setenv(ENV, cfg.to_env())
    assert MessengerConfig.from_env() == cfg
    monkeypatch.delenv(ENV)
    assert MessengerConfig.from_env() is None
    with pytest.raises(ConfigError, match="prefill: a decoder needs"):
        MessengerConfig(role="decode", backend="nixl")
    with pytest.raises(ConfigError, match="port: a prefill server"):
        MessengerConfig(role="prefill", backend="nixl")
    with pytest.raises(ConfigError, match=r"prefill\[0\]: 'nowhere' is not host:port"):
        MessengerConfig(role="decode", backend="nixl", prefill=("nowhere",))
    with pytest.raises(ConfigError, match="role: 'router'"):
        MessengerConfig(role="router", backend="nixl")
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['colour'\]"):
        MessengerConfig.from_json('{"role": "prefill", "backend": "nixl", "port": 1, "colour": "red"}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        MessengerConfig.from_json("{")
    with pytest.raises(ConfigError, match="transfer_timeout_s"):
        MessengerConfig(role="prefill", backend="nixl", port=1, transfer_timeout_s=0)
    with pytest.raises(ConfigError, match="recheck_s"):
        MessengerConfig(role="decode", backend="nixl", prefill=("h:1",), recheck_s=-1)


def test_fault_specs():
    assert Fault.parse(None) is None
    assert Fault.parse("zero_kv").pages == "all"
    f = Fault.parse("zero_kv:pages=last,layers=1,kinds=v")
    assert (f.pages, f.layers, f.kinds) == ("last", "1", "v")
    assert Fault.parse("zero_kv:pages=last:3").pages == "last:3"
    from sglang_disagg.messenger.faults import _pick
    assert _pick("last:3", range(10)) == [7, 8, 9] and _pick("first:2", range(10)) == [0, 1]
    assert _pick("last", range(10)) == [9] and _pick("all", range(3)) == [0, 1, 2] and _pick("1", range(3)) == [1]
    for bad in ("melt_kv", "zero_kv:pages=middle", "zero_kv:kinds=q", "zero_kv:colour=red", "zero_kv:pages=mid:2"):
        with pytest.raises(ValueError):
            Fault.parse(bad)
