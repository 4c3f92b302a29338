"""Pure transfer planning: which bytes of which page go from which prefill rank to which
decode rank, and how many writes each decode rank must count.

No torch, no addresses, no sockets: offsets are bytes inside one (layer, K|V) buffer of
one rank, and ``binding.py`` turns them into registered regions. Both sides run the same
plan, so a decoder knows how many writes to expect without being told.

Sharding follows SGLang's tensor parallelism: with ``tp <= kv_heads`` each rank holds
``kv_heads / tp`` consecutive heads; with ``tp > kv_heads`` each head is replicated on
``tp / kv_heads`` consecutive ranks (a replica set). A decode rank's head range is cut
into pieces, each taken from one prefill rank that holds it; among replicas the piece is
taken from the replica ``dst_rank % replicas``, which spreads sources over all ranks and
pairs ranks one to one when both sides shard alike.

MLA (``replicated=True``): every rank holds the whole latent KV, so every prefill rank is a
replica of every page; each destination rank takes its copy from one source replica drawn
at random per request (seeded by the request, so all prefill ranks draw alike), which
spreads the load over all sources. A latent cache has no separate V (``v_head_dim=0``).

Layout: with HND ([page, head, slot, dim]) a piece of a page is one contiguous range, so
it moves with ONE write. With NHD ([slot, head, dim] rows) it is one range per slot unless
whole pages line up (same heads on both sides); NHD is planned only to count what the
token-slot layout costs.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass


class Layout(str, enum.Enum):
    HND = "hnd"
    NHD = "nhd"


class Kind(enum.IntEnum):
    K = 0
    V = 1


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What both sides must agree on about the KV pool (checked at first contact)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    page_size: int
    dtype_bytes: int
    layout: Layout = Layout.HND
    replicated: bool = False  # MLA: every rank holds all of it

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "v_head_dim", "page_size", "dtype_bytes"):
            value = getattr(self, name)
            least = 0 if name == "v_head_dim" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"KVGeometry.{name} must be an int >= {least}, got {value!r}")
        if not isinstance(self.layout, Layout):
            raise ValueError(f"KVGeometry.layout must be a Layout, got {self.layout!r}")

    @property
    def kinds(self) -> tuple[Kind, ...]:
        return (Kind.K, Kind.V) if self.v_head_dim else (Kind.K,)

    def heads(self, tp: int, rank: int) -> range:
        return range(self.kv_heads) if self.replicated else rank_heads(self.kv_heads, tp, rank)

    def dim(self, kind: Kind) -> int:
        return self.head_dim if kind is Kind.K else self.v_head_dim

    def page_bytes(self, kind: Kind, heads: int) -> int:
        """Bytes of one page of one layer's K or V on a rank holding `heads` heads."""
        return self.page_size * heads * self.dim(kind) * self.dtype_bytes


