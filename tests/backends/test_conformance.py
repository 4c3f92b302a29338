"""One conformance suite for every backend (and libfabric provider), two real processes each."""

from __future__ import annotations

import hashlib
import json
import random
import time

import pytest
from transfer_harness import Pair, Proc, WorkerError, case_params, until
from transfer_worker import pattern

pytestmark = pytest.mark.backend


def _expected(pair: Pair, writes: list) -> list[str]:
    data = pattern(pair.seed, pair.size)
    return [hashlib.sha256(data[s:s + n]).hexdigest() for s, _, n in writes]


def _permuted_pages(page: int, n: int, rng: random.Random) -> list:
    src = rng.sample(range(n), n)
    dst = rng.sample(range(n), n)
    return [[s * page, d * page, page] for s, d in zip(src, dst)]


@pytest.mark.parametrize("page,n", [(4096, 1500), (65536, 64), (1 << 20, 12)], ids=["4K-x1500", "64K", "1M"])
def test_scattered_pages_byte_exact(pair: Pair, page: int, n: int) -> None:
    rng = random.Random(page)
    writes = _permuted_pages(page, n, rng)
    tag = 1000 + page % 977
    exp = pair.rx.call("expect", tag=tag, count=n, timeout=20.0, peer=pair.rx_peer, wait=False)["future"]
    pair.write(writes, imm=tag)
    got = pair.rx.call("failed_at", rpc_timeout=25, future=exp, timeout=20.0)
    assert got["type"] is None, got
    digests = pair.rx.call("digest", region=pair.dst, ranges=[[d, ln] for _, d, ln in writes])["sha"]
    assert digests == _expected(pair, writes)


def test_uniform_fast_path_byte_exact(pair: Pair) -> None:
    page, n = 65536, 100
    writes = _permuted_pages(page, n, random.Random(11))
    pair.tx.call("write_uniform", peer=pair.tx_peer, region=pair.src, remote=pair.remote, imm=55, length=page,
                 src_offsets=[w[0] for w in writes], dst_offsets=[w[1] for w in writes])
    pair.rx.call("expect", rpc_timeout=25, tag=55, count=n, timeout=20.0)
    digests = pair.rx.call("digest", region=pair.dst, ranges=[[d, ln] for _, d, ln in writes])["sha"]
    assert digests == _expected(pair, writes)


@pytest.mark.parametrize("src,dst,length", [([0, 4096], [0, 16 << 20], 4096), ([0, -4096], [0, 4096], 4096),
                                            ([0], [0, 4096], 4096), ([0], [0], 0), ([0.0], [0], 4096)],
                         ids=["dst-oob", "negative", "ragged", "zero-length", "float"])
def test_uniform_fast_path_rejects_bad_offsets(pair: Pair, src: list, dst: list, length: int) -> None:
    before = pair.tx.call("stats")
    err = pair.tx.error("write_uniform", peer=pair.tx_peer, region=pair.src, remote=pair.remote, imm=4243,
                        length=length, src_offsets=src, dst_offsets=dst)
    assert err.type == "DescriptorError", err
    assert pair.tx.call("stats") == before
    assert pair.rx.call("arrived", tag=4243)["count"] == 0


