"""JSON from a peer (sglang_disagg.untrusted): size, nesting and container count bounded before
json parses it, and every bad input refused as MalformedJSON, never RecursionError."""

from __future__ import annotations

import json
import time

import pytest

from sglang_disagg import untrusted
from sglang_disagg.backends.errors import DescriptorError
from sglang_disagg.backends.regions import RegionDescriptor

DEEP = 10_000


@pytest.mark.parametrize("raw", [
    b"[" * DEEP + b"]" * DEEP,
    b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    b'{"a":[' * (DEEP // 2) + b"]}" * (DEEP // 2),   # alternating kinds count as one depth
    b"[" * DEEP,                                      # unterminated
    b'["x", ' + b"[" * DEEP + b"]" * DEEP + b"]",      # after a string
    ("[" * DEEP + "]" * DEEP),                        # str, as wire.decode also takes
])
def test_deep_nesting_is_refused_before_json_recurses(raw):
    t = time.monotonic()
    with pytest.raises(untrusted.MalformedJSON):
        untrusted.loads(raw, 1 << 20)
    assert time.monotonic() - t < 1.0


def test_json_alone_raises_recursion_error_which_is_no_value_error():
    # what the bound stands in front of: a reader catching the parser's ValueError dies on this
    with pytest.raises(RecursionError):
        json.loads("[" * 100_000 + "]" * 100_000)
    assert not issubclass(RecursionError, ValueError)


def test_the_depth_bound_is_exact():
    assert untrusted.loads("[" * untrusted.MAX_DEPTH + "]" * untrusted.MAX_DEPTH, 1000) is not None
    with pytest.raises(untrusted.MalformedJSON, match="deeper than 32"):
        untrusted.loads("[" * 33 + "]" * 33, 1000)
    # depth 32 twice, side by side, with many brackets: still within
    doc = "[" + ",".join(["[" * 31 + "]" * 31] * 50) + "]"
    assert len(untrusted.loads(doc, 1 << 20)) == 50
    # 40 levels reached by alternating objects and arrays: refused (a pass removes one level only)
    doc = '{"a":[' * 20 + "]}" * 20
    with pytest.raises(untrusted.MalformedJSON, match="deeper"):
        untrusted.loads(doc, 1000)


@pytest.mark.parametrize("doc", [
    '{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}',       # brackets inside strings
    '{"a": "\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}',    # after an escaped quote
    '{"a": "\\\\", "b": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}',   # after an escaped backslash
    '["\\u005b\\u005b", {"k": [1, 2, {"x": null}]}]',
])
def test_strings_and_escapes_do_not_count(doc):
    assert untrusted.loads(doc, 1000) == json.loads(doc)


def test_an_escaped_backslash_before_a_quote_ends_the_string():
    doc = '["\\\\"' + ",[" * 40 + "]" * 40 + "]"  # the string is one backslash; 40 levels follow
    with pytest.raises(untrusted.MalformedJSON, match="deeper"):
        untrusted.loads(doc, 1000)


def test_size_containers_encoding_and_type_are_bounded():
    with pytest.raises(untrusted.MalformedJSON, match="1001 bytes exceed 1000"):
        untrusted.loads(b" " * 1001, 1000)
    t = time.monotonic()
    with pytest.raises(untrusted.MalformedJSON, match="arrays and objects exceed"):
        untrusted.loads(b"[" + b"[]," * 5_000_000 + b"[]]", 16 << 20)  # ~5 Mi lists if parsed
    assert time.monotonic() - t < 2.0
    for bad, why in [(b"\xff\xfe[]", "not UTF-8"), (b"[1,", "not valid JSON"), (b"", "not valid JSON"),
                     ("1" * 5000, "not valid JSON"), (12, "expected bytes")]:
        with pytest.raises(untrusted.MalformedJSON, match=why):
            untrusted.loads(bad, 1 << 20)
    assert untrusted.loads(memoryview(b'{"a": [1]}'), 100) == {"a": [1]}


def test_a_region_descriptor_nested_too_deep_is_a_descriptor_error():
    with pytest.raises(DescriptorError, match="unreadable region descriptor: brackets nest deeper"):
        RegionDescriptor.from_bytes(b"[" * DEEP + b"]" * DEEP)
    with pytest.raises(DescriptorError, match="unreadable region descriptor: expected bytes"):
        RegionDescriptor.from_bytes(12)  # type: ignore[arg-type]
