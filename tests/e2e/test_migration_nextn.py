"""Live migration of a DeepSeek request with NEXTN (MTP, one draft step, top-k 1), tiny-deepseek-v3
in float32 over shmem: the NEXTN layer's latent KV (a one-layer MLA pool registered after the
target's layers) moves with the target's latent, one write per page and layer of both, and
the request cut after 5 and after 20 outputs ends with exactly the tokens of the unmigrated run;
the client's speculative counters are both decoders' verify steps (the step logs). The EAGLE
case, with B's acceptance checked step by step: test_migration_speculative.py."""

from __future__ import annotations

import pytest

from sglang_disagg.launch.client import greedy, post_json
from sglang_disagg.messenger.planner import pages_for
from sglang_disagg.testsupport import DUMP_ENV

from .deepseek_pd import LAYERS, MODEL, MTP
from .test_migration import _decoder, _free, _served, _traced, decoder_pair
from .test_migration_speculative import _steps

pytestmark = pytest.mark.e2e

LONG = 40


@pytest.fixture(scope="module")
def nextn_decoders(tmp_path_factory, deepseek_reference, stacks):
    stacks.close()  # the pool's reference stack would compete for the 2 cores
    root = tmp_path_factory.mktemp("migration-nextn")
    dumps = root / "dumps"
    dumps.mkdir()
    with decoder_pair(root, MODEL, "shmem", extra=MTP, env=((DUMP_ENV, str(dumps)),)) as (a, b):
        yield a, b, dumps


def test_a_nextn_request_cut_after_5_and_20_tokens_ends_as_the_unmigrated_one(nextn_decoders, deepseek_reference):
    a, b, dumps = nextn_decoders
    url, prompt = _decoder(a).url, deepseek_reference.prompts[-3]  # several pages of latent
    gen = lambda rid: post_json(f"{url}/generate", {  # noqa: E731
        "input_ids": prompt, "rid": rid, "sampling_params": greedy(LONG)}, 180)
    plain = gen("kvdump-plain")
    assert sum(_steps(dumps, "kvdump-plain")) > 0, "the NEXTN layer never agreed"
    for n, k in enumerate((5, 20), 1):
        rid = f"migrate-after-{k}-kvdump-n{k}"
        served = _served(a)
        got = gen(rid)
        assert got["output_ids"] == plain["output_ids"], f"migrated after {k}: tokens differ from the unmigrated run"
        assert got["meta_info"]["completion_tokens"] == LONG
        assert _served(a) == served + 1, "B recomputed nothing: its KV came from A"
        stats = _traced(a, n)
        trace = stats["migrations"][-1]
        assert trace["outputs_at_cut"] >= k and trace["kv_tokens"] == len(prompt) + trace["outputs_at_cut"] - 1
        pages = pages_for(trace["kv_tokens"], stats["page_size"])
        assert trace["bytes"] == pages * stats["kv_page_bytes"], trace
        assert trace["writes"] == pages * (LAYERS + 1), "one latent write per page and layer, the NEXTN layer's too"
        both = _steps(dumps, rid) + _steps(dumps, f"{rid}.m*")
        assert got["meta_info"]["spec_verify_ct"] == len(both)
        print(f"\nmigration | NEXTN after {k} (cut at {trace['outputs_at_cut']}): {trace['bytes']} bytes, "
              f"{trace['writes']} writes, hand-over {trace['hand_over_s'] * 1000:.1f} ms")
    _free(a, b)