def test_tags_interleaved(pair: Pair) -> None:
    page, tags, per = 16384, [7, 8, 9], 4
    rng = random.Random(5)
    slots = rng.sample(range(pair.size // page), len(tags) * per * 2 * 2)
    futures, plan = {}, {t: [] for t in tags}
    for t in tags[:2]:  # expectations before the writes ...
        futures[t] = pair.rx.call("expect", tag=t, count=2 * per, timeout=20.0, wait=False)["future"]
    for rnd in range(2):
        for t in tags:
            ws = [[slots.pop() * page, slots.pop() * page, page] for _ in range(per)]
            plan[t] += ws
            pair.write(ws, imm=t, wait=None)
    for t in tags[:2]:
        got = pair.rx.call("failed_at", rpc_timeout=25, future=futures[t], timeout=20.0)
        assert got["type"] is None, (t, got)
    # ... and after: arrivals are credited, so this one fires as soon as all have landed.
    pair.rx.call("expect", rpc_timeout=25, tag=tags[2], count=2 * per, timeout=20.0)
    assert pair.rx.call("arrived", tag=tags[2])["count"] == 0
    for t in tags:
        digests = pair.rx.call("digest", region=pair.dst, ranges=[[d, n] for _, d, n in plan[t]])["sha"]
        assert digests == _expected(pair, plan[t]), t


def test_deadline_expires(pair: Pair) -> None:
    pair.write([[0, 0, 4096], [4096, 4096, 4096]], imm=77)
    t0 = time.monotonic()
    err = pair.rx.error("expect", rpc_timeout=10, tag=77, count=5, timeout=0.3)
    assert err.type == "DeadlineExceeded" and "2 of 5" in err.msg, err
    assert 0.25 <= time.monotonic() - t0 < 3.0
    assert pair.rx.call("stats")["expectations"] == 0


def test_control_messages(pair: Pair) -> None:
    pair.tx.call("send", peer=pair.tx_peer, data="ping")
    assert pair.rx.call("recv", timeout=5.0) == {"peer": pair.rx_peer, "data": "ping"}
    pair.rx.call("send", peer=pair.rx_peer, data=json.dumps({"k": 1}))
    assert json.loads(pair.tx.call("recv", timeout=5.0)["data"]) == {"k": 1}


BAD_DESCRIPTORS = {
    "not-json": "{oops",
    "not-object": "[1, 2]",
    "missing-field": lambda d: {k: v for k, v in d.items() if k != "key"},
    "extra-field": lambda d: {**d, "surprise": 1},
    "wrong-version": lambda d: {**d, "version": 99},
    "wrong-backend": lambda d: {**d, "backend": "other"},
    "wrong-owner": lambda d: {**d, "owner": "0" * 32},
    "negative-length": lambda d: {**d, "length": -1},
    "zero-length": lambda d: {**d, "length": 0},
    "overflowing-range": lambda d: {**d, "base": 2**64 - 10, "length": 100},
    "string-key": lambda d: {**d, "key": "7"},
}


@pytest.mark.parametrize("name", list(BAD_DESCRIPTORS))
def test_malformed_descriptor_rejected(pair: Pair, name: str) -> None:
    bad = BAD_DESCRIPTORS[name]
    raw = bad if isinstance(bad, str) else json.dumps(bad(json.loads(pair.dst_desc)))
    err = pair.tx.error("add_remote", peer=pair.tx_peer, desc=raw)
    assert err.type == "DescriptorError", err


@pytest.mark.parametrize("write,imm", [
    ([0, 16 << 20, 1], None),              # destination past the end
    ([(16 << 20) - 4096, 0, 8192], None),  # source past the end
    ([0, 0, 0], None),                     # empty write
    ([-1, 0, 4096], None),                 # negative offset
    ([0, 0, 4096], 2**32),              # immediate wider than 32 bits
], ids=["dst-oob", "src-oob", "zero-length", "negative", "imm-range"])
def test_out_of_bounds_rejected_before_posting(pair: Pair, write: list, imm: int | None) -> None:
    tag = 4242
    before = pair.tx.call("stats")
    err = pair.tx.error("write", peer=pair.tx_peer, region=pair.src, remote=pair.remote,
                        writes=[[0, 0, 4096], write], imm=tag if imm is None else imm)
    assert err.type == "DescriptorError", err
    assert pair.tx.call("stats") == before
    time.sleep(0.05)
    assert pair.rx.call("arrived", tag=tag)["count"] == 0  # the valid first write was not posted either


@pytest.fixture(params=case_params())
def fresh(request, procs):
    p = Pair(*request.param)
    procs.extend([p.tx, p.rx])
    return p


def _reuse_with_new_peer(survivor: Proc, is_writer: bool, fresh: Pair, procs: list) -> None:
    """The survivor must work with a brand-new peer after the loss."""
    other = Proc(fresh.backend, fresh.provider)
    procs.append(other)
    if is_writer:
        peer = survivor.call("connect", address=other.address)["peer"]
        other.call("accept")
        dst = other.call("alloc", size=1 << 20)
        remote = survivor.call("add_remote", peer=peer, desc=dst["desc"])["remote"]
        survivor.call("write", peer=peer, region=fresh.src, remote=remote, writes=[[0, 0, 65536]], imm=5)
        other.call("expect", tag=5, count=1, timeout=10.0)
        assert other.call("digest", region=dst["region"], ranges=[[0, 65536]])["sha"] == \
            [hashlib.sha256(pattern(fresh.seed, fresh.size)[:65536]).hexdigest()]
    else:
        peer = other.call("connect", address=survivor.address)["peer"]
        survivor.call("accept")
        src = other.call("alloc", size=1 << 20, seed=3)["region"]
        remote = other.call("add_remote", peer=peer, desc=fresh.dst_desc)["remote"]
        other.call("write", peer=peer, region=src, remote=remote, writes=[[0, 0, 65536]], imm=6)
        survivor.call("expect", tag=6, count=1, timeout=10.0)
        assert survivor.call("digest", region=fresh.dst, ranges=[[0, 65536]])["sha"] == \
            [hashlib.sha256(pattern(3, 1 << 20)[:65536]).hexdigest()]


def _clean(proc: Proc) -> None:
    """Nothing of the lost peer remains: no peer, batch, expectation, native transfer."""
    end = time.monotonic() + 1.0
    while True:
        stats = proc.call("stats")
        native = stats.get("native_batches", 0) + stats.get("native_zombies", 0)
        python = stats["peers"] + stats["batches"] + stats["expectations"]
        # the first error may come from the library, the control channel's EOF just after
        if (python == 0 and native == 0) or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert {k: stats[k] for k in ("peers", "batches", "expectations")} == {"peers": 0, "batches": 0, "expectations": 0}, stats
    assert native == 0, stats


def test_receiver_killed_mid_transfer(fresh: Pair, procs: list) -> None:
    writes = [[i * (1 << 20), i * (1 << 20), 1 << 20] for i in range(8)]
    fresh.tx.call("stream", peer=fresh.tx_peer, region=fresh.src, remote=fresh.remote, writes=writes, imm=9)
    time.sleep(0.3)
    t_kill = time.time()
    fresh.rx.kill()
    got = fresh.tx.call("stream_result", rpc_timeout=10, timeout=5.0)
    if got["type"] is None:
        where = fresh.tx.call("stacks")["stacks"]
        raise AssertionError(f"the sender's writes went on after the receiver was killed: stats "
                             f"{fresh.tx.call('stats')}; threads {where}; log {fresh.tx.tail()}")
    assert got["type"] in ("PeerLostError", "TransferError"), got
    assert got["t"] - t_kill < 2.0, got
    _clean(fresh.tx)
    _reuse_with_new_peer(fresh.tx, True, fresh, procs)


def test_sender_killed_mid_transfer(fresh: Pair, procs: list) -> None:
    writes = [[i * (1 << 20), i * (1 << 20), 1 << 20] for i in range(8)]
    exp = fresh.rx.call("expect", tag=9, count=10**9, peer=fresh.rx_peer, wait=False, timeout=60.0)["future"]
    fresh.tx.call("stream", peer=fresh.tx_peer, region=fresh.src, remote=fresh.remote, writes=writes, imm=9)
    time.sleep(0.3)
    t_kill = time.time()
    fresh.tx.kill()
    got = fresh.rx.call("failed_at", rpc_timeout=10, future=exp, timeout=5.0)
    assert got["type"] == "PeerLostError", got
    assert got["t"] - t_kill < 2.0, got
    _clean(fresh.rx)
    _reuse_with_new_peer(fresh.rx, False, fresh, procs)


def test_the_other_direction_lost(fresh: Pair) -> None:
    """Each side dialed the other (the messenger's decoder dials the prefill's control port,
    the prefill dials the decoder for data): one connection's loss must not take the native
    state both share (an address-vector entry, a remote agent). Writes already in flight on
    the other connection complete, and later ones land."""
    fresh.rx.call("connect", address=fresh.tx.address, name="back")
    fresh.tx.call("accept", name="back")
    writes = [[i * (1 << 20), i * (1 << 20), 1 << 20] for i in range(8)]
    fresh.tx.call("stream", peer=fresh.tx_peer, region=fresh.src, remote=fresh.remote, writes=writes, imm=9)
    time.sleep(0.2)
    fresh.rx.call("close_peer", peer="back")
    assert until(lambda: fresh.tx.call("stats")["peers"] == 1), fresh.tx.call("stats")
    got = fresh.tx.call("stream_result", rpc_timeout=10, timeout=1.5)
    assert got["type"] is None, f"the data connection's writes failed after the other one closed: {got}"
    fut = fresh.rx.call("expect", tag=12, count=1, wait=False, timeout=10.0)["future"]
    fresh.tx.call("write", peer=fresh.tx_peer, region=fresh.src, remote=fresh.remote,
                  writes=[[0, 15 << 20, 65536]], imm=12)
    fresh.rx.call("wait", future=fut, timeout=10.0)
    assert fresh.rx.call("digest", region=fresh.dst, ranges=[[15 << 20, 65536]])["sha"] == \
        [hashlib.sha256(pattern(fresh.seed, fresh.size)[:65536]).hexdigest()]


def test_close_releases_everything(pair: Pair) -> None:
    p = Proc(pair.backend, pair.provider)
    try:
        other = p.call("connect", address=pair.rx.address)["peer"]
        pair.rx.call("accept")
        p.call("alloc", size=1 << 20)
        p.call("expect", tag=31337, count=1, wait=False, timeout=60.0)
        threads = p.call("close")["threads"]
        assert not [t for t in threads if t.startswith(("control", "libfabric", "nixl", "mooncake", "shmem"))], threads
        assert other
        time.sleep(0.2)
        assert pair.rx.call("stats")["peers"] == 1  # only the pair's own peer remains
    finally:
        p.stop()


# ----- faults: tag reuse, deregistration and close under load, stalled peers, batch deadlines -----

from fault_harness import FaultPair, FaultProc  # noqa: E402 - grouped with the tests that use it


@pytest.fixture(params=case_params())
def faulty(request, procs):
    p = FaultPair(*request.param, options={"batch_timeout_s": 3.0})
    procs.extend([p.tx, p.rx])
    return p


def test_tag_reuse_after_failed_request(pair: Pair) -> None:
    """Writes of a request whose expectation failed never count toward anything later:
    neither toward the same tag (it is retired: expecting it again is refused) nor another."""
    tag, page = 6100, 4096
    pair.write([[0, 0, page]], imm=tag)                     # one write lands before the failure
    err = pair.rx.error("expect", rpc_timeout=10, tag=tag, count=3, timeout=0.3)
    assert err.type == "DeadlineExceeded" and "1 of 3" in err.msg, err
    dropped = pair.rx.call("stats")["late_writes_dropped"]
    pair.write([[page, page, page], [2 * page, 2 * page, page]], imm=tag)   # the late rest of it
    assert until(lambda: pair.rx.call("stats")["late_writes_dropped"] >= dropped + 2), pair.rx.call("stats")
    assert pair.rx.call("arrived", tag=tag)["count"] == 0
    err = pair.rx.error("expect", tag=tag, count=2, timeout=1.0)     # a later request with the same tag
    assert err.type == "DescriptorError" and "retired" in err.msg, err
    # the late writes were not credited to a different tag either
    pair.write([[3 * page, 3 * page, page], [4 * page, 4 * page, page]], imm=tag + 1)
    pair.rx.call("expect", rpc_timeout=25, tag=tag + 1, count=2, timeout=20.0)
    assert pair.rx.call("arrived", tag=tag + 1)["count"] == 0
    assert pair.rx.call("stats")["expectations"] == 0


def test_deregister_while_writes_in_flight(faulty: FaultPair) -> None:
    """Deregistering a source (writer) or destination (receiver) region under a stream of
    writes gives completions or a clean TransferError, never a crash; both sides stay usable."""
    p = faulty
    writes = [[i * (1 << 20), i * (1 << 20), 1 << 20] for i in range(8)]
    src2 = p.tx.call("alloc", size=8 << 20, seed=7)["region"]
    p.tx.call("writer_start", peer=p.tx_peer, region=src2, remote=p.remote, writes=writes, imm=81)
    until(lambda: p.tx.call("writer_done")["done"] >= 1, timeout=10.0)
    p.tx.call("dealloc", region=src2)
    got = p.tx.call("writer_stop", rpc_timeout=40)
    assert not got["alive"], got
    # after the deregistration the next write is refused before posting (DescriptorError);
    # one already being posted may fail in the library (TransferError)
    assert got["error"] is None or got["error"]["type"] in ("DescriptorError", "TransferError"), got
    err = p.tx.error("write", peer=p.tx_peer, region=src2, remote=p.remote, writes=[[0, 0, 4096]], imm=82)
    assert err.type == "DescriptorError", err

    dst2 = p.rx.call("alloc", size=8 << 20)
    remote2 = p.tx.call("add_remote", peer=p.tx_peer, desc=dst2["desc"])["remote"]
    p.tx.call("writer_start", peer=p.tx_peer, region=p.src, remote=remote2, writes=writes, imm=83)
    until(lambda: p.tx.call("writer_done")["done"] >= 1, timeout=10.0)
    p.rx.call("dealloc", region=dst2["region"])
    time.sleep(0.2)
    got = p.tx.call("writer_stop", rpc_timeout=40)
    assert not got["alive"], got
    # DeadlineExceeded: a write into a closed region that the transport never answers (the
    # receiver's CQ gets the error); the batch deadline turns that into a clean failure.
    assert got["error"] is None or got["error"]["type"] in ("TransferError", "PeerLostError", "DeadlineExceeded"), got
    p.rx.call("ping")
    print("receiver after its region went:", p.rx.call("stats"), "writer:", got)

    # both processes alive, nothing left behind, and the original regions still work
    p.tx.call("ping")
    p.rx.call("ping")
    assert until(lambda: p.tx.call("stats")["batches"] == 0), p.tx.call("stats")
    if got["error"] is None or got["error"]["type"] != "PeerLostError":
        try:
            p.write([[0, 0, 65536]], imm=84)
        except WorkerError as e:
            # Mooncake resets its connection after a failed transfer: the next one fails too
            # and the one after reconnects (transports.md: "next write -1 after 1 s")
            assert got["error"] and e.type == "TransferError", e
            time.sleep(1.2)
            p.write([[0, 0, 65536]], imm=84)
        p.rx.call("expect", tag=84, count=1, timeout=10.0)
        assert p.rx.call("digest", region=p.dst, ranges=[[0, 65536]])["sha"] == _expected(p, [[0, 0, 65536]])


def test_close_while_callbacks_run(faulty: FaultPair) -> None:
    """close() while completion callbacks block the progress threads, with a batch in flight:
    close returns, pending futures fail with TransferError, nothing crashes, threads end."""
    p = faulty
    exp = p.rx.call("expect_cb", tag=91, count=1, timeout=30.0, block_s=2.5)["future"]
    p.tx.call("write_cb", peer=p.tx_peer, region=p.src, remote=p.remote, writes=[[0, 0, 65536]], imm=91,
              block_s=2.5)
    assert until(lambda: p.tx.call("cb_state")["started"] == 1 and p.rx.call("cb_state")["started"] == 1), \
        (p.tx.call("cb_state"), p.rx.call("cb_state"))
    # one more batch behind the blocked callback, and an expectation that cannot be met
    late = p.tx.call("write", peer=p.tx_peer, region=p.src, remote=p.remote, writes=[[65536, 65536, 65536]],
                     imm=92, wait=None)["future"]
    pending = p.rx.call("expect", tag=93, count=1, timeout=30.0, wait=False)["future"]
    t0 = time.monotonic()
    p.tx.call("close", rpc_timeout=15)
    p.rx.call("close", rpc_timeout=15)
    assert time.monotonic() - t0 < 12.0
    got = p.tx.call("failed_at", future=late, timeout=5.0)
    assert got["type"] in (None, "TransferError", "PeerLostError"), got
    got = p.rx.call("failed_at", future=pending, timeout=5.0)
    assert got["type"] in ("TransferError", "PeerLostError"), got  # the writer's close may come first
    assert p.rx.call("failed_at", future=exp, timeout=1.0)["type"] is None
    err = p.tx.error("write", peer=p.tx_peer, region=p.src, remote=p.remote, writes=[[0, 0, 4096]], imm=94)
    assert err.type in ("TransferError", "PeerLostError"), err
    for proc in (p.tx, p.rx):
        assert until(lambda proc=proc: proc.call("cb_state")["finished"] == 1, timeout=6.0), proc.call("cb_state")
        assert proc.call("cb_state")["errors"] == []
        left = until(lambda proc=proc: not [t for t in proc.call("threads")["threads"]
                                             if t.startswith(("libfabric", "nixl", "mooncake", "shmem"))], timeout=5.0)
        assert left, proc.call("threads")


def test_close_from_a_callback(faulty: FaultPair) -> None:
    """A completion callback that closes its own backend (on the progress thread) neither
    deadlocks nor crashes, and the backend ends closed."""
    p = faulty
    p.tx.call("write_cb", peer=p.tx_peer, region=p.src, remote=p.remote, writes=[[0, 0, 65536]], imm=95, close=True)
    p.rx.call("expect_cb", tag=95, count=1, timeout=20.0, close=True)
    for proc in (p.tx, p.rx):
        assert until(lambda proc=proc: proc.call("cb_state")["finished"] == 1, timeout=10.0), proc.call("cb_state")
        assert proc.call("cb_state")["errors"] == [], proc.call("cb_state")
        err = proc.error("expect", tag=96, count=1, timeout=1.0)
        assert err.type == "TransferError" and "closed" in err.msg, err
        left = until(lambda proc=proc: not [t for t in proc.call("threads")["threads"]
                                             if t.startswith(("libfabric", "nixl", "mooncake", "shmem"))], timeout=5.0)
        assert left, proc.call("threads")


@pytest.mark.parametrize("case", case_params())
def test_stalled_peer_isolated_and_batch_deadline(case, procs: list) -> None:
    """A receiver that stops (SIGSTOP: a decoder that no longer reads) delays no write to
    another peer; the batch to it fails with DeadlineExceeded at the batch deadline (or
    completes, where the transport needs nothing from the receiver) and leaves no bookkeeping."""
    backend, provider = case
    opts = {"batch_timeout_s": 2.0, "peer_timeout_s": 60.0}  # the batch deadline, not the heartbeat
    tx = FaultProc(backend, provider, opts)
    procs.append(tx)
    rx = []
    for _ in range(2):
        r = FaultProc(backend, provider, opts)
        procs.append(r)
        peer = tx.call("connect", address=r.address)["peer"]
        r.call("accept")
        remote = tx.call("add_remote", peer=peer, desc=r.call("alloc", size=16 << 20)["desc"])["remote"]
        rx.append((r, peer, remote))
    src = tx.call("alloc", size=16 << 20, seed=5)["region"]
    for r, peer, remote in rx:  # connections up (tcp;ofi_rxm connects on first write, needing the peer)
        tx.call("write", peer=peer, region=src, remote=remote, imm=100, writes=[[0, 0, 4096]], wait=10.0)
    (slow, slow_peer, slow_remote), (fast, fast_peer, fast_remote) = rx
    slow.pause()
    try:
        big = tx.call("write", rpc_timeout=20, peer=slow_peer, region=src, remote=slow_remote, imm=101, wait=None,
                      writes=[[i << 22, i << 22, 1 << 22] for i in range(4)])["future"]
    except WorkerError as e:  # posting itself may give up on a peer that takes nothing (queue full)
        assert e.type == "TransferError" and "timed out" in e.msg, e
        big = None
    time.sleep(0.2)
    t0 = time.monotonic()
    tx.call("write", rpc_timeout=10, peer=fast_peer, region=src, remote=fast_remote, imm=102,
            writes=[[0, 0, 65536]], wait=1.5)
    fast.call("expect", tag=102, count=1, timeout=5.0)
    assert time.monotonic() - t0 < 1.5, "a write to a healthy peer waited for the stalled one"
    if big is not None:
        got = tx.call("failed_at", rpc_timeout=15, future=big, timeout=8.0)
        assert got["type"] in (None, "DeadlineExceeded"), got
    assert until(lambda: tx.call("stats")["batches"] == 0), tx.call("stats")
    slow.resume()
    tx.call("ping")


@pytest.mark.parametrize("case", case_params())
def test_a_stopped_peer_is_lost_by_its_silence(case, procs: list) -> None:
    """A peer that stops (SIGSTOP: TCP still answers for it, nothing else does) sends no
    heartbeat: it is lost within peer_timeout_s, failing what waits on it; an idle but live
    peer is never lost (its heartbeats keep it)."""
    backend, provider = case
    opts = {"peer_timeout_s": 1.0}
    a, b = FaultProc(backend, provider, opts), FaultProc(backend, provider, opts)
    procs += [a, b]
    peer = a.call("connect", address=b.address)["peer"]
    b.call("accept")
    time.sleep(3.0)  # three timeouts of idleness
    assert a.call("stats")["peers"] == 1 and b.call("stats")["peers"] == 1
    exp = a.call("expect", tag=7, count=1, peer=peer, wait=False, timeout=60.0)["future"]
    b.pause()
    t0 = time.time()
    try:
        got = a.call("failed_at", rpc_timeout=15, future=exp, timeout=10.0)
    finally:
        b.resume()
    assert got["type"] == "PeerLostError" and "silent" in got["msg"], got
    assert got["t"] - t0 < 2.0, got
    assert until(lambda: a.call("stats")["peers"] == 0), a.call("stats")


def _fresh_or_known_open(request, procs) -> Pair:
    """`fresh`, with libfabric's known gap stated as a strict expected failure (never a skip)."""
    backend, provider = request.param
    if backend == "libfabric":
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=(
            "known open: a libfabric completion names no sender (no FI_SOURCE on a remote write's "
            "CQ data), so its writes count for whoever was asked (docs/security.md)")))
    p = Pair(backend, provider)
    procs.extend([p.tx, p.rx])
    return p


