"""Speculative decoding across the boundary (EAGLE and STANDALONE drafts, one step, top-k 1).

The exact reference is a colocated server with the same speculative configuration and the
messenger's page size: a disaggregated run must give its tokens and, per request, its
verification counts (steps, and how many steps accepted 0 or 1 draft token) and each step's
accepted draft count (SGLANG_DISAGG_KV_DUMP's step log): the draft reads on the decoder
exactly the KV it would have computed itself. The drafts are built in: `tiny-llama-draft`
(STANDALONE: tiny-llama's weights perturbed by 5%: its KV differs from the target's, its
greedy choices mostly agree) and `tiny-llama-1l-eagle` (an EAGLE head trained on the
one-layer `tiny-llama-1l`'s hidden states: models.eagle). Checked too: the tokens equal a
colocated server's without speculation; the decoder's draft KV for the prompt equals, byte
for byte, the colocated server's (the dumps); writes per request are the planner's count
with the draft's layers; zeroing the draft's KV on the decoder changes the acceptance (the
comparison can fail); a decoder without the draft is refused at first contact, naming it;
a control connection dropped mid-transfer frees every page on both sides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from sglang_disagg.backends import BackendConfig, auth, create_backend
from sglang_disagg.launch import LaunchConfig, Role, Stack
from sglang_disagg.launch.client import greedy, post_json
from sglang_disagg.messenger import wire
from sglang_disagg.messenger.faults import ENV as FAULT_ENV
from sglang_disagg.messenger.links import REFUSED_MARK
from sglang_disagg.messenger.planner import pages_for
from sglang_disagg.models import get_spec
from sglang_disagg.testsupport import DUMP_ENV

from .conftest import COMMON_ARGS, OUTPUT_TOKENS, next_port, prompts_for
from .faultlib import (FAULT_DEADLINE_S, Call, drop_connections, first_contact, long_prompt, scrape, total, value,
                       wait_for, wait_released)

pytestmark = pytest.mark.e2e

ONE_STEP = ("--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2")
PAGE = 16
STATS = ("spec_verify_ct", "spec_correct_drafts_histogram", "completion_tokens")


@dataclass(frozen=True)
class Draft:
    """A built-in draft; its target is its spec's base, the layer counts the specs'."""
    algorithm: str
    draft: str

    @property
    def target(self) -> str:
        return get_spec(self.draft).base

    @property
    def layers(self) -> int:
        return get_spec(self.target).num_layers

    @property
    def draft_layers(self) -> int:
        return get_spec(self.draft).num_layers

    @property
    def args(self) -> tuple[str, ...]:
        return ("--speculative-algorithm", self.algorithm, "--speculative-draft-model-path", self.draft) + ONE_STEP


DRAFTS = [Draft("STANDALONE", "tiny-llama-draft"), Draft("EAGLE", "tiny-llama-1l-eagle")]


def _start(root, draft: Draft, role: Role, env=(), **kw) -> Stack:
    port = next_port()
    secret = root / "secret"
    if not secret.exists():
        secret.write_text(auth.new_secret() + "\n")
        secret.chmod(0o600)
    cfg = LaunchConfig(role=role, model=draft.target, port=port, max_total_tokens=4096, page_size=PAGE,
                       extra_args=COMMON_ARGS + draft.args, env=tuple(env),
                       log_dir=str(root / f"{role.value}-{port}"), secret_file=str(secret), **kw)
    stack = Stack.for_config(cfg)
    stack.start()
    return stack


def _run(url: str, prompts, rid: str | None = None) -> list[tuple[list[int], dict]]:
    out = []
    for i, p in enumerate(prompts):
        extra = {"rid": f"kvdump-{rid}-{i}"} if rid else {}
        r = post_json(f"{url}/generate", {"input_ids": p, "sampling_params": greedy(OUTPUT_TOKENS), **extra})
        out.append((list(r["output_ids"]), {k: r["meta_info"].get(k) for k in STATS}))
    return out


@pytest.fixture(scope="module", params=DRAFTS, ids=lambda d: d.algorithm)
def spec_reference(request, tmp_path_factory, references, stacks):
    """Colocated speculative outputs and stats, and its KV dumps (rid kvdump-col-i)."""
    draft = request.param
    references(draft.target)
    stacks.close()
    root = tmp_path_factory.mktemp(f"spec-{draft.algorithm}")
    dumps = root / "dumps"
    dumps.mkdir()
    prompts = prompts_for(draft.target)
    stack = _start(root, draft, Role.COLOCATED, env=((DUMP_ENV, str(dumps)),))
    try:
        # Through the server's own port: the rid names the dump file.
        out = _run(stack.url, prompts, rid="col")
    finally:
        stack.stop()
    return draft, prompts, out, dumps, root


def _writes(stack: Stack) -> float:
    """KV writes the decoder counted (its metrics endpoint: live)."""
    return value(scrape("127.0.0.1", stack.cfg.ports.decode_metrics), "sglang_disagg_kv_writes_total")


def _idle(stack: Stack) -> bool:
    s = scrape("127.0.0.1", stack.cfg.ports.decode_metrics)
    return total(s, "sglang_disagg_requests_in_flight") == 0


def _carried(prompts) -> list[int]:
    return [i for i, p in enumerate(prompts) if len(p) >= 2]


# The second backend also moves KV sharded: a TP 2 prefill server's two ranks each write half
# the heads of every target and draft page into the TP 1 decoder's.
@pytest.mark.parametrize("backend,provider,prefill_tp", [("libfabric", "tcp", 1), ("shmem", None, 2)],
                         ids=["libfabric-tcp", "shmem-tp2-tp1"])
def test_speculative_messenger_matches_colocated_speculation(spec_reference, references, backend, provider,
                                                             prefill_tp):
    draft, prompts, expected, dumps, root = spec_reference
    _, plain = references(draft.target)
    stack = _start(root, draft, Role.ALL, env=((DUMP_ENV, str(dumps)),), backend=backend, provider=provider,
                   prefill_tp=prefill_tp)
    try:
        decoder = f"http://127.0.0.1:{stack.cfg.ports.decode}"
        wait_for("the readiness probe's request handed off", lambda: _idle(stack))
        before = _writes(stack)
        got = _run(decoder, prompts, rid=f"dis-{backend}")
        wait_for("the counters published", lambda: _idle(stack))
        # The hand-off records of this run's requests (published a moment after the request
        # leaves the in-flight count: read until all are there).
        tag = f"kvdump-dis-{backend}-"
        mine_now = lambda: sorted((r for r in (stack.messenger_stats("decode") or {}).get("recent", [])  # noqa: E731
                                   if str(r["rid"]).startswith(tag)), key=lambda r: int(r["rid"][len(tag):]))
        wait_for("every hand-off recorded", lambda: len(mine_now()) >= len(_carried(prompts)), 10, 0.05)
        mine = mine_now()
        writes = _writes(stack) - before
        via_router = _run(stack.url, prompts[:3])
    finally:
        stack.stop()
    for i, ((tokens, stats), (ref_tokens, ref_stats)) in enumerate(zip(got, expected)):
        assert tokens == ref_tokens, f"prompt {i} ({len(prompts[i])} tokens): {tokens} != colocated {ref_tokens}"
        assert stats == ref_stats, f"prompt {i} ({len(prompts[i])} tokens): {stats} != colocated {ref_stats}"
        assert tokens == plain[i], f"prompt {i}: speculation changed the tokens"
    assert [t for t, _ in via_router] == [t for t, _ in expected[:3]]
    assert sum(s["spec_correct_drafts_histogram"][1] for _, s in got) > 0, "the draft never agreed"
    # Each carried request's pages (all but those its radix tree held: the shared prefix's
    # first chunk, the repeated prompt), once per layer of both models, K and V, per shard.
    assert [r["tokens"] for r in mine] == [len(prompts[i]) - 1 for i in _carried(prompts)]
    assert all(r["pages"] == pages_for(r["tokens"], PAGE) for r in mine)
    assert sum(r["reused"] for r in mine) > 0
    want = sum(r["pages"] - r["reused"] for r in mine)
    # (From a TP 2 prefill, each page of the TP 1 decoder is two writes: half its heads each.)
    assert writes == want * (draft.layers + draft.draft_layers) * 2 * prefill_tp
    # Each verify step accepted what the colocated server's did, step by step.
    for i, (_, stats) in enumerate(got):
        steps = (dumps / f"kvdump-dis-{backend}-{i}.steps").read_text().split()
        assert len(steps) == stats["spec_verify_ct"] > 0
        assert steps == (dumps / f"kvdump-col-{i}.steps").read_text().split(), f"prompt {i}: steps differ"
    # The KV the decoder holds for the prompt is the colocated server's. All but the last
    # slot arrived by transfer: byte for byte where both sides computed it in the same GEMM
    # shapes (orders of a page or more); a 1- or 3-token order runs its GEMMs on 1 or 3 rows
    # where the colocated prefill had 2 or 4, and float32 rounds those differently (~1e-6,
    # against > 0.1 between the target's and the draft's KV, so a swapped or stale pool
    # cannot pass). A TP 2 prefill server sums each layer's row-parallel halves in its
    # all-reduce, another float32 order: within 1e-5 too. The last slot the decoder computed
    # itself, in a one-token forward (the draft's from its own target hidden state): likewise.
    for i in _carried(prompts):
        col = torch.load(dumps / f"kvdump-col-{i}.pt")
        dis = torch.load(dumps / f"kvdump-dis-{backend}-{i}.pt")
        for part in ("target", "draft"):
            for layer, (a, b) in enumerate(zip(col[part], dis[part])):
                for kind, x, y in (("K", a[0], b[0]), ("V", a[1], b[1])):
                    where = f"prompt {i} ({len(prompts[i])} tokens): {part} layer {layer} {kind}"
                    assert x.shape[0] == y.shape[0] == len(prompts[i]), where
                    if len(prompts[i]) - 1 >= PAGE and prefill_tp == 1:
                        assert torch.equal(x[:-1], y[:-1]), f"{where} differs from colocated"
                    assert (x - y).abs().max() <= 1e-5, f"{where} differs from colocated"
        # The draft's KV is its own: a swapped or stale pool cannot pass the tolerance above.
        assert (col["draft"][0][0] - col["target"][0][0]).abs().max() > 0.1


def _refused_without_draft(stack: Stack, draft: Draft) -> None:
    """A decoder without the draft, against the live prefill server: refused, naming it."""
    secret = auth.load_secret({auth.SECRET_FILE_ENV: stack.cfg.secret_file})
    backend = create_backend("libfabric", BackendConfig(provider="tcp", host="127.0.0.1", port=0, secret=secret))
    kv = wire.KVSpec(model=draft.target, fingerprint="0", num_layers=draft.layers, kv_heads=2, head_dim=64,
                     v_head_dim=64, page_size=PAGE, dtype="float32", layout="hnd", tp=1)
    hello = wire.Hello(decoder="test", backend="libfabric", provider="tcp", kv=kv, ranks=())
    link, _ = first_contact(backend, hello, f"127.0.0.1:{stack.cfg.ports.bootstrap}")
    assert REFUSED_MARK in link.reason
    assert f"speculative draft differs (decoder: none, prefill: {draft.algorithm}:" in link.reason, link.reason
    hidden = get_spec(draft.draft).hidden_size
    assert f"draft_hidden_size differs (decoder: 0, prefill: {hidden})" in link.reason, link.reason


def test_zeroed_draft_kv_first_contact_and_a_fault(spec_reference):
    """One stack whose decoder zeroes the draft's layers (the last of what it receives): the
    negative control (verification keeps the tokens, the acceptance must change); the live
    prefill server refuses a decoder without the draft at first contact, naming it; a
    control connection dropped mid-transfer frees every page, target's and draft's, on
    both sides, and the next request is served."""
    draft, prompts, expected, _, root = spec_reference
    env = ((FAULT_ENV, f"zero_kv:layers=last:{draft.draft_layers}"),)
    stack = _start(root, draft, Role.ALL, env=env, backend="libfabric", provider="tcp")
    try:
        got = _run(stack.url, prompts)
        assert [t for t, _ in got] == [t for t, _ in expected]
        changed = [i for i in _carried(prompts) if got[i][1] != expected[i][1]]
        assert len(changed) >= len(_carried(prompts)) // 2, f"only prompts {changed} changed acceptance"
        _refused_without_draft(stack, draft)

        # The control connection dropped while a long prompt's target and draft KV are in flight.
        # (The router retries what the decoder fails: the client may get an answer.)
        writes = lambda: value(scrape("127.0.0.1", stack.cfg.ports.prefill_metrics),  # noqa: E731
                               "sglang_disagg_kv_writes_total")
        failed = lambda: value(scrape("127.0.0.1", stack.cfg.ports.decode_metrics),  # noqa: E731
                               "sglang_disagg_requests_total", outcome="failed")
        before, failed_before = writes(), failed()
        call = Call(stack.url, long_prompt(2000, 18), 4)
        wait_for("prefill writing", lambda: writes() > before, 30, 0.005)
        t0 = time.monotonic()
        drop_connections(stack.cfg.ports.bootstrap)
        call.result()
        assert failed() == failed_before + 1  # the decoder failed it mid-transfer (the router may retry it)
        _, leak_d = wait_released("127.0.0.1", stack.cfg.ports.decode_metrics, t0, FAULT_DEADLINE_S + 3)
        _, leak_p = wait_released("127.0.0.1", stack.cfg.ports.prefill_metrics, t0, FAULT_DEADLINE_S + 3)
        assert leak_d == 0 and leak_p == 0
        wait_for("the link back", lambda: {v["state"] for v in
                                           (stack.messenger_stats("decode") or {}).get("links", {}).values()}
                 == {"ready"}, 10, 0.1)
        got = _run(stack.url, [prompts[3]])
        assert got[0][0] == expected[3][0]
    finally:
        stack.stop()