def rank_heads(kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank `rank` of a TP group holds (SGLang's QKVParallelLinear rule)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside a TP group of {tp}")
    if tp <= kv_heads:
        if kv_heads % tp:
            raise ValueError(f"{kv_heads} KV heads cannot be split over TP {tp}")
        per = kv_heads // tp
        return range(rank * per, rank * per + per)
    if tp % kv_heads:
        raise ValueError(f"TP {tp} is not a multiple of {kv_heads} KV heads (replication needs it)")
    head = rank // (tp // kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True, slots=True)
class Piece:
    """Heads [first_head, first_head + num_heads) go from `src_rank` to `dst_rank`."""

    src_rank: int
    dst_rank: int
    first_head: int
    num_heads: int


def shard_pieces(kv_heads: int, src_tp: int, dst_tp: int, replicated: bool = False,
                 rng: random.Random | None = None) -> tuple[Piece, ...]:
    """Every destination head is covered by exactly one piece. Among the source ranks that
    hold a head, the replica is `dst % holders` (pairs ranks one to one when both sides
    shard alike) or, with `rng`, a random one."""
    full = range(kv_heads)
    src_ranges = [full if replicated else rank_heads(kv_heads, src_tp, r) for r in range(src_tp)]
    pieces = []
    for dst in range(dst_tp):
        want = full if replicated else rank_heads(kv_heads, dst_tp, dst)
        head = want.start
        while head < want.stop:
            holders = [r for r, held in enumerate(src_ranges) if head in held]
            src = rng.choice(holders) if rng is not None else holders[dst % len(holders)]
            end = min(want.stop, src_ranges[src].stop)
            pieces.append(Piece(src, dst, head, end - head))
            head = end
    return tuple(pieces)


@dataclass(frozen=True, slots=True)
class WriteGroup:
    """One paged write call: write i copies `length` bytes from
    src_pages[i] * src_stride + src_offset to dst_pages[i] * dst_stride + dst_offset,
    inside the (layer, kind) buffer of src_rank and of dst_rank."""

    src_rank: int
    dst_rank: int
    layer: int
    kind: Kind
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    src_stride: int
    dst_stride: int
    src_offset: int
    dst_offset: int
    length: int

    @property
    def writes(self) -> int:
        return len(self.src_pages)

    @property
    def nbytes(self) -> int:
        return len(self.src_pages) * self.length


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """The address-free plan for one (prefill, decode) pair of TP groups."""

    geometry: KVGeometry
    src_tp: int
    dst_tp: int
    pieces: tuple[Piece, ...]

    @classmethod
    def build(cls, geometry: KVGeometry, src_tp: int, dst_tp: int) -> ShardPlan:
        if src_tp < 1 or dst_tp < 1:
            raise ValueError(f"TP sizes must be >= 1, got prefill {src_tp}, decode {dst_tp}")
        return cls(geometry, src_tp, dst_tp, shard_pieces(geometry.kv_heads, src_tp, dst_tp, geometry.replicated))

    def for_request(self, seed: int) -> ShardPlan:
        """Replica sets (MLA): this request's random source per destination; every prefill
        rank derives the same draw from the same seed. Unreplicated plans are returned as is."""
        if not self.geometry.replicated:
            return self
        g = self.geometry
        return ShardPlan(g, self.src_tp, self.dst_tp,
                         shard_pieces(g.kv_heads, self.src_tp, self.dst_tp, True, random.Random(seed)))

    def heads(self, tp: int, rank: int) -> range:
        return self.geometry.heads(tp, rank)

    def _slices(self, piece: Piece, kind: Kind) -> list[tuple[int, int, int]]:
        """(src_offset, dst_offset, length) of a piece inside one page."""
        g = self.geometry
        src_heads, dst_heads = self.heads(self.src_tp, piece.src_rank), self.heads(self.dst_tp, piece.dst_rank)
        head_bytes = g.dim(kind) * g.dtype_bytes
        src_skip, dst_skip = piece.first_head - src_heads.start, piece.first_head - dst_heads.start
        if g.layout is Layout.HND:
            slot_block = g.page_size * head_bytes  # one head's slots are contiguous
            return [(src_skip * slot_block, dst_skip * slot_block, piece.num_heads * slot_block)]
        src_row, dst_row = len(src_heads) * head_bytes, len(dst_heads) * head_bytes
        if src_row == dst_row == piece.num_heads * head_bytes:  # whole rows: the page is one range
            return [(0, 0, g.page_size * src_row)]
        return [(s * src_row + src_skip * head_bytes, s * dst_row + dst_skip * head_bytes,
                 piece.num_heads * head_bytes) for s in range(g.page_size)]

    def groups(self, src_pages: Sequence[int], dst_pages: Sequence[int],
               layers: Sequence[int] | None = None, src_rank: int | None = None) -> list[WriteGroup]:
        """The writes that move pages src_pages[i] -> dst_pages[i] for `layers` (all by
        default), for one source rank or all of them."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
        g = self.geometry
        layers = range(g.num_layers) if layers is None else layers
        if not src_pages:
            return []
        src, dst = tuple(src_pages), tuple(dst_pages)
        out = []
        for piece in self.pieces:
            if src_rank is not None and piece.src_rank != src_rank:
                continue
            for kind in g.kinds:
                src_stride = g.page_bytes(kind, len(self.heads(self.src_tp, piece.src_rank)))
                dst_stride = g.page_bytes(kind, len(self.heads(self.dst_tp, piece.dst_rank)))
                for layer in layers:
                    for s_off, d_off, length in self._slices(piece, kind):
                        out.append(WriteGroup(piece.src_rank, piece.dst_rank, layer, kind, src, dst,
                                              src_stride, dst_stride, s_off, d_off, length))
        return out

    def writes_per_page(self, dst_rank: int) -> int:
        """Writes landing on `dst_rank` for one page of every layer, K and V."""
        per_piece = {Kind.K: 0, Kind.V: 0}
        for piece in self.pieces:
            if piece.dst_rank == dst_rank:
                for kind in self.geometry.kinds:
                    per_piece[kind] += len(self._slices(piece, kind))
        return self.geometry.num_layers * sum(per_piece.values())

    def expected(self, num_pages: int) -> dict[int, int]:
        """Writes each decode rank counts for a request of `num_pages` pages."""
        return {d: num_pages * self.writes_per_page(d) for d in range(self.dst_tp)}

    def total_writes(self, num_pages: int) -> int:
        return sum(self.expected(num_pages).values())

    def total_bytes(self, num_pages: int) -> int:
        """Bytes the writes of a request of `num_pages` pages move (every layer, K and V)."""
        per_page = sum(length for piece in self.pieces for kind in self.geometry.kinds
                       for _, _, length in self._slices(piece, kind))
        return num_pages * self.geometry.num_layers * per_page


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
