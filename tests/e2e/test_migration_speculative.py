"""Live migration of a speculative request (EAGLE and STANDALONE drafts, one draft step, top-k 1)
between decoders.

A's draft KV moves with the target's (the draft's layers follow the target's in the plan and
in B's count) and B runs the last output through target and draft, as on a prefill hand-off.
Checked, for a request cut after 5 and after 50 tokens:
  - the client gets exactly the tokens of the request that never moved, and its usage;
  - A's verify steps before the cut accepted what the unmigrated run's did, step by step
    (SGLANG_DISAGG_KV_DUMP's step log), and they account for every output A made;
  - B's verify steps accepted, step by step, what a decoder handed the same tokens by the
    prefill server accepts (the request resumed: prompt + A's outputs as a new request): with
    the draft's KV missing or stale, acceptance changes (tests/e2e/test_speculative.py shows a
    zeroed draft pool does);
  - the target and draft KV B holds after its first step is that resumed request's (within
    float32 rounding: one side computed it token by token, the other in one prefill), and the
    draft's differs from the target's (a swapped pool cannot pass);
  - the client's speculative counters are A's verify steps and B's together;
  - nothing recomputed: no prefill order for the migrated request, and A wrote the request's KV
    with the draft's layers, the floor; nothing held afterwards.
Where the unmigrated run's next step verified a draft, B's first step is that extend: the step
boundaries shift by one token at the hand-over, so B's steps are compared with the resumed
request's, not with the unmigrated run's (docs/architecture.md, "Live migration").
"""

from __future__ import annotations

import pytest
import torch

from sglang_disagg.launch.client import greedy, post_json
from sglang_disagg.messenger.planner import pages_for
from sglang_disagg.models import get_spec
from sglang_disagg.testsupport import DUMP_ENV

from .conftest import prompts_for
from .test_migration import _decoder, _free, _m, _served, _traced, decoder_pair
from .faultlib import value

pytestmark = pytest.mark.e2e

# algorithm -> (target, draft): EAGLE's one-layer head; STANDALONE's a separate small model
# (tiny-llama's weights perturbed, as in test_speculative.py)
DRAFTS = {"EAGLE": ("tiny-llama-1l", "tiny-llama-1l-eagle"), "STANDALONE": ("tiny-llama", "tiny-llama-draft")}
ONE_STEP = ("--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2")
LONG = 80


@pytest.fixture(scope="module", params=list(DRAFTS))
def spec_pair(request, tmp_path_factory):
    algorithm = request.param
    target, draft = DRAFTS[algorithm]
    root = tmp_path_factory.mktemp(f"migration-{algorithm.lower()}")
    dumps = root / "dumps"
    dumps.mkdir()
    extra = ("--speculative-algorithm", algorithm, "--speculative-draft-model-path", draft) + ONE_STEP
    with decoder_pair(root, target, "shmem", extra=extra, env=((DUMP_ENV, str(dumps)),)) as (a, b):
        yield a, b, dumps, algorithm


def _gen(url: str, ids: list[int], n: int, rid: str) -> dict:
    return post_json(f"{url}/generate", {"input_ids": ids, "rid": rid, "sampling_params": greedy(n)}, 180)


def _steps(dumps, rid: str) -> list[int]:
    """Accepted drafts per verify step of the request `rid` on whichever decoder ran it."""
    files = sorted(dumps.glob(f"{rid}.steps"))
    assert len(files) == 1, f"{rid}: step logs {files}"
    return [int(x) for x in files[0].read_text().split()]


def test_a_speculative_request_cut_after_5_and_50_tokens_continues_exact_with_its_draft(spec_pair):
    a, b, dumps, algorithm = spec_pair
    target, draft = DRAFTS[algorithm]
    url, prompt = _decoder(a).url, prompts_for(target)[-2]  # longer than a prefill chunk
    plain = _gen(url, prompt, LONG, "kvdump-plain")
    plain_steps = _steps(dumps, "kvdump-plain")
    assert sum(plain_steps) > 0, "the draft never agreed: acceptance would prove nothing"
    layers, draft_layers = get_spec(target).num_layers, get_spec(draft).num_layers
    for n, k in enumerate((5, 50), 1):
        rid = f"migrate-after-{k}-kvdump-e{k}"
        served, moved = _served(a), value(_m(a), "sglang_disagg_migration_bytes_total")
        got = _gen(url, prompt, LONG, rid)
        assert got["output_ids"] == plain["output_ids"], f"migrated after {k}: tokens differ from the unmigrated run"
        assert got["meta_info"]["completion_tokens"] == LONG
        assert got["meta_info"]["prompt_tokens"] == len(prompt)
        assert _served(a) == served + 1, "one prefill order (A's own); B's KV came from A"
        stats = _traced(a, n)
        trace = stats["migrations"][-1]
        cut = trace["outputs_at_cut"]
        assert cut >= k and trace["kv_tokens"] == len(prompt) + cut - 1, trace
        # A: its verify steps are the unmigrated run's first ones and made every output it had
        # (its first output came from its own extend, each verify step gave accepted + 1)
        a_steps = _steps(dumps, rid)
        assert a_steps == plain_steps[:len(a_steps)], f"after {k}: A's steps {a_steps} vs {plain_steps}"
        assert 1 + len(a_steps) + sum(a_steps) == cut, (a_steps, cut)
        # The draft's pages moved with the target's: every layer of both, K and V
        floor = pages_for(trace["kv_tokens"], stats["page_size"]) * stats["kv_page_bytes"]
        assert trace["bytes"] == floor
        assert trace["writes"] == pages_for(trace["kv_tokens"], stats["page_size"]) * (layers + draft_layers) * 2
        assert value(_m(a), "sglang_disagg_migration_bytes_total") - moved == floor
        # B against the request resumed as a new one (prompt + A's outputs, via the prefill server)
        resumed = _gen(url, prompt + plain["output_ids"][:cut], LONG - cut, f"kvdump-resumed-{k}")
        assert resumed["output_ids"] == plain["output_ids"][cut:]
        b_steps = _steps(dumps, f"{rid}.m*")
        assert b_steps == _steps(dumps, f"kvdump-resumed-{k}"), f"after {k}: B's steps differ from a fresh hand-off"
        # The client's counters are both decoders' (A's relay adds B's to its own from the cut)
        both = a_steps + b_steps
        assert got["meta_info"]["spec_verify_ct"] == len(both)
        assert got["meta_info"]["spec_correct_drafts_histogram"] == [both.count(i) for i in range(max(both) + 1)]
        moved_kv = torch.load(next(dumps.glob(f"{rid}.m*.pt")))
        fresh_kv = torch.load(dumps / f"kvdump-resumed-{k}.pt")
        for part in ("target", "draft"):
            for layer, (x, y) in enumerate(zip(moved_kv[part], fresh_kv[part])):
                for kind, u, v in (("K", x[0], y[0]), ("V", x[1], y[1])):
                    assert u.shape[0] == v.shape[0] == len(prompt) + cut, (part, layer, kind)
                    assert (u - v).abs().max() <= 1e-4, f"after {k}: B's {part} layer {layer} {kind} differs"
        assert (moved_kv["draft"][0][0] - moved_kv["target"][0][0]).abs().max() > 0.1
        print(f"\nmigration | {algorithm} after {k} (cut at {cut}): {trace['bytes']} bytes, A {len(a_steps)} verify "
              f"steps, B {len(b_steps)}, hand-over {trace['hand_over_s'] * 1000:.1f} ms")
    _free(a, b)
