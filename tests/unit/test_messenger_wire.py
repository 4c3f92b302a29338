"""Versioned wire messages, the messenger's configuration and first-contact compatibility."""

from __future__ import annotations

import json
import pickle
import random
import time

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
    wire.Refuse(prefill="p", reason="model differs"), wire.OrderFailed(rid="r", tag=1, reason="x", blame=wire.Blame.SERVER, posted=3),
    wire.Cancel(rid="r", tag=1), wire.Released(rid="r", tag=1, posted=None),
])
def test_every_message_round_trips_with_named_fields(msg):
    raw = wire.encode(msg)
    obj = json.loads(raw)
    assert obj["type"] == msg.TYPE and obj["v"] == wire.WIRE_VERSION
    assert wire.decode(raw) == msg


@pytest.mark.parametrize("raw, error", [
    (b"\xff\xfe", "unreadable message: not UTF-8"),
    (b"{", "unreadable message: not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"type": "cancel", "v": 99, "rid": "r", "tag": 1}', "wire version 99"),
    (b'{"type": "teleport", "v": 8}', "unknown message type"),
    (b'{"type": "cancel", "v": 8, "rid": "r"}', r"missing \['tag'\]"),
    (b'{"type": "cancel", "v": 8, "rid": "r", "tag": 1, "extra": 0}', r"unexpected \['extra'\]"),
    (b'{"type": "cancel", "v": 8, "rid": 5, "tag": 1}', "cancel.rid: expected a string"),
    (b'{"type": "cancel", "v": 8, "rid": "r", "tag": -1}', "non-negative integer"),
    (b'{"type": "cancel", "v": 8, "rid": "r", "tag": true}', "non-negative integer"),
    (b'{"type": "prefill", "v": 8, "rid": "r", "tag": 1, "token_ids": [1, "x"], "dst_pages": [], "start_page": 0, "last_token": 5}',
     r"token_ids\[1\]"),
    (b'{"type": "prefill", "v": 8, "rid": "r", "tag": 1, "token_ids": 3, "dst_pages": [], "start_page": 0, "last_token": 5}',
     "token_ids: expected a list"),
])
def test_malformed_messages_are_refused_with_the_reason(raw, error):
    assert wire.WIRE_VERSION == 8  # the cases above are written for it
    with pytest.raises(wire.WireError, match=error):
        wire.decode(raw)


def test_an_order_failure_says_whose_it_is():
    raw = json.loads(wire.encode(wire.OrderFailed(rid="r", tag=1, reason="x", blame=wire.Blame.ORDER, posted=0)))
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


# ----- hostile input: every decode failure is a WireError, counts bounded --------------------
MESSAGES = [HELLO, ORDER, wire.Welcome(prefill="prefill", kv=KV, ranks=(wire.RankEndpoint(0, "h:1", "i", ()),)),
            wire.Refuse(prefill="p", reason="r"), wire.OrderFailed(rid="r", tag=1, reason="x", blame=wire.Blame.ORDER, posted=0),
            wire.Cancel(rid="r", tag=1), wire.Released(rid="r", tag=1, posted=None),
            wire.MigrationOrder(rid="r", tag=1, num_tokens=9, dst_pages=(3, 4, 5))]
DEEP = 10_000


def _paths(obj, path=()):
    """Every value's path in a decoded JSON message (dict keys and list indexes)."""
    yield path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, (*path, k))


def _with(obj, path, value):
    obj = json.loads(json.dumps(obj))
    if not path:
        return value
    at = obj
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return obj


def test_the_message_list_covers_every_type():
    assert {m.TYPE for m in MESSAGES} == set(wire.MESSAGES)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.TYPE)
def test_deep_nesting_in_any_field_of_any_message_is_a_wire_error_and_fast(msg):
    base = json.loads(wire.encode(msg))
    deep = [json.dumps(_with(base, path, "@")).replace('"@"', "[" * DEEP + "]" * DEEP) for path in _paths(base)]
    deep += [json.dumps(_with(base, path, "@")).replace('"@"', '{"a":' * DEEP + "0" + "}" * DEEP)
             for path in _paths(base)]
    t = time.monotonic()
    for raw in deep:
        for form in (raw, raw.encode()):
            with pytest.raises(wire.WireError, match="nest deeper than 32"):
                wire.decode(form)
    assert time.monotonic() - t < 0.02 * len(deep) + 1.0


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.TYPE)
def test_any_value_of_the_wrong_type_anywhere_is_a_wire_error(msg):
    base = json.loads(wire.encode(msg))
    weird = [None, True, -1, 1.5, 2**64, "x" * 3, [], {}, [[1]], {"a": {}}, "order", 10**9]
    for path in _paths(base):
        for v in weird:
            raw = json.dumps(_with(base, path, v))
            try:
                wire.decode(raw)
            except wire.WireError:
                pass  # anything else escapes and fails the test


def test_random_mutations_raise_nothing_but_wire_error():
    rng = random.Random(7)
    for msg in MESSAGES:
        raw = bytearray(wire.encode(msg))
        for _ in range(300):
            b = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(b))
                b[i:i + rng.randint(0, 3)] = bytes(rng.choice(b'[]{}",:0123456789-eE.\\tnul') for _ in range(rng.randint(0, 3)))
            try:
                wire.decode(bytes(b))
            except wire.WireError:
                pass


