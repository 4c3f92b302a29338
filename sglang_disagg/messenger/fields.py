"""Strict, versioned decoding of messages with named fields: the one codec of wire.py (between
servers) and dp/wire.py (between a DP group and its server's owner).

A message is a frozen dataclass with a ``TYPE``; on the wire it is one JSON object with its
named fields plus ``"type"`` and ``"v"``, never a positional frame. ``Codec.decode`` checks
the version, the type, the exact set of fields and every field's type and bound before a
message object exists, and raises the codec's error naming what is wrong; the bytes are
untrusted until then (untrusted.py bounds size and nesting before json parses them).

Field types: int (non-negative, within the field's bound), bool, float (finite), str,
an Enum (by value), a nested dataclass, ``tuple[X, ...]``, ``dict[str, int]``, ``X | None``,
and at most one ``bytes`` field: the message's payload, which travels beside the JSON
header rather than inside it (``encode_parts`` / ``decode_parts``), so a control message a
DP owner hands to a group crosses once, not as a JSON string inside a JSON object.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import reprlib
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from .. import untrusted

MAX_INT = (1 << 63) - 1   # any integer without a bound of its own
MAX_TEXT = 64 << 10       # characters of a string without a bound of its own
MAX_ITEMS = 1 << 20       # items of a list or map without a bound of its own


class Codec:
    """Encodes and decodes one family of messages (`messages`: TYPE -> class) of `version`.

    `most`: "Class.field" -> the field's largest value (ints), most items (lists, maps) or
    characters (strings); `item_most`: "Class.field" of a list -> the bound of each item."""

    def __init__(self, name: str, version: int, messages: Mapping[str, type], error: type[ValueError],
                 max_bytes: int, most: Mapping[str, int] | None = None,
                 item_most: Mapping[str, int] | None = None) -> None:
        self.name, self.version, self.messages, self.error = name, version, dict(messages), error
        self.max_bytes = max_bytes
        self.most, self.item_most = dict(most or {}), dict(item_most or {})

    # ----- encoding ---------------------------------------------------------------------------
    def encode(self, msg: Any) -> bytes:
        header, payload = self.encode_parts(msg)
        if payload:
            raise TypeError(f"{msg.TYPE} has a payload: use encode_parts")  # a bug of the caller
        return header

    def encode_parts(self, msg: Any) -> tuple[bytes, bytes]:
        """The JSON header and the payload (b"" for a message without a bytes field)."""
        body: dict[str, Any] = {"type": msg.TYPE, "v": self.version}
        blob = _payload_field(type(msg))  # the field decode_parts fills from the payload: the same rule both ways
        payload = b""
        for f in fields(msg):
            value = getattr(msg, f.name)
            if f.name == blob:
                payload = bytes(value)
            else:
                body[f.name] = _to_json(value)
        return json.dumps(body, separators=(",", ":")).encode(), payload

    # ----- decoding ---------------------------------------------------------------------------
    def decode(self, raw: bytes | str) -> Any:
        return self.decode_parts(raw, None)

    def decode_parts(self, raw: bytes | str, payload: bytes | None) -> Any:
        """The message in header `raw` (and `payload`, for a message with a bytes field):
        anything wrong with either raises the codec's error, whatever the bytes."""
        try:
            obj = untrusted.loads(raw, self.max_bytes)
        except untrusted.MalformedJSON as e:
            raise self.error(f"unreadable message: {e}") from None
        if not isinstance(obj, dict):
            raise self.error("message must be a JSON object")
        if obj.get("v") != self.version:
            raise self.error(f"{self.name} version {reprlib.repr(obj.get('v'))}, this build speaks {self.version}")
        kind = obj.get("type")
        cls = self.messages.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise self.error(f"unknown message type {reprlib.repr(kind)}; known: {', '.join(self.messages)}")
        body = {k: v for k, v in obj.items() if k not in ("type", "v")}
        blob = _payload_field(cls)
        if blob is not None:
            if payload is None:
                raise self.error(f"{cls.TYPE}: its payload is missing")
            body[blob] = payload
        elif payload:
            raise self.error(f"{cls.TYPE}: carries no payload, {len(payload)} bytes came")
        try:
            return self.check(cls, body, cls.TYPE)
        except self.error:
            raise
        except Exception as e:  # noqa: BLE001 - a check this module lacks: still the sender's bad message
            raise self.error(f"{cls.TYPE}: cannot be read ({type(e).__name__}: {e})") from e

    def check(self, cls: type, obj: Any, where: str) -> Any:
        """An instance of dataclass `cls` from JSON object `obj`, every field checked."""
        if not isinstance(obj, dict):
            raise self.error(f"{where}: expected an object")
        names = [f.name for f in fields(cls)]
        if set(obj) != set(names):
            missing, extra = sorted(set(names) - set(obj)), sorted(set(obj) - set(names))
            raise self.error(f"{where}: fields differ (missing {missing}, unexpected {reprlib.repr(extra)})")
        hints = _hints(cls)
        return cls(**{n: self.value(hints[n], obj[n], f"{where}.{n}", f"{cls.__name__}.{n}") for n in names})

    def value(self, hint: Any, v: Any, where: str, field: str = "", item: bool = False) -> Any:
        """`v` as `hint`, within the bound of `field` ("Class.field"; `item`: of one of its items)."""
        err = self.error
        most = (self.item_most if item else self.most).get(field)
        origin = typing.get_origin(hint)
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            if v is None and len(args) < len(typing.get_args(hint)):
                return None
            return self.value(args[0], v, where, field, item)
        if origin is tuple:
            item_hint = typing.get_args(hint)[0]
            limit = MAX_ITEMS if most is None else most
            if not isinstance(v, list):
                raise err(f"{where}: expected a list")
            if len(v) > limit:
                raise err(f"{where}: {len(v)} items exceed {limit}")
            top = self.item_most.get(field, MAX_INT)
            if item_hint is int and all(type(x) is int and 0 <= x <= top for x in v):
                return tuple(v)  # the common case (token ids, page ids) without a call per item
            return tuple(self.value(item_hint, x, f"{where}[{i}]", field, True) for i, x in enumerate(v))
        if origin is dict:
            limit = MAX_ITEMS if most is None else most
            if not isinstance(v, dict):
                raise err(f"{where}: expected an object")
            if len(v) > limit:
                raise err(f"{where}: {len(v)} items exceed {limit}")
            key_hint, value_hint = typing.get_args(hint)
            return {self.value(key_hint, k, f"{where} key", field, True): self.value(value_hint, x, f"{where}[{k!r:.40}]",
                                                                                   field, True)
                    for k, x in v.items()}
        if hint is int:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
                raise err(f"{where}: expected a non-negative integer, got {reprlib.repr(v)}")
            if most is not None and v > most:
                raise err(f"{where}: {v} exceeds {most}")
            return v
        if hint is bool:
            if not isinstance(v, bool):
                raise err(f"{where}: expected true or false, got {reprlib.repr(v)}")
            return v
        if hint is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise err(f"{where}: expected a finite number, got {reprlib.repr(v)}")
            return float(v)
        if hint is str:
            if not isinstance(v, str):
                raise err(f"{where}: expected a string, got {type(v).__name__}")
            if len(v) > (MAX_TEXT if most is None else most):
                raise err(f"{where}: {len(v)} characters exceed {MAX_TEXT if most is None else most}")
            return v
        if hint is bytes:
            if not isinstance(v, bytes):
                raise err(f"{where}: expected bytes, got {type(v).__name__}")
            return v
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            if not isinstance(v, str) or v not in {m.value for m in hint}:
                raise err(f"{where}: {reprlib.repr(v)} is not one of {[m.value for m in hint]}")
            return hint(v)
        if hasattr(hint, "__dataclass_fields__"):
            return self.check(hint, v, where)
        raise TypeError(f"{where}: unsupported field type {hint!r}")  # a bug in the message's class


def _to_json(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: _to_json(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [_to_json(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_json(v) for k, v in obj.items()}
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _payload_field(cls: type) -> str | None:
    """The name of `cls`'s bytes field (its payload), if it has one."""
    found = [name for name, hint in _hints(cls).items() if hint is bytes]
    if len(found) > 1:
        raise TypeError(f"{cls.__name__}: at most one bytes field")  # a bug in the message's class
    return found[0] if found else None
