"""Network faults across hosts, through the real stack (netfaults.py: two prefill hosts, a
decode host behind a 40 Mbit/s link, the router's host, libfabric tcp, tiny-llama).

Each fault lands while a long prompt's KV is really crossing the link, and each case holds
the fault matrix's promises: a clear error within 2.5 s of a cut (SILENT_PEER_DEADLINE_S: the
1.8 s heartbeat timeout and the decoder's reaction; read from the decoder's own counter, since
the client may be cut off from it) or a re-route (here the
router's one retry: a new request with new pages), 0 pages left on the servers that live
(pages a silent host might still write into stay quarantined, counted, until it answers),
the decoder hands off only requests whose KV all landed (its "carried" count moves only for
requests that succeed), the next request token-exact. One `fault-matrix |` row per case
(`pytest -s`). Order: the link into the decode host cut shorter than the heartbeat timeout,
then longer; a partition between a prefill host and the decode host; the decode host's link
flapping under short requests; the link's rate dropped to 10 Mbit/s; last, a prefill host's
cable cut (the other one takes over; the cable comes back at the end).
"""

from __future__ import annotations

import threading
import time

import pytest

from e2e.faultlib import FAULT_DEADLINE_S, SILENT_PEER_DEADLINE_S, leaked_pages, row, value, wait_for
from harness.hosts import netns, shaping
from sglang_disagg.messenger.entry import LATE_WRITES_S

from .conftest import LONG_OUTPUT, OUTPUT_TOKENS
from .netfaults import HEARTBEAT_S, LAYOUT, RATE_MBIT, TRANSFER_TIMEOUT_S, NetFaults

pytestmark = pytest.mark.e2e
# After a cut link comes back, what was queued in the prefill's data connection is sent again
# and the failed request's pages are freed once its writes arrived. Seen here: 2.4-2.7 s after
# N6's cable came back, also with the cut held 20 s longer (our reading: a sender whose own link
# is down sees local send errors, retried on a short timer rather than TCP's backed-off one); in
# CI once still held 5 s after (cause not captured: the assertions now print the servers'
# messenger lines). The product's promise bounds the wait: the pages go once every posted write
# arrived, or LATE_WRITES_S after the prefill's answer, which comes after healing: that plus
# slack is what a test waits (it returns as soon as they are free).
DRAIN_S = LATE_WRITES_S + 5.0


@pytest.fixture(scope="module")
def nf(hosts_possible, colocated, tmp_path_factory):
    net = netns.Network.create("faults", LAYOUT.names)
    try:
        stack = NetFaults(tmp_path_factory.mktemp("netfaults"), net)
        stack.start()
        try:
            yield stack
        finally:
            stack.close()
    finally:
        net.close()


@pytest.fixture(scope="module")
def longs(colocated):
    return colocated["long"]


def exact(nf: NetFaults, ref, i: int) -> bool:
    prompts, outputs = ref
    got = nf.call(prompts[i], OUTPUT_TOKENS).result(60)
    assert got.err is None and got.out == outputs[i], f"prompt {i}: {got.err or got.out} != colocated {outputs[i]}"
    return True


def no_leaks(nf: NetFaults, since: float, nodes: tuple[str, ...] = ("decode-0", "prefill-0", "prefill-1")) -> float:
    """Within 2 s every server in `nodes` holds no request and no page beyond its radix cache."""
    leaked = {n: nf.released(n, since)[1] for n in nodes}
    assert not any(leaked.values()), f"pages or requests still held 2 s after the fault: {leaked}"
    return sum(leaked.values())


def decoder_failed(nf: NetFaults, before: float, t0: float) -> float:
    """Seconds from `t0` (monotonic) until the decoder failed a request: its failure counter,
    read inside its host, says that it did; its own clock says when (the last-failure
    timestamp), so the scrapes' latency on a loaded machine is not counted against it."""
    wall0 = time.time() - (time.monotonic() - t0)
    wait_for("the decoder failing the request", lambda: nf.outcome("failed") > before, 10, 0.01)
    return nf.last_failure() - wall0


