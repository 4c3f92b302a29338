"""Live migration of an MLA request (tiny-deepseek-v3, float32), over Mooncake: decoder A's latent
KV pages move into decoder B's through the planner's replicated-latent path (one latent row per page and
layer), and the request cut after 5 output tokens ends exactly as on one colocated server;
the bytes A wrote are the request's latent KV, the floor. Setup as test_migration.py (its own
module so the dense stacks are gone before these start: one stack pair at a time on 2 cores)."""

from __future__ import annotations

import pytest

from sglang_disagg.launch.client import generate_ids
from sglang_disagg.messenger.planner import pages_for

from .conftest import OUTPUT_TOKENS
from .deepseek_pd import LAYERS, MODEL
from .test_migration import decoder_pair, _decoder, _free, _migrations, _served, _traced

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mla_decoders(tmp_path_factory, deepseek_reference, stacks):
    stacks.close()  # the pool's reference stack would compete for the 2 cores
    with decoder_pair(tmp_path_factory.mktemp("migration-mla"), MODEL, "mooncake") as pair:
        yield pair


def test_an_mla_request_cut_after_5_tokens_ends_as_on_one_colocated_server(mla_decoders, deepseek_reference):
    a, b = mla_decoders
    prompts, outputs = deepseek_reference.prompts, deepseek_reference.outputs
    k = len(prompts) - 3  # the long prompt: several pages of latent
    served = _served(a)
    got = generate_ids(_decoder(a).url, prompts[k], OUTPUT_TOKENS, rid="migrate-after-5-mla")
    assert got == outputs[k], f"migrated MLA request {got} != colocated {outputs[k]}"
    assert _served(a) == served + 1, "B recomputed nothing: its KV came from A"
    assert _migrations(a, "handed_over") == 1
    stats = _traced(a, 1)
    trace = stats["migrations"][-1]
    assert trace["outputs_at_cut"] == 5 and trace["kv_tokens"] == len(prompts[k]) + 4, trace
    assert trace["bytes"] == pages_for(trace["kv_tokens"], stats["page_size"]) * stats["kv_page_bytes"], trace
    assert trace["writes"] == pages_for(trace["kv_tokens"], stats["page_size"]) * LAYERS, \
        "one latent write per page and layer (no separate V, one rank each side)"
    _free(a, b)
