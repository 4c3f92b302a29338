"""DeepSeek's MLA latent KV through the messenger (tiny-deepseek-v3, float32, torch_native).

Every TP rank holds the whole latent (one [slots, 1, kv_lora_rank + rope] buffer per layer),
so the plan is replicated: each destination rank takes a request's pages from ONE prefill
rank drawn per request (both sides seed the draw with the order's tag), one write per page
and layer per destination rank. Checked, against one colocated TP 1 server of the same model:
- every TP pair (prefill -> decode) 1->1, 2->1, 1->2, 2->2 on shmem and 2->1 on libfabric tcp
  gives the colocated tokens over the suite's prompts, sequential and concurrent; the decoder
  counted pages x layers x destination ranks writes; a TP 2 prefill server read from both
  ranks over the run; the decoder's latent KV for each prompt is the colocated server's; a
  JSON-schema constrained request gives the colocated answer;
- the source is random and really is the one read: a fault zeroes TP rank 1's copy of what
  it is about to send (its forward is over, rank 0's copy stays right); exactly the requests
  whose draw picked rank 1 come out different, and both ranks were picked;
- a DeepSeek-V2 checkpoint without q LoRA (generated here) on one pair, against its float64
  reference (the colocated tests show the served tokens equal it);
- NEXTN (MTP, one draft step, top-k 1) across the boundary, TP 2 -> 1: tokens, verification
  counts and each step's accepted drafts equal a colocated MTP server's (and the tokens a
  server's without MTP); the decoder's draft latent equals the colocated one; zeroing the
  draft's latent on arrival changes the acceptance; a decoder without MTP is refused by a
  prefill server with it, naming NEXTN.
Faults and refusals of the MLA path: test_deepseek_faults.py.
"""

from __future__ import annotations

import pytest
import torch

from harness.deepseek import V2_NO_Q_LORA, checkpoint
from sglang_disagg.backends import BackendConfig, auth, create_backend
from sglang_disagg.launch import Role
from sglang_disagg.messenger import compat, wire
from sglang_disagg.messenger.faults import ENV as FAULT_ENV
from sglang_disagg.messenger.links import REFUSED_MARK
from sglang_disagg.messenger.planner import pages_for
from sglang_disagg.models import ensure_model
from sglang_disagg.testsupport import DUMP_ENV

from .conftest import StackSpec, assert_same, prompts_for, run_concurrent, start_stack, structured
from .deepseek_pd import LAYERS, MODEL, MTP, PAGE, draw_prompts, kv_writes, run_prompts
from .faultlib import first_contact, wait_for
from .test_deepseek_colocated import reference

pytestmark = pytest.mark.e2e

@pytest.fixture(scope="module")
def colocated(deepseek_reference, stacks):
    """The colocated TP 1 reference (deepseek_pd.py); its stack stops here (these tests start
    stacks of their own, and one idle server would still compete for the 2 cores)."""
    stacks.close()
    return deepseek_reference


# Every TP pair and every backend once; the latent crosses the transfer libraries' own write
# paths too (UCX, Mooncake's engine). shmem TP 2 -> 1 also runs in the draw and NEXTN tests.
PAIRS = [
    pytest.param("shmem", None, 1, 1, id="shmem-1-1"),
    pytest.param("shmem", None, 2, 2, id="shmem-2-2"),
    pytest.param("libfabric", "tcp", 2, 1, id="libfabric-tcp-2-1"),
    pytest.param("nixl", None, 2, 1, id="nixl-2-1"),
    pytest.param("mooncake", None, 1, 2, id="mooncake-1-2"),
]