def late_writes(nf: NetFaults) -> float:
    """The decoder's count of writes that arrived for failed requests (read live, not from its
    stats file, which is rewritten at most 5 times a second)."""
    samples = nf.metrics("decode-0")
    assert ("sglang_disagg_late_writes", ("fate", "discarded")) in samples, "the decoder exports no late-write count"
    return value(samples, "sglang_disagg_late_writes", fate="discarded")


def no_late_writes_after_free(nf: NetFaults, before: int) -> None:
    """No write of a failed request landed after the decoder freed its pages (`before`: the
    decoder's late-write count when they were freed; read after the next request was served,
    seconds later). A partition only interrupts the prefill's data connection: once healed it
    delivers the writes queued in it, which would land in pages another request holds by then
    (seen once in CI: the next request's 32nd token differed from colocated; without the fix
    700 writes landed after the free, every run). So the prefill says how many writes it
    posted, and the decoder frees the pages once that many arrived."""
    after = late_writes(nf)
    assert after == before, f"{after - before} writes of a failed request landed after its pages were freed"


def messenger_log(nf: NetFaults, node: str, n: int = 12) -> str:
    """The last `n` messenger lines of a server's log, for an assertion message (a CI failure
    should say what the servers did, not just that pages were still held)."""
    lines = [ln for f in sorted((nf.dep.root / node).glob("*.log"))
             for ln in f.read_text(errors="replace").splitlines() if "messenger" in ln]
    return f"\n--- {node}:\n" + "\n".join(lines[-n:])


def gave_up(nf: NetFaults) -> str:
    """For a fault-matrix row: whether the decoder freed failed requests' pages because every
    write their prefill posted arrived, or because LATE_WRITES_S passed first (counted)."""
    n = nf.stats().get("late_writes_given_up", 0)
    return f"late writes given up on so far: {n}"


def settled(call, expected: list[int], since: float) -> tuple[str, int]:
    """A request the decoder failed: the client got the reason, or the router retried it (the
    decoder answers 503, which the router may retry) and the retry, a new request with new
    pages, was served exact or failed with its reason: a retry landing right behind the link's
    return may miss its deadline behind TCP's retransmission back-off (seen in CI: 749 of 751
    writes in time). (What the client saw, requests handed to decoding.)"""
    call.result(60)
    if call.err is not None:
        assert any(w in str(call.err) for w in ("lost", "silent", "before the deadline")), call.err
        return f"the client got the error ({str(call.err)[:60]})", 0
    assert call.out == expected, f"retried, but {call.out} != colocated {expected}"
    return f"the router's retry was served, exact, {call.done_at - since:.3f}s after", 1


def test_the_decode_link_cut_shorter_than_the_heartbeat_timeout_fails_nothing(nf, longs, reference):
    prompt, out = longs["long-0"]
    failed, carried = nf.outcome("failed"), nf.outcome("carried")
    call = nf.mid_transfer("prefill-0", prompt, LONG_OUTPUT)
    # TCP's retransmit timer backs off (>= 200 ms, doubling, raised by the queue behind the
    # 40 Mbit/s cap): the silence the peers see can be twice the cut or more. 0.45 x the timeout
    # failed a request once in CI (a 0.81 s cut seen as a lost peer); 0.3 x leaves room.
    down = 0.3 * HEARTBEAT_S
    nf.net.link(LAYOUT.decode, False)
    time.sleep(down)
    nf.net.link(LAYOUT.decode, True)
    t0 = time.monotonic()
    call.result(60)
    assert call.err is None and call.out == out, call.err or call.out
    assert nf.outcome("failed") == failed, f"the decoder failed a request: {nf.causes()}"
    assert nf.outcome("carried") == carried + 1
    assert {v["state"] for v in nf.links().values()} == {"ready"}
    leaked = no_leaks(nf, t0)
    row(f"N1 decode host's link cut {down:.2f} s mid-transfer (< heartbeat {HEARTBEAT_S} s)", None, leaked,
        exact(nf, reference, 2), f"the request succeeded, exact, {call.done_at - t0:.3f}s after the link came back")


