"""Faults and refusals on DeepSeek's MLA path (tiny-deepseek-v3, float32), against the
colocated TP 1 reference (deepseek_pd.py):
- a decoder missing one layer's pages (layer 2) differs (the comparison can fail); first
  contact refuses a decoder whose latent geometry or dtype differs, naming it; a control
  connection dropped mid-transfer frees every page on both sides and the next request is exact;
- the prefill rank a request's draw picked as its source (replicated KV: one rank of the
  prefill server sends a request's pages) stopped mid-transfer: the request fails with the
  reason at the transfer deadline, nothing is handed to decoding, its pages wait while a
  write may still come; resumed, everything is freed and the next requests are exact.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import pytest

from sglang_disagg.backends import BackendConfig, auth, create_backend
from sglang_disagg.launch.client import RequestError, generate_ids
from sglang_disagg.messenger import compat, wire
from sglang_disagg.messenger.faults import ENV as FAULT_ENV
from sglang_disagg.messenger.links import REFUSED_MARK
from sglang_disagg.models import ensure_model

from .conftest import OUTPUT_TOKENS, StackSpec, start_stack
from .deepseek_pd import LAYERS, MODEL, PAGE, draw_prompts, kv_writes, run_prompts
from .faultlib import (FAULT_DEADLINE_S, SIGCONT, SIGSTOP, Call, drop_connections, first_contact, long_prompt, row,
                       scrape, value, wait_for, wait_released)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def colocated(deepseek_reference, stacks):
    stacks.close()  # its stack: these tests start their own
    return deepseek_reference


def _refusal(stack, **latent) -> str:
    """First contact from a hand-made decoder whose latent is this server's but for `latent`:
    the link's reason."""
    secret = auth.load_secret({auth.SECRET_FILE_ENV: stack.cfg.secret_file})
    backend = create_backend("libfabric", BackendConfig(provider="tcp", host="127.0.0.1", port=0, secret=secret))
    fields = dict(model=MODEL, fingerprint=compat.fingerprint(str(ensure_model(MODEL))), num_layers=LAYERS,
                  kv_heads=1, head_dim=160, v_head_dim=0, page_size=PAGE, dtype="float32", layout="hnd", tp=1,
                  kv_lora_rank=128, rope_dim=32, replicated=True)
    hello = wire.Hello(decoder="test", backend="libfabric", provider="tcp", kv=wire.KVSpec(**fields | latent),
                       ranks=())
    link, _ = first_contact(backend, hello, f"127.0.0.1:{stack.cfg.ports.bootstrap}")
    assert REFUSED_MARK in link.reason, link.reason
    return link.reason


def _geometry_refused(stack) -> None:
    """Decoders whose latent differs, against the live prefill server: refused at first
    contact, naming what differs: the latent's parts (kv_lora_rank 64 + rope 32), or its
    dtype alone (bf16 pages would read the float32 latent as garbage)."""
    reason = _refusal(stack, head_dim=96, kv_lora_rank=64)
    assert "kv_lora_rank differs (decoder: 64, prefill: 128)" in reason, reason
    assert "head_dim differs (decoder: 96, prefill: 160)" in reason, reason
    assert "rope_dim" not in reason and "replicated" not in reason, reason
    reason = _refusal(stack, dtype="bfloat16")
    assert "dtype differs (decoder: bfloat16, prefill: float32)" in reason, reason
    assert "kv_lora_rank" not in reason and "head_dim" not in reason, reason