@pytest.fixture(params=case_params())
def three(request, procs):
    return _fresh_or_known_open(request, procs)


def test_writes_from_a_peer_that_was_not_asked_count_for_nothing(three: Pair, procs: list) -> None:
    """Another peer holding the secret writes with the tag the receiver expects of `tx`: its real
    writes land (a peer with the keys can write KV), but they credit nothing (counted as
    foreign_credits_dropped); `tx`'s own writes then complete the expectation byte-exact."""
    pair, tag, page, n = three, 7300, 4096, 4
    other = Proc(pair.backend, pair.provider)
    procs.append(other)
    o_peer = other.call("connect", address=pair.rx.address)["peer"]
    pair.rx.call("accept")
    o_src = other.call("alloc", size=n * page, seed=99)["region"]
    o_remote = other.call("add_remote", peer=o_peer, desc=pair.dst_desc)["remote"]
    fut = pair.rx.call("expect", tag=tag, count=n, timeout=20.0, peer=pair.rx_peer, wait=False)["future"]
    writes = [[i * page, i * page, page] for i in range(n)]
    other.call("write", rpc_timeout=25, peer=o_peer, region=o_src, remote=o_remote, writes=writes, imm=tag, wait=20.0)
    assert until(lambda: pair.rx.call("stats")["foreign_credits_dropped"] >= n, 10.0), pair.rx.call("stats")
    assert pair.rx.call("arrived", tag=tag)["count"] == 0, "another peer's writes were credited"
    pair.write(writes, imm=tag)
    assert pair.rx.call("failed_at", rpc_timeout=25, future=fut, timeout=20.0)["type"] is None
    digests = pair.rx.call("digest", region=pair.dst, ranges=[[d, ln] for _, d, ln in writes])["sha"]
    assert digests == _expected(pair, writes)
    # Before its expectation too: the other peer's early writes are not claimed by it.
    early = tag + 1
    other.call("write", rpc_timeout=25, peer=o_peer, region=o_src, remote=o_remote, writes=writes, imm=early, wait=20.0)
    assert until(lambda: pair.rx.call("arrived", tag=early)["count"] == n, 10.0)
    err = pair.rx.error("expect", rpc_timeout=10, tag=early, count=n, timeout=0.5, peer=pair.rx_peer)
    assert err.type == "DeadlineExceeded" and f"0 of {n}" in err.msg, err