def test_the_decode_link_cut_longer_fails_what_was_in_flight_and_the_links_come_back(nf, longs, reference):
    prompt, out = longs["long-1"]
    failed, carried = nf.outcome("failed"), nf.outcome("carried")
    call = nf.mid_transfer("prefill-0", prompt, LONG_OUTPUT)
    nf.net.link(LAYOUT.decode, False)
    t0 = time.monotonic()
    try:
        tte = decoder_failed(nf, failed, t0)  # the client is cut off too: the decoder's counter says when
        # The prefill hosts drop the order and free at once; the decoder must keep the request's
        # pages out of use while it is cut off, since writes queued on the way may still land.
        leaked = no_leaks(nf, t0, ("prefill-0", "prefill-1"))
        time.sleep(max(0.0, 2 * HEARTBEAT_S + 0.5 - (time.monotonic() - t0)))
    finally:
        nf.net.link(LAYOUT.decode, True)
    t1 = time.monotonic()
    back = nf.wait_links_ready()
    outcome, handed = settled(call, out, t1)  # a retry holds pages of its own until it is served
    freed, held = nf.released("decode-0", t1, timeout=DRAIN_S)  # its writes first come out of the healed link
    late = late_writes(nf)
    assert held == 0, (f"the decoder still holds {held} pages or requests {DRAIN_S} s after the request settled"
                       + messenger_log(nf, "decode-0"))
    assert tte < SILENT_PEER_DEADLINE_S, f"the decoder failed the request {tte:.3f} s after the cut"
    assert nf.outcome("carried") == carried + handed
    ok = exact(nf, reference, 3)
    no_late_writes_after_free(nf, late)
    row(f"N2 decode host's link cut {2 * HEARTBEAT_S + 0.5:.1f} s mid-transfer (> heartbeat)", tte, leaked + held,
        ok, f"failed by the decoder (peer silent); links ready {back:.3f}s after the link came "
        f"back; {outcome} it; the decoder held the failed request's pages until then, all free {freed:.3f}s after ({gave_up(nf)})")


def test_a_partition_between_a_prefill_host_and_the_decode_host(nf, longs, reference):
    prompt, out = longs["long-2"]
    failed, carried = nf.outcome("failed"), nf.outcome("carried")
    call = nf.mid_transfer("prefill-0", prompt, LONG_OUTPUT)
    shaping.partition(nf.net, LAYOUT.prefill[0], LAYOUT.decode)
    t0 = time.monotonic()
    try:
        tte = decoder_failed(nf, failed, t0)
        leaked = no_leaks(nf, t0, ("prefill-0",))  # the retry, if any, is on prefill-b: not a leak there
        outcome, handed = settled(call, out, t0)
        leaked += no_leaks(nf, t0, ("prefill-1",))
        # Meanwhile the other prefill host serves; both sides of the partition still answer the router's host.
        wait_for("prefill-a's link out of use", lambda: nf.link_state("prefill-0") != "ready", 5, 0.05)
        before = nf.writes("prefill-1")
        exact(nf, reference, 4)
        assert nf.writes("prefill-1") > before, "not served by the other prefill host"
    finally:
        shaping.partition(nf.net, LAYOUT.prefill[0], LAYOUT.decode, cut=False)
    t1 = time.monotonic()
    assert tte < SILENT_PEER_DEADLINE_S, f"{tte:.3f} s to the decoder's error"
    assert nf.outcome("carried") == carried + handed + 1
    back = nf.wait_links_ready()
    freed, held = nf.released("decode-0", t1, timeout=DRAIN_S)
    late = late_writes(nf)
    assert held == 0, (f"the decoder still holds {held} pages or requests {DRAIN_S} s after healing"
                       + messenger_log(nf, "decode-0") + messenger_log(nf, "prefill-0"))
    before = nf.writes("prefill-0")
    ok = exact(nf, reference, 5)
    assert nf.writes("prefill-0") > before, "the healed prefill host did not serve again"
    no_late_writes_after_free(nf, late)
    row("N3 partition prefill-a | decode (both reach the router)", tte, leaked + held, ok,
        f"failed by the decoder (peer silent); {outcome} the partition; prefill-b served meanwhile; links ready "
        f"{back:.3f}s after healing, all free {freed:.3f}s after ({gave_up(nf)}), then prefill-a served again")


