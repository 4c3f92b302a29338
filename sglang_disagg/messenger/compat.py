"""First-contact compatibility: what must match between a decoder and a prefill server."""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from pathlib import Path

from ..backends.errors import DescriptorError
from ..backends.regions import RegionDescriptor
from .planner import KVGeometry
from .wire import Hello, KVSpec

# Fields that may differ: TP is what the planner reconciles; the name is informational
# (the fingerprint decides whether two servers run the same model).
_MAY_DIFFER = {"tp", "model"}


def differences(decoder: KVSpec, prefill: KVSpec) -> list[str]:
    """Human-readable mismatches, empty when the pair can work together."""
    out = []
    for f in fields(KVSpec):
        if f.name in _MAY_DIFFER:
            continue
        a, b = getattr(decoder, f.name), getattr(prefill, f.name)
        if a != b:
            if f.name == "fingerprint":
                out.append(f"model differs (decoder: {decoder.model} [{a}], prefill: {prefill.model} [{b}])")
            elif f.name == "draft":
                out.append(f"speculative draft differs (decoder: {a or 'none'}, prefill: {b or 'none'})")
            else:
                out.append(f"{f.name} differs (decoder: {a}, prefill: {b})")
    return out


def fingerprint(model_path: str) -> str:
    """Digest of the model's config and its weight files' names and sizes: cheap to
    compute on every start, and different whenever two directories hold different models
    (hashing the weights themselves would cost minutes on real models)."""
    root = Path(model_path)
    h = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for p in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        h.update(f"{p.name}:{p.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def decoder_pages(geometry: KVGeometry, hello: Hello) -> int:
    """How many KV pages the decoder's regions hold (the bound every order's page ids are
    checked against), after checking the Hello's ranks and regions are complete and well
    formed; raises ValueError naming what is wrong."""
    tp = hello.kv.tp
    if tp < 1 or [r.rank for r in hello.ranks] != list(range(tp)):
        raise ValueError(f"the decoder's ranks {[r.rank for r in hello.ranks][:16]} are not 0..{tp - 1}")
    kinds = geometry.kinds
    pages = None
    for endpoint in hello.ranks:
        if len(endpoint.regions) != geometry.num_layers * len(kinds):
            raise ValueError(f"decoder rank {endpoint.rank} sent {len(endpoint.regions)} KV regions, "
                             f"expected {geometry.num_layers * len(kinds)} (layers x kinds)")
        heads = len(geometry.heads(tp, endpoint.rank))
        for i, raw in enumerate(endpoint.regions):
            try:
                length = RegionDescriptor.from_bytes(raw).length
            except DescriptorError as e:
                raise ValueError(f"decoder rank {endpoint.rank} region {i}: {e}") from None
            n = length // geometry.page_bytes(kinds[i % len(kinds)], heads)
            pages = n if pages is None else min(pages, n)
    if not pages:
        raise ValueError("the decoder's KV regions hold no page")
    return pages
