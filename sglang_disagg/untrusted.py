"""JSON from a peer, parsed with its size and nesting bounded before `json` sees it.

Python's `json` recurses once per level of nesting: about 1,000 nested ``[`` raise
RecursionError (a deeper input can exhaust the C stack on some builds), which is no
ValueError, so a reader that catches only the parser's errors dies on it. Every message our
peers send (wire.py, dp/wire.py, region descriptors) nests a few levels; `loads` refuses
more than MAX_DEPTH levels, or more bytes than the caller allows, before parsing, and raises
MalformedJSON for every way the input can be bad, so its callers turn one error type into
their own.

The shape is measured without a per-character Python loop (an order for 2**20 tokens is
~8 MB of JSON): escapes and then strings are cut out with C-speed byte operations and one
regex, leaving only the brackets; past MAX_CONTAINERS of them the document is refused, and
otherwise the innermost pairs are removed, one level per pass, at most MAX_DEPTH times:
anything left then nests deeper, or does not balance.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 32  # our messages nest at most ~6 levels (Hello.ranks[i].regions[j]); json's limit is ~1,000
# Arrays and objects in one document: a Hello of 1,024 ranks has ~2,050, an order 3. Also bounds
# what parsing allocates (16 MB of "[]," would be 5 Mi lists, ~300 MB) and the depth check's work.
MAX_CONTAINERS = 1 << 16

_STRING = re.compile(rb'"[^"]*"')
_KEEP = b'"[]{}'
_DROP = bytes(b for b in range(256) if b not in _KEEP)
_ONE_KIND = bytes.maketrans(b"{}", b"[]")  # depth is depth whatever the bracket (json refuses a mismatch)


class MalformedJSON(ValueError):
    """Bytes that are not one bounded JSON document: too long, too deep, not UTF-8, not JSON."""


def loads(raw: bytes | bytearray | memoryview | str, max_bytes: int, max_depth: int = MAX_DEPTH,
          max_containers: int = MAX_CONTAINERS) -> Any:
    """The JSON document in `raw` (UTF-8), refused with MalformedJSON when it is longer than
    `max_bytes`, nests deeper than `max_depth`, holds more than `max_containers` arrays and
    objects, or is not valid JSON."""
    if isinstance(raw, str):
        text, data = raw, raw.encode("utf-8", "surrogatepass")
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        data = bytes(raw)
        text = None
    else:
        raise MalformedJSON(f"expected bytes, got {type(raw).__name__}")
    if len(data) > max_bytes:
        raise MalformedJSON(f"{len(data)} bytes exceed {max_bytes}")
    if text is None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise MalformedJSON(f"not UTF-8: {e}") from None
    check_shape(data, max_depth, max_containers)
    try:
        return json.loads(text)
    except (ValueError, RecursionError, MemoryError) as e:  # the last two: no parser error escapes as another type
        raise MalformedJSON(f"not valid JSON: {e}") from None


def check_shape(data: bytes, max_depth: int = MAX_DEPTH, max_containers: int = MAX_CONTAINERS) -> None:
    """Raise MalformedJSON if the brackets of `data` (UTF-8 JSON) outside its strings open more
    than `max_containers` arrays and objects, nest deeper than `max_depth` or do not balance;
    nothing else of JSON is checked (a mismatched kind, ``[}``, is json's to refuse)."""
    # \\ then \" out first (left to right, as JSON reads them): an escaped quote ends no string
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    shape = _STRING.sub(b"", plain.translate(None, _DROP)).translate(_ONE_KIND)
    cut = shape.find(b'"')  # an unterminated string: what follows is inside it (and invalid)
    if cut >= 0:
        shape = shape[:cut]
    opened = shape.count(b"[")
    if opened > max_containers:
        raise MalformedJSON(f"{opened} arrays and objects exceed {max_containers}")
    if opened <= max_depth:
        return  # too few brackets to nest deeper (the common case: one object and a few lists)
    for _ in range(max_depth):  # each pass removes the innermost level: depth d is gone after d
        shorter = shape.replace(b"[]", b"")  # one level: removing never makes a pair it then sees
        if len(shorter) == len(shape):
            break  # nothing matched: what is left does not balance
        shape = shorter
        if not shape:
            return
    if shape:
        raise MalformedJSON(f"brackets nest deeper than {max_depth} levels or do not balance")