def test_missing_layer_differs_refusal_and_dropped_connection(colocated):
    """Negative control (layer 2's pages zeroed on arrival: every carried prompt differs),
    the latent-geometry refusal, and a control connection dropped mid-transfer."""
    root, prompts, expected = colocated.root, colocated.prompts, colocated.outputs
    stack = start_stack(root, StackSpec(model=MODEL, backend="libfabric", provider="tcp",
                                        env=((FAULT_ENV, "zero_kv:layers=2"),)))
    try:
        carried = [i for i, p in enumerate(prompts) if len(p) >= 2]
        got = [generate_ids(stack.url, prompts[i], OUTPUT_TOKENS) for i in carried]
        differ = [i for i, g in zip(carried, got) if g != expected[i]]
        # The long prompt's repeat takes its pages from the decoder's radix tree (nothing carried).
        assert len(differ) >= len(carried) - 1, f"only prompts {differ} of {carried} differ without layer 2"
        _geometry_refused(stack)

        writes = lambda: kv_writes(stack, "prefill")  # noqa: E731
        failed = lambda: _outcomes(stack)[0]  # noqa: E731
        link_ready = lambda: {v["state"] for v in  # noqa: E731
                              (stack.messenger_stats("decode") or {}).get("links", {}).values()} == {"ready"}
        for attempt in range(3):  # the drop must land while the KV is in flight, verified below
            before, failed_before = writes(), failed()
            call = Call(stack.url, long_prompt(2000, 27 + 100 * attempt), 4)
            wait_for("prefill writing", lambda: writes() > before, 30, 0.005)
            t0 = time.monotonic()
            drop_connections(stack.cfg.ports.bootstrap)
            call.result()
            if failed() > failed_before:  # the decoder failed it mid-transfer (the router may retry it)
                break
            print(f"attempt {attempt}: the transfer had finished before the drop; again")
            wait_for("the link back", link_ready, 10, 0.1)
        else:
            pytest.fail("in 3 tries the control connection never dropped while KV was in flight")
        _, leak_d = wait_released("127.0.0.1", stack.cfg.ports.decode_metrics, t0, FAULT_DEADLINE_S + 3)
        _, leak_p = wait_released("127.0.0.1", stack.cfg.ports.prefill_metrics, t0, FAULT_DEADLINE_S + 3)
        assert leak_d == 0 and leak_p == 0
        wait_for("the link back", link_ready, 10, 0.1)
        assert generate_ids(stack.url, prompts[0], OUTPUT_TOKENS) == expected[0]  # 1 token: never carried
    finally:
        stack.stop()


# The stack's --transfer-timeout. A stopped non-leader rank is silent only in its writes: the
# leader's messenger still answers heartbeats, so the transfer deadline is what finds it.
STOP_TRANSFER_TIMEOUT_S = 3.0


