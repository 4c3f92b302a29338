"""The migration source in a request's bootstrap fields (migration/room.py): a decoder believes
only a source whose room carries the deployment secret's MAC over host, port, handle and
the grammar replay count (in the request id), so a
client holding the API key cannot point a decoder's messenger anywhere; fields that name no
source (SGLang fills a room on its own) are no migration."""

from __future__ import annotations

import secrets

import pytest

from sglang_disagg.messenger.migration.room import MAC_BITS, Source, SourceError

SECRET = secrets.token_bytes(32)


def test_a_source_survives_the_trip_through_the_bootstrap_fields():
    s = Source.new("127.0.0.1:43715")
    f = s.fields(SECRET, "r")
    assert Source.of(f["bootstrap_host"], f["bootstrap_port"], f["bootstrap_room"], SECRET, f["rid"]) == s
    assert s.address == "127.0.0.1:43715" and 0 <= s.handle < 1 << 31


def test_no_host_is_no_migration_whatever_sglang_put_in_the_room():
    assert Source.of(None, None, None, SECRET) is None
    assert Source.of(None, 8998, 123456789, SECRET) is None


@pytest.mark.parametrize("change", ["host", "port", "handle", "secret", "mac"])
def test_a_forged_or_altered_source_is_refused(change):
    s = Source.new("10.0.0.2:5000")
    host, port, room, secret = s.host, s.port, s.room(SECRET), SECRET
    if change == "host":
        host = "10.0.0.3"
    elif change == "port":
        port = 5001
    elif change == "handle":
        room ^= 1 << MAC_BITS
    elif change == "secret":
        secret = secrets.token_bytes(32)
    else:
        room ^= 1
    with pytest.raises(SourceError, match="not authenticated"):
        Source.of(host, port, room, secret)


@pytest.mark.parametrize("host,port,room,why", [
    ("", 1, 0, "host"), (5, 1, 0, "host"), ("h" * 256, 1, 0, "host"),
    ("h", 0, 0, "port"), ("h", 65536, 0, "port"), ("h", True, 0, "port"), ("h", "80", 0, "port"),
    ("h", 1, -1, "room"), ("h", 1, 1 << 63, "room"), ("h", 1, 1.5, "room"), ("h", 1, None, "room"),
])
def test_malformed_fields_are_refused_with_the_reason(host, port, room, why):
    with pytest.raises(SourceError, match=why):
        Source.of(host, port, room, SECRET)


def test_a_grammars_replay_count_travels_in_the_request_id_under_the_mac():
    s = Source.new("10.0.0.2:5000", replay=7)
    f = s.fields(SECRET, "req-1")
    assert f["rid"] == f"req-1.m{s.handle}g7"
    assert Source.of(f["bootstrap_host"], f["bootstrap_port"], f["bootstrap_room"], SECRET, f["rid"]) == s
    for rid in (f"req-1.m{s.handle}g8", f"req-1.m{s.handle}", "req-1"):  # altered or dropped: refused
        with pytest.raises(SourceError, match="not authenticated"):
            Source.of(f["bootstrap_host"], f["bootstrap_port"], f["bootstrap_room"], SECRET, rid)
    plain = Source.new("10.0.0.2:5000")
    assert plain.fields(SECRET, "r")["rid"] == f"r.m{plain.handle}"
