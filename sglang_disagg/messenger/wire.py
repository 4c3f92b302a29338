"""Versioned messages between a decoder's messenger and a prefill server's messenger.

Each message is a frozen dataclass sent as one JSON object with named fields plus
``"type"`` and ``"v"``; never positional frames. ``decode()`` checks the version, the type,
the exact set of fields and every field's type before a message object exists, and raises
``WireError`` naming what is wrong (the codec is fields.py, shared with dp/wire.py). They travel as control messages of the transfer
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

Live migration (messenger/migration/): a decoder B takes a running request over from a
decoder A, which then plays P's part with the pages it already holds (Hello/Welcome alike):

    B -> A  MigrationOrder  write the `num_tokens` tokens of A's held request `rid` into
                            B's pages `dst_pages` with immediate `tag` (nothing is computed)

There is deliberately no "done" message: D counts the writes carrying `tag`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from .fields import Codec

WIRE_VERSION = 8  # 2: OrderFailed.blame; 3: KVSpec.draft/draft_layers, PrefillOrder.last_token;
# 4: KVSpec.draft_hidden_size; 5: KVSpec.kv_lora_rank/rope_dim/replicated (MLA); 6: Hello.group (DP);
# 7: OrderFailed.posted, Released.posted; 8: MigrationOrder

# Bounds on what a peer's message may claim. A server builds lists, plans and loops from these
# counts (compat.py: list(range(tp)); the planner: one entry per rank, layer and page), so each
# is far above any real deployment yet low enough that what is built from it stays cheap; a
# message past one is malformed, refused naming the field. The message's size bounds the rest.
MAX_MESSAGE_BYTES = 16 << 20  # backends.control.MAX_FRAME: no control message is longer
MAX_TP = 1024                 # TP ranks of one server (largest real: 64)
MAX_DP_GROUPS = 1024          # DP groups of one server
MAX_LAYERS = 4096             # layers of a KV pool, target or draft (largest real: ~130)
MAX_KV_HEADS = 1 << 16
MAX_HEAD_DIM = 1 << 16        # head_dim, v_head_dim, kv_lora_rank, rope_dim (largest real: 576)
MAX_HIDDEN = 1 << 20          # a draft's hidden size (largest real: ~16 Ki)
MAX_PAGE_SIZE = 1 << 16       # tokens per KV page (SGLang: 1 to 256)
MAX_REGIONS = 4 * MAX_LAYERS  # KV regions of one rank: (target + draft layers) x 2 kinds
MAX_TOKENS = 1 << 20          # tokens of one order
MAX_PAGES = MAX_TOKENS        # pages of one order: a page holds at least one token
MAX_TOKEN_ID = (1 << 31) - 1  # SGLang holds token ids as int32 (the intake checks the model's vocabulary)
MAX_TEXT = 64 << 10           # characters of a name, address or reason (descriptors: the message's bound)
MAX_INT = (1 << 63) - 1       # any other integer (ids, tags: each is checked where it is used)

# "Class.field" -> its largest value (integers), most items (lists) or characters (strings).
_MOST: dict[str, int] = {
    "KVSpec.num_layers": MAX_LAYERS, "KVSpec.draft_layers": MAX_LAYERS, "KVSpec.kv_heads": MAX_KV_HEADS,
    "KVSpec.head_dim": MAX_HEAD_DIM, "KVSpec.v_head_dim": MAX_HEAD_DIM, "KVSpec.kv_lora_rank": MAX_HEAD_DIM,
    "KVSpec.rope_dim": MAX_HEAD_DIM, "KVSpec.draft_hidden_size": MAX_HIDDEN, "KVSpec.page_size": MAX_PAGE_SIZE,
    "KVSpec.tp": MAX_TP,
    "RankEndpoint.rank": MAX_TP - 1, "RankEndpoint.regions": MAX_REGIONS,
    "Hello.ranks": MAX_TP, "Hello.group": MAX_DP_GROUPS - 1, "Welcome.ranks": MAX_TP,
    "PrefillOrder.token_ids": MAX_TOKENS, "PrefillOrder.dst_pages": MAX_PAGES, "PrefillOrder.start_page": MAX_PAGES,
    "PrefillOrder.last_token": MAX_TOKEN_ID,
    "MigrationOrder.num_tokens": MAX_TOKENS, "MigrationOrder.dst_pages": MAX_PAGES,
}
# "Class.field" of a list -> the bound of each of its items.
_ITEM_MOST: dict[str, int] = {"PrefillOrder.token_ids": MAX_TOKEN_ID, "RankEndpoint.regions": MAX_MESSAGE_BYTES}


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


@dataclass(frozen=True, slots=True)
class MigrationOrder(Message):
    """Write the KV of the `num_tokens` tokens that decoder A holds for its request `rid`
    (prompt and outputs but the last sampled token, which runs as B's first step) into
    B's pages `dst_pages`, every layer, with immediate `tag`. A checks `num_tokens` and
    the page count against what it holds: B never names A's pages."""

    TYPE: ClassVar[str] = "migrate"
    rid: str
    tag: int
    num_tokens: int
    dst_pages: tuple[int, ...]


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
    posted: int | None  # writes the prefill posted with `tag`, every one (None: it no longer knows)


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    TYPE: ClassVar[str] = "cancel"
    rid: str
    tag: int


@dataclass(frozen=True, slots=True)
class Released(Message):
    """Nothing of the order is in the prefill's hands any more. `posted` writes carried its tag
    (None: the prefill forgot the order): a write already on its way may still land, so the
    decoder frees the pages once that many arrived (decode_endings.py)."""
    TYPE: ClassVar[str] = "released"
    rid: str
    tag: int
    posted: int | None


MESSAGES: dict[str, type[Message]] = {cls.TYPE: cls for cls in (Hello, Welcome, Refuse, PrefillOrder, OrderFailed,
                                                                 Cancel, Released, MigrationOrder)}


_CODEC = Codec("wire", WIRE_VERSION, MESSAGES, WireError, MAX_MESSAGE_BYTES, _MOST, _ITEM_MOST)


def encode(msg: Message) -> bytes:
    return _CODEC.encode(msg)


def decode(raw: bytes | str) -> Message:
    """The message in `raw`, from a peer: anything wrong with it raises WireError, whatever
    the bytes (fields.py: untrusted.py bounds size and nesting before json parses them)."""
    return _CODEC.decode(raw)
