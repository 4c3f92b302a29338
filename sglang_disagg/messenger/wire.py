"""Versioned messages between a decoder's messenger and a prefill server's messenger.

Each message is a frozen dataclass sent as one JSON object with named fields plus
``"type"`` and ``"v"``; never positional frames. ``decode()`` checks the version, the type,
the exact set of fields and every field's type before a message object exists, and raises
``WireError`` naming what is wrong. They travel as control messages of the transfer
backend's per-peer channel (``Peer.send`` / ``TransferBackend.recv``).

Flow (decoder D, prefill server P)::

    D -> P  Hello        first contact: KV spec, TP ranks, region descriptors (and, from a
                         DP decoder, which group's pool: one Hello per group and connection)
    P -> D  Welcome      compatible: P's KV spec and ranks      | Refuse(reason)
    D -> P  PrefillOrder compute token_ids, write pages into dst_pages with immediate `tag`
    P -> D  OrderFailed  P could not serve it: fail it now; `blame` says whether the order
                         itself was refused or P failed a valid one (its link is suspect)
    D -> P  Cancel       D gave up on the order (client abort, deadline)
    P -> D  Released     P will post no more writes for `tag` and none is in flight

There is deliberately no "done" message: D counts the writes carrying `tag`.
"""

from __future__ import annotations

import enum
import functools
import json
import typing
from dataclasses import dataclass, fields
from typing import Any, ClassVar

WIRE_VERSION = 6  # 2: OrderFailed.blame; 3: KVSpec.draft/draft_layers, PrefillOrder.last_token;
# 4: KVSpec.draft_hidden_size; 5: KVSpec.kv_lora_rank/rope_dim/replicated (MLA); 6: Hello.group (DP)
MAX_TOKENS = 1 << 20


class WireError(ValueError):
    """A message that is not valid JSON, has an unknown type or version, or a bad field."""


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What a server's KV pool is; first contact compares everything but `tp`."""

    model: str            # served model name, for messages
    fingerprint: str      # digest of the model's config and weight file names/sizes
    num_layers: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    page_size: int
    dtype: str
    layout: str
    tp: int
    # Speculative decoding: which draft ("ALGORITHM:fingerprint", "" for none) and how many
    # layers its KV pool adds (pages share the target's slots; region order: target layers,
    # then the draft's). Its heads, head dim and dtype are the target's (a server whose draft
    # pool differs refuses to start), so the fields above cover them; the hidden size is
    # named apart so that a refusal says which part of two drafts differs.
    draft: str = ""
    draft_layers: int = 0
    draft_hidden_size: int = 0
    # MLA (DeepSeek): the latent's compressed and rope parts (head_dim is their sum, kv_heads
    # 1, v_head_dim 0) and whether every TP rank holds the whole KV (then each destination
    # rank reads a request's pages from one source rank drawn per request). Named apart so a
    # refusal says which part of two latent geometries differs.
    kv_lora_rank: int = 0
    rope_dim: int = 0
    replicated: bool = False


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    """One TP rank's transfer backend: where to connect, and (decoders) its KV regions,
    one descriptor per (layer, kind) in the order layer * kinds + kind (kinds: 2 for K and V,
1 for an MLA latent)."""

    rank: int
    address: str
    instance: str
    regions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Message:
    TYPE: ClassVar[str] = ""


@dataclass(frozen=True, slots=True)
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    decoder: str
    backend: str
    provider: str
    kv: KVSpec
    ranks: tuple[RankEndpoint, ...]
    # The decoder's DP group whose pool `ranks` describe (0 without DP): each group of a DP
    # decoder says Hello on a connection of its own, and its orders name pages of its pool.
    group: int = 0


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    TYPE: ClassVar[str] = "welcome"
    prefill: str
    kv: KVSpec
    ranks: tuple[RankEndpoint, ...]


@dataclass(frozen=True, slots=True)
class Refuse(Message):
    TYPE: ClassVar[str] = "refuse"
    prefill: str
    reason: str