@pytest.mark.parametrize("backend,provider,prefill_tp,decode_tp", PAIRS)
def test_tp_pair_matches_colocated(colocated, backend, provider, prefill_tp, decode_tp):
    root, dumps, prompts, expected = colocated.root, colocated.dumps, colocated.prompts, colocated.outputs
    tag = f"dis-{backend}-{prefill_tp}{decode_tp}"
    stack = start_stack(root, StackSpec(model=MODEL, backend=backend, provider=provider, prefill_tp=prefill_tp,
                                        decode_tp=decode_tp, env=((DUMP_ENV, str(dumps)),)))
    try:
        decoder = f"http://127.0.0.1:{stack.cfg.ports.decode}"
        wait_for("the readiness probe handed off", lambda: sum(stack.messenger_stats("decode")["in_flight"]
                                                               .values()) == 0, 10, 0.05)
        before = kv_writes(stack)
        assert_same(run_prompts(decoder, prompts, rid=tag), expected, prompts)  # by the decoder's port: rids name dumps
        wait_for("every hand-off recorded", lambda: sum(
            str(r["rid"]).startswith(f"kvdump-{tag}-") for r in stack.messenger_stats("decode")["recent"])
            >= sum(len(p) >= 2 for p in prompts), 10, 0.05)
        mine = [r for r in stack.messenger_stats("decode")["recent"] if str(r["rid"]).startswith(f"kvdump-{tag}-")]
        writes = kv_writes(stack) - before
        assert_same(run_concurrent(stack.url, prompts), expected, prompts)
        # Structured output: the decoder's grammar over KV that arrived (the prompt's radix hit).
        got_json = structured(stack.url, prompts[-1])
        assert got_json["output_ids"] == colocated.json["output_ids"], (got_json["text"], colocated.json["text"])
        assert not stack.dead()
        decode, prefill = stack.messenger_stats("decode"), stack.messenger_stats("prefill")
    finally:
        stack.stop()
    # One write per page and layer per destination rank, whatever the prefill TP (never
    # x source ranks); pages the decoder's radix tree held are not asked for.
    assert all(r["pages"] == pages_for(r["tokens"], PAGE) for r in mine)
    assert writes == sum(r["pages"] - r["reused"] for r in mine) * LAYERS * decode_tp
    assert decode["requests_failed"] == 0 and decode["pages_quarantined"] == 0
    for role, tp, node in (("prefill", prefill_tp, prefill), ("decode", decode_tp, decode)):
        assert (node["tp"], node["backends"], node["ranks_driven"]) == (tp, 1, tp), role
    by_source = {int(k): v for k, v in prefill["requests_by_source"].items()}
    assert set(by_source) == set(range(prefill_tp)), f"sources drawn: {by_source}"  # every prefill rank sent
    # The latent the decoder holds for each prompt is the colocated server's: all but the
    # last slot arrived by transfer. Within float32 rounding (a prefill of other GEMM shapes
    # or a TP 2 all-reduce orders sums differently, ~1e-6); a missing or misplaced page is O(1).
    for i, p in enumerate(prompts):
        if len(p) < 2:
            continue
        col, dis = torch.load(dumps / f"kvdump-col-{i}.pt"), torch.load(dumps / f"kvdump-{tag}-{i}.pt")
        assert len(col["target"]) == len(dis["target"]) == LAYERS
        for layer, ((a,), (b,)) in enumerate(zip(col["target"], dis["target"])):
            assert a.shape == b.shape == (len(p), 1, 160), f"prompt {i} layer {layer}: {a.shape} {b.shape}"
            assert (a - b).abs().max() <= 1e-5, f"prompt {i} ({len(p)} tokens) layer {layer}: latent differs"


def test_the_drawn_source_is_the_one_read(colocated):
    """TP 2 -> 1 with rank 1's copy zeroed before it is sent: exactly its draws differ."""
    root, expected = colocated.root, colocated.draws
    prompts = draw_prompts()
    stack = start_stack(root, StackSpec(model=MODEL, backend="shmem", prefill_tp=2,
                                        env=((FAULT_ENV, "corrupt_source:1"),)))
    try:
        decoder = f"http://127.0.0.1:{stack.cfg.ports.decode}"
        got = run_prompts(decoder, prompts, rid="draw")
        rids = {f"kvdump-draw-{i}" for i in range(len(prompts))}
        wait_for("every order recorded", lambda: rids <= {r["rid"] for r in stack.messenger_stats("prefill")["recent"]},
                 10, 0.05)
        corrupted = set(stack.messenger_stats("prefill")["fault_corrupted"])
    finally:
        stack.stop()
    drew_1 = {i for i in range(len(prompts)) if f"kvdump-draw-{i}" in corrupted}
    differ = {i for i, (g, e) in enumerate(zip(got, expected)) if g != e}
    assert 0 < len(drew_1) < len(prompts), f"the draw picked rank 1 for {sorted(drew_1)} of {len(prompts)}"
    assert differ == drew_1, f"differing {sorted(differ)}, drew the corrupted rank {sorted(drew_1)}"


def test_v2_without_q_lora_through_the_messenger(tmp_path_factory, colocated):
    root = colocated.root
    path = checkpoint(V2_NO_Q_LORA, tmp_path_factory.mktemp("deepseek-v2"))
    prompts = prompts_for(MODEL)
    stack = start_stack(root, StackSpec(model=str(path), backend="shmem", prefill_tp=2))
    try:
        got = run_prompts(stack.url, prompts)
        assert_same(run_concurrent(stack.url, prompts), got, prompts)
    finally:
        stack.stop()
    want = reference(V2_NO_Q_LORA, path, prompts)
    for i, (g, e) in enumerate(zip(got, want)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens): {g} != float64 reference {e}"