def _hello_with(**kv):
    obj = json.loads(wire.encode(HELLO))
    obj["kv"].update(kv)
    return json.dumps(obj)


@pytest.mark.parametrize("raw, field", [
    (_hello_with(tp=10**9), r"hello.kv.tp: 1000000000 exceeds 1024"),
    (_hello_with(num_layers=10**6), "hello.kv.num_layers"),
    (_hello_with(draft_layers=wire.MAX_LAYERS + 1), "hello.kv.draft_layers"),
    (_hello_with(kv_heads=1 << 20), "hello.kv.kv_heads"),
    (_hello_with(head_dim=1 << 20), "hello.kv.head_dim"),
    (_hello_with(page_size=1 << 20), "hello.kv.page_size"),
    (_hello_with(draft_hidden_size=1 << 30), "hello.kv.draft_hidden_size"),
    (_hello_with(model="m" * (wire.MAX_TEXT + 1)), "hello.kv.model: 65537 characters"),
    (json.dumps(json.loads(wire.encode(HELLO)) | {"group": 10**6}), "hello.group"),
    (json.dumps(json.loads(wire.encode(HELLO)) | {"ranks": [{"rank": 0, "address": "a", "instance": "i", "regions": []}]
                                                            * (wire.MAX_TP + 1)}), r"hello.ranks: 1025 items exceed 1024"),
    (json.dumps(json.loads(wire.encode(HELLO)) | {"ranks": [{"rank": 5000, "address": "a", "instance": "i",
                                                             "regions": []}]}), r"hello.ranks\[0\].rank"),
    (json.dumps(json.loads(wire.encode(HELLO)) | {"ranks": [{"rank": 0, "address": "a", "instance": "i",
                                                             "regions": ["d"] * (wire.MAX_REGIONS + 1)}]}),
     r"hello.ranks\[0\].regions: 16385 items"),
    (json.dumps(json.loads(wire.encode(wire.Welcome(prefill="p", kv=KV, ranks=()))) | {
        "kv": json.loads(wire.encode(HELLO))["kv"] | {"tp": 10**9}}), "welcome.kv.tp"),
    (json.dumps(json.loads(wire.encode(ORDER)) | {"dst_pages": [0] * (wire.MAX_PAGES + 1)}),
     r"prefill.dst_pages: 1048577 items exceed 1048576"),
    (json.dumps(json.loads(wire.encode(ORDER)) | {"token_ids": [1] * (wire.MAX_TOKENS + 1)}), "prefill.token_ids: "),
    (json.dumps(json.loads(wire.encode(ORDER)) | {"token_ids": [1, 1 << 31]}), r"prefill.token_ids\[1\]: 2147483648"),
    (json.dumps(json.loads(wire.encode(ORDER)) | {"start_page": 10**7}), "prefill.start_page"),
    (json.dumps(json.loads(wire.encode(ORDER)) | {"last_token": 1 << 31}), "prefill.last_token: 2147483648 exceeds"),
    (json.dumps(json.loads(wire.encode(ORDER)) | {"last_token": "5"}), "prefill.last_token: expected a non-negative"),
    (json.dumps(json.loads(wire.encode(ORDER)) | {"last_token": -1}), "prefill.last_token: expected a non-negative"),
    (json.dumps(json.loads(wire.encode(ORDER)) | {"last_token": 5.0}), "prefill.last_token: expected a non-negative"),
    (json.dumps(json.loads(wire.encode(ORDER)) | {"last_token": False}), "prefill.last_token: expected a non-negative"),
])
def test_counts_past_their_bound_are_refused_naming_the_field(raw, field):
    t = time.monotonic()
    with pytest.raises(wire.WireError, match=field):
        wire.decode(raw)
    assert time.monotonic() - t < 2.0


def test_ten_million_pages_are_refused_before_they_are_parsed():
    raw = b'{"type":"prefill","v":7,"rid":"r","tag":1,"token_ids":[1],"start_page":0,"last_token":0,"dst_pages":[' + \
        b"0," * 10**7 + b"0]}"
    t = time.monotonic()
    with pytest.raises(wire.WireError, match=f"exceed {wire.MAX_MESSAGE_BYTES}"):
        wire.decode(raw)
    assert time.monotonic() - t < 1.0


def test_the_bounds_name_real_fields_and_fit_the_control_frame():
    from sglang_disagg.backends import control

    assert wire.MAX_MESSAGE_BYTES == control.MAX_FRAME
    for key in list(wire._MOST) + list(wire._ITEM_MOST):
        cls, _, name = key.partition(".")
        assert name in getattr(wire, cls).__dataclass_fields__, key
    # the largest order the bounds allow fits one message
    big = wire.PrefillOrder(rid="r" * 64, tag=(1 << 32) - 1, token_ids=(wire.MAX_TOKEN_ID,) * wire.MAX_TOKENS,
                            dst_pages=(10**8,) * (wire.MAX_TOKENS // 16), start_page=0, last_token=wire.MAX_TOKEN_ID)
    assert len(wire.encode(big)) < wire.MAX_MESSAGE_BYTES
    assert wire.decode(wire.encode(big)) == big