def test_a_flapping_decode_link_under_short_requests(nf, reference):
    prompts, outputs = reference
    stop, results = threading.Event(), []

    def load() -> None:
        i = 0
        while not stop.is_set():
            k = 2 + i % 3
            c = nf.call(prompts[k], OUTPUT_TOKENS).result(60)
            results.append((k, c.err, c.out))
            if c.err is not None:
                print(f"flapping: request failed {c.done_at - t0:.2f}s after the first cut: {c.err}")
            i += 1
    t0 = time.monotonic()
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    for _ in range(5):
        nf.net.link(LAYOUT.decode, False)
        time.sleep(0.5)
        nf.net.link(LAYOUT.decode, True)
        time.sleep(0.5)
    stop.set()
    loader.join(60)
    assert not loader.is_alive(), "a request hung"
    wrong = [(k, err, out) for k, err, out in results if err is None and out != outputs[k]]
    failed = [str(err) for _, err, _ in results if err is not None]
    assert not wrong, f"served, but not exact: {wrong}"
    # Outages of 0.5 s are each shorter than the heartbeat timeout, but TCP's retransmit timer
    # on the data and busy control connections backs off past the up phases: a peer may be lost.
    unclear = [e for e in failed if not any(w in e for w in ("lost", "silent", "before the deadline"))]
    assert not unclear, f"failed without a clear reason: {unclear}"
    t1 = time.monotonic()
    leaked = no_leaks(nf, t1, ("prefill-0", "prefill-1"))
    nf.wait_links_ready()
    # A request failed by a lost peer keeps its pages on the decoder until every write its prefill
    # posted has arrived or LATE_WRITES_S has passed (N2's rule): seen in CI, 4 pages still held
    # 2 s after the last flap. Held past that is a leak.
    freed, held = nf.released("decode-0", t1, timeout=DRAIN_S)
    assert held == 0, (f"the decoder still holds {held} pages or requests {DRAIN_S} s after the flapping"
                       + messenger_log(nf, "decode-0"))
    leaked += held
    served = len(results) - len(failed)
    row("N4 decode host's link flapping (0.5 s down / 0.5 s up, 5 s)", None, leaked, exact(nf, reference, 5),
        f"{len(results)} short requests in {time.monotonic() - t0:.1f}s: {served} served exact, {len(failed)} failed "
        f"clearly{' (' + failed[0][:90] + ')' if failed else ''}; the decoder all free {freed:.3f}s after the last flap")


def test_the_link_slowed_to_10_mbit_mid_transfer(nf, longs, reference):
    slow, slow_out = longs["slow-0"]   # 700 tokens (2.9 MiB): ~0.6 s at 40 Mbit/s, ~2.3 s once slowed
    prompt, _ = longs["long-3"]        # 1500 tokens (5.9 MiB): ~4.8 s at 10 Mbit/s, plus its forward: past the deadline
    nf.wait_links_ready()  # starts from ready links whatever the previous row left behind
    try:
        call = nf.mid_transfer("prefill-0", slow, LONG_OUTPUT)
        shaping.cap(nf.net, LAYOUT.decode, 10)
        slowed_at = time.monotonic()
        call.result(60)
        assert call.err is None and call.out == slow_out, call.err or call.out  # slower, within its deadline
        slowed = call.done_at - slowed_at
        failed = nf.outcome("failed")
        t0 = time.monotonic()
        late = nf.mid_transfer("prefill-0", prompt, LONG_OUTPUT)
        tte = decoder_failed(nf, failed, t0)
        late.result(TRANSFER_TIMEOUT_S * 4)  # the router retries once (the retry passes its deadline too)
        assert late.err is not None and "before the deadline" in str(late.err), late.err or late.out
        assert tte < TRANSFER_TIMEOUT_S + FAULT_DEADLINE_S, f"{tte:.3f} s to the deadline's error"
        leaked = no_leaks(nf, late.done_at)
    finally:
        shaping.cap(nf.net, LAYOUT.decode, RATE_MBIT)
    row(f"N5 decode host's link slowed {RATE_MBIT} -> 10 Mbit/s mid-transfer", tte, leaked,
        exact(nf, reference, 6), f"a 700-token request slowed down and succeeded, exact ({slowed:.2f}s after the drop); "
        f"a 1500-token one failed at the {TRANSFER_TIMEOUT_S:.0f} s deadline, the client got "
        f"'{str(late.err)[-60:]}' after the router's one retry ({late.done_at - t0:.1f}s)")