@dataclass(frozen=True, slots=True)
class PrefillOrder(Message):
    """Compute `token_ids` (the prompt without its last token) and write pages
    [start_page, len(dst_pages)) of them into the decoder's pages `dst_pages`.
    `last_token` is the prompt's last token: a speculative draft's KV at the last of
    `token_ids` is computed from the token after it (SGLang's draft-extend convention)."""

    TYPE: ClassVar[str] = "prefill"
    rid: str
    tag: int
    token_ids: tuple[int, ...]
    dst_pages: tuple[int, ...]
    start_page: int
    last_token: int = 0


class Blame(enum.Enum):
    """Whose failure an OrderFailed is: the decoder counts SERVER failures against the link."""

    ORDER = "order"    # refused as given (bad ids, too long for the server): only this request fails
    SERVER = "server"  # a valid order the server failed to serve (writes, compute)


@dataclass(frozen=True, slots=True)
class OrderFailed(Message):
    TYPE: ClassVar[str] = "failed"
    rid: str
    tag: int
    reason: str
    blame: Blame


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    TYPE: ClassVar[str] = "cancel"
    rid: str
    tag: int


@dataclass(frozen=True, slots=True)
class Released(Message):
    TYPE: ClassVar[str] = "released"
    rid: str
    tag: int


MESSAGES: dict[str, type[Message]] = {cls.TYPE: cls for cls in (Hello, Welcome, Refuse, PrefillOrder, OrderFailed,
                                                                 Cancel, Released)}


def encode(msg: Message) -> bytes:
    body = {"type": msg.TYPE, "v": WIRE_VERSION}
    body.update(_to_json(msg))
    return json.dumps(body, separators=(",", ":")).encode()


def decode(raw: bytes | str) -> Message:
    try:
        obj = json.loads(raw)
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise WireError(f"message is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("message must be a JSON object")
    if obj.get("v") != WIRE_VERSION:
        raise WireError(f"wire version {obj.get('v')!r}, this build speaks {WIRE_VERSION}")
    cls = MESSAGES.get(obj.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise WireError(f"unknown message type {obj.get('type')!r}; known: {', '.join(MESSAGES)}")
    return _from_json(cls, {k: v for k, v in obj.items() if k not in ("type", "v")}, cls.TYPE)


def _to_json(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: _to_json(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple):
        return [_to_json(x) for x in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def _from_json(cls: type, obj: Any, where: str) -> Any:
    if not isinstance(obj, dict):
        raise WireError(f"{where}: expected an object")
    names = [f.name for f in fields(cls)]
    if set(obj) != set(names):
        missing, extra = sorted(set(names) - set(obj)), sorted(set(obj) - set(names))
        raise WireError(f"{where}: fields differ (missing {missing}, unexpected {extra})")
    hints = _hints(cls)
    return cls(**{n: _value(hints[n], obj[n], f"{where}.{n}") for n in names})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _value(hint: Any, v: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(v, list):
            raise WireError(f"{where}: expected a list")
        if len(v) > MAX_TOKENS:
            raise WireError(f"{where}: {len(v)} items exceed {MAX_TOKENS}")
        if item is int and all(type(x) is int and 0 <= x < 2**63 for x in v):
            return tuple(v)  # the common case (token ids, page ids) without a call per item
        return tuple(_value(item, x, f"{where}[{i}]") for i, x in enumerate(v))
    if hint is int:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
            raise WireError(f"{where}: expected a non-negative integer, got {v!r}")
        return v
    if hint is bool:
        if not isinstance(v, bool):
            raise WireError(f"{where}: expected true or false, got {v!r}")
        return v
    if hint is str:
        if not isinstance(v, str):
            raise WireError(f"{where}: expected a string, got {type(v).__name__}")
        return v
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(v)
        except ValueError:
            raise WireError(f"{where}: {v!r} is not one of {[m.value for m in hint]}") from None
    if hasattr(hint, "__dataclass_fields__"):
        return _from_json(hint, v, where)
    raise TypeError(f"{where}: unsupported field type {hint!r}")  # a bug in this module