def _mtp(root, role: Role, env=(), **kw):
    return start_stack(root, StackSpec(role=role, model=MODEL, extra_args=MTP, env=tuple(env), **kw), page_size=PAGE)


def test_nextn_across_the_boundary(colocated):
    """Colocated MTP, then messenger MTP TP 2 -> 1 (random sources for target and draft
    latent alike), then a decoder that zeroes the draft's layer on arrival."""
    root, prompts, plain = colocated.root, colocated.prompts, colocated.outputs
    dumps = root / "mtp-dumps"
    dumps.mkdir()
    stack = _mtp(root, Role.COLOCATED, env=((DUMP_ENV, str(dumps)),))
    try:
        expected = run_prompts(stack.url, prompts, rid="col", stats=True)
    finally:
        stack.stop()
    assert [t for t, _ in expected] == plain, "MTP changed the colocated tokens"
    assert sum(s["spec_correct_drafts_histogram"][1] for _, s in expected) > 0, "the NEXTN layer never agreed"

    stack = _mtp(root, Role.ALL, env=((DUMP_ENV, str(dumps)),), backend="shmem", prefill_tp=2)
    try:
        got = run_prompts(f"http://127.0.0.1:{stack.cfg.ports.decode}", prompts, rid="dis", stats=True)
        assert [t for t, _ in run_prompts(stack.url, prompts[:3], stats=True)] == [t for t, _ in expected[:3]]
    finally:
        stack.stop()
    for i, ((tokens, stats), (ref_tokens, ref_stats)) in enumerate(zip(got, expected)):
        assert tokens == ref_tokens, f"prompt {i} ({len(prompts[i])} tokens): {tokens} != colocated MTP {ref_tokens}"
        assert stats == ref_stats, f"prompt {i} ({len(prompts[i])} tokens): {stats} != colocated MTP {ref_stats}"
        steps = (dumps / f"kvdump-dis-{i}.steps").read_text().split()
        assert steps == (dumps / f"kvdump-col-{i}.steps").read_text().split(), f"prompt {i}: steps differ"
    for i, p in enumerate(prompts):
        if len(p) < 2:
            continue
        col, dis = torch.load(dumps / f"kvdump-col-{i}.pt"), torch.load(dumps / f"kvdump-dis-{i}.pt")
        for part, layers in (("target", LAYERS), ("draft", 1)):
            assert len(col[part]) == len(dis[part]) == layers
            for layer, ((a,), (b,)) in enumerate(zip(col[part], dis[part])):
                assert (a - b).abs().max() <= 1e-5, f"prompt {i} ({len(p)} tokens): {part} layer {layer} differs"
        assert (col["draft"][0][0] - col["target"][0][0]).abs().max() > 0.1  # the draft's latent is its own

    # The negative control: without the draft's latent the acceptance changes (verification
    # keeps the tokens); and a decoder without MTP is refused by this prefill server.
    stack = _mtp(root, Role.ALL, env=((FAULT_ENV, "zero_kv:layers=last"),), backend="libfabric", provider="tcp")
    try:
        cold = run_prompts(stack.url, prompts, stats=True)
        secret = auth.load_secret({auth.SECRET_FILE_ENV: stack.cfg.secret_file})
        backend = create_backend("libfabric", BackendConfig(provider="tcp", host="127.0.0.1", port=0, secret=secret))
        kv = wire.KVSpec(model=MODEL, fingerprint=compat.fingerprint(str(ensure_model(MODEL))), num_layers=LAYERS,
                         kv_heads=1, head_dim=160, v_head_dim=0, page_size=PAGE, dtype="float32", layout="hnd",
                         tp=1, kv_lora_rank=128, rope_dim=32, replicated=True)
        hello = wire.Hello(decoder="test", backend="libfabric", provider="tcp", kv=kv, ranks=())
        link, _ = first_contact(backend, hello, f"127.0.0.1:{stack.cfg.ports.bootstrap}")
    finally:
        stack.stop()
    assert [t for t, _ in cold] == plain
    carried = [i for i, p in enumerate(prompts) if len(p) >= 2]
    changed = [i for i in carried if cold[i][1] != expected[i][1]]
    assert len(changed) >= len(carried) // 2, f"only prompts {changed} changed acceptance without the draft's KV"
    assert REFUSED_MARK in link.reason
    assert "speculative draft differs (decoder: none, prefill: NEXTN:" in link.reason, link.reason
    assert "draft_layers differs (decoder: 0, prefill: 1)" in link.reason, link.reason