def held(nf: NetFaults, node: str) -> float:
    return leaked_pages(nf.metrics(node))


def test_a_prefill_host_cut_off_fails_what_it_was_writing_which_the_router_retries_elsewhere(nf, longs, reference):
    """Last: a prefill host's cable cut while it writes one request and holds another. The
    decoder cannot tell a dead host from a cut one (its pages might still receive a stale
    write if the host lives): it fails both requests clearly (the router's retry, new
    requests with new pages, goes to the other prefill host), and keeps their pages out of
    use (quarantine) until the host answers. The cable comes back at the end: the host
    confirms, the pages are freed and it serves again."""
    # b is long too: still being written when c is routed (a medium b could land first, and
    # then c went to the idle prefill-b: seen once in CI).
    (a_prompt, a_out), (b_prompt, b_out), (c_prompt, c_out) = longs["long-4"], longs["long-5"], longs["medium-1"]
    failed, quarantined = nf.outcome("failed"), nf.stats().get("pages_quarantined", 0)
    a = nf.mid_transfer("prefill-0", a_prompt, LONG_OUTPUT)
    b = nf.mid_transfer("prefill-1", b_prompt, LONG_OUTPUT)  # the decoder routes to the least busy
    c = nf.call(c_prompt, LONG_OUTPUT)  # a tie: to prefill-a, behind a's writes on the same link
    wait_for("c ordered from prefill-a", lambda: nf.links()[nf.link_key("prefill-0")]["outstanding"] == 2, 10, 0.01)
    nf.net.link(LAYOUT.prefill[0], False)
    t0 = time.monotonic()
    try:
        tte = decoder_failed(nf, failed, t0)
        outcomes = [settled(a, a_out, t0)[0], settled(c, c_out, t0)[0]]
        assert b.result(60).out == b_out, b.err
        assert tte < SILENT_PEER_DEADLINE_S, f"{tte:.3f} s to the decoder's error"
        leaked = no_leaks(nf, t0, ("prefill-0", "prefill-1"))  # prefill-a freed its own, read from inside it
        pages = -(-len(a_prompt) // 16) + -(-len(c_prompt) // 16)
        wait_for("the failed requests' pages quarantined",
                 lambda: nf.stats().get("pages_quarantined", 0) - quarantined == pages, 15, 0.2)
        kept = held(nf, "decode-0")
        assert kept == pages, f"the decoder holds {kept} pages beyond its cache; the two failed requests had {pages}"
        assert exact(nf, reference, 7)  # served meanwhile, by prefill-b
    finally:
        nf.net.link(LAYOUT.prefill[0], True)
    t1 = time.monotonic()
    back = nf.wait_links_ready(30)
    freed, left = nf.released("decode-0", t1, timeout=back + DRAIN_S)
    late = late_writes(nf)
    assert left == 0, (f"{left} pages still held {back + DRAIN_S:.0f} s after prefill-a came back"
                       + messenger_log(nf, "decode-0") + messenger_log(nf, "prefill-0"))
    before = nf.writes("prefill-0")
    ok = exact(nf, reference, 8)
    assert nf.writes("prefill-0") > before, "prefill-a did not serve again"
    no_late_writes_after_free(nf, late)
    row("N6 prefill host's cable cut mid-transfer (a second prefill host configured)", tte, leaked, ok,
        f"both of its requests failed by the decoder (peer silent); {'; '.join(outcomes)} the cut; their {pages} "
        f"pages quarantined, not reused, until the host came back: freed {freed:.3f}s after ({gave_up(nf)}), then it served again")