def _scheduler_pid(stack, role: str, rank: int) -> int:
    """The scheduler process of TP rank `rank` of the `role` server (SGLang titles it
    sglang::scheduler_TP<rank>)."""
    server = next(p for p in stack.servers if p.spec.name == role)
    for child in psutil.Process(server.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.cmdline() and child.cmdline()[0].endswith(f"scheduler_TP{rank}"):
                return child.pid
    raise AssertionError(f"no sglang::scheduler_TP{rank} process under the {role} server")


def _outcomes(stack) -> tuple[float, float]:
    """The decoder's failed and carried request counts, live from its metrics port (its stats
    file is rewritten at most 5 times a second while it steps, and not at all once idle)."""
    s = scrape("127.0.0.1", stack.cfg.ports.decode_metrics)
    return (value(s, "sglang_disagg_requests_total", outcome="failed"),
            value(s, "sglang_disagg_requests_total", outcome="carried"))


def _sources(stack) -> dict[str, int]:
    """Prefill TP rank -> orders whose pages were read from it (the leader's draw count)."""
    return dict((stack.messenger_stats("prefill") or {}).get("requests_by_source", {}))


def test_the_drawn_source_rank_stopped_mid_transfer(colocated):
    """MLA TP 2 -> 1 on libfabric tcp. A 2000-token request (32 chunks) whose draw picked
    prefill rank 1 (not the leader, which holds the control connection) has that rank
    stopped (SIGSTOP) while its pages are being written: its writes stop, the leader's
    forward waits for it, and only the transfer deadline can tell the decoder."""
    stack = start_stack(colocated.root, StackSpec(model=MODEL, backend="libfabric", provider="tcp", prefill_tp=2),
                        transfer_timeout_s=STOP_TRANSFER_TIMEOUT_S)
    decoder = f"http://127.0.0.1:{stack.cfg.ports.decode}"  # not the router: it would retry the 503
    rank1, stopped = _scheduler_pid(stack, "prefill", 1), False
    try:
        for attempt in range(8):  # until a request draws rank 1 and is stopped mid-transfer (checked)
            sources, posted, (failed0, carried0) = _sources(stack), kv_writes(stack, "prefill"), _outcomes(stack)
            call = Call(decoder, long_prompt(2000, 61 + attempt), 4)
            wait_for("prefill writing", lambda: kv_writes(stack, "prefill") > posted, 30, 0.005)
            now = wait_for("the order's source counted", lambda: (s := _sources(stack)) != sources and s, 5, 0.01)
            if now.get("1", 0) == sources.get("1", 0):
                call.result(30)  # rank 0 drawn: served; the next prompt draws again
                continue
            os.kill(rank1, SIGSTOP)
            t0, stopped = time.monotonic(), True
            wait_for("rank 1 stopped", lambda: psutil.Process(rank1).status() == psutil.STATUS_STOPPED, 2, 0.005)
            call.result(STOP_TRANSFER_TIMEOUT_S + 30)
            if call.err is not None:
                break
            print(f"attempt {attempt}: the transfer had finished before the stop; again")
            os.kill(rank1, SIGCONT)
            stopped = False
        else:
            pytest.fail("in 8 requests, rank 1 was never drawn and stopped while the KV was in flight")
        tte = call.done_at - t0
        assert isinstance(call.err, RequestError) and "KV transfer from" in call.err.body, call.err
        assert "before the deadline" in call.err.body, call.err.body
        failed1, carried1 = _outcomes(stack)
        assert failed1 == failed0 + 1
        assert carried1 == carried0, "a request was decoded on incomplete KV"
        # The deadline counts from the order, which came before the stop: within it plus the reaction.
        assert tte < STOP_TRANSFER_TIMEOUT_S + FAULT_DEADLINE_S, f"{tte:.3f} s from the stop to the error"
        # While the rank is stopped a write may still come: the pages wait (released or quarantined
        # later). Read from the stats file, rewritten while the decoder steps (it does: it holds them).
        waiting = lambda: sum(((stack.messenger_stats("decode") or {}).get("in_flight") or {}).get(p, 0)  # noqa: E731
                              for p in ("release", "quarantine")) == 1
        wait_for("the failed request waiting for its late writes", waiting, 2, 0.02)
        os.kill(rank1, SIGCONT)
        stopped, t1 = False, time.monotonic()
        freed_d, leak_d = wait_released("127.0.0.1", stack.cfg.ports.decode_metrics, t1, FAULT_DEADLINE_S + 8)
        freed_p, leak_p = wait_released("127.0.0.1", stack.cfg.ports.prefill_metrics, t1, FAULT_DEADLINE_S + 8)
        assert leak_d == 0 and leak_p == 0, f"pages or requests held after the rank resumed: {leak_d}, {leak_p}"
        sources = _sources(stack)
        assert run_prompts(stack.url, draw_prompts()) == colocated.draws
        assert _sources(stack).get("1", 0) > sources.get("1", 0), "rank 1 was not drawn again after it resumed"
    finally:
        if stopped:
            os.kill(rank1, SIGCONT)
        stack.stop()
    row("MLA: the drawn source rank (TP 1 of 2) stopped mid-transfer", tte, leak_d + leak_p, True,
        f"failed at the {STOP_TRANSFER_TIMEOUT_S:.0f} s transfer deadline: '{call.err.body[-120:]}'; nothing "
        f"decoded; pages held while it was stopped, freed {max(freed_d, freed_p):.3f}s after it resumed")
