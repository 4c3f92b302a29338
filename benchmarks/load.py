"""Bounded load test through the real router (smg) in front of the launcher's default stack
(`--role all`: messenger mode, shmem), with an abort storm, then the checks a
production roll-out would want before trusting it:

    python benchmarks/load.py --out DIR [--quick] [--requests N --concurrency C]

Closed loop: C clients each send their next request as soon as the previous one ends,
N requests in all, streamed from SGLang's native /generate (greedy, ignore_eos, float32).
The mix: short chats sharing a system prompt (the decoder reuses its cached pages), ~10 %
long prompts spanning several prefill chunks, and a tenth of the clients going away:
their connection is closed after 0-4 streamed tokens (0: before the first token, while
the prompt is still being prefilled and its pages written).

Checks (exit status 1 with the reason when one fails):
- errors: every request whose client stayed got all its tokens, with no error;
- outputs: a sample of the completed requests is replayed, one at a time, on a colocated
  SGLang server started afterwards on the same port: same tokens, token by token;
- pages: the KV pages held outside the radix cache (allocated - cached, both servers, from
  the messengers' Prometheus gauges) go back to their idle value, nothing stays locked,
  queued or in flight;
- threads and fds of every process of the stack (servers with their scheduler and
  detokenizer children, and the router) are back to their idle counts once settled.
Writes DIR/load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import http.client
import os
import random
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sglang_disagg.launch import LaunchConfig, Role, Stack
from sglang_disagg.launch.client import generate_ids
from sglang_disagg.launch.preflight import PreflightError, check_ports_free

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from load_checks import settle, summarize, write_report  # noqa: E402
from load_client import Result, stream_generate  # noqa: E402

CHUNK = 128  # chunked-prefill size: long prompts span 3-7 chunks
EXTRA_ARGS = ("--chunked-prefill-size", str(CHUNK), "--dtype", "float32")
SYSTEM = [1] + [100 + (7 * i) % 900 for i in range(47)]  # 3 pages every chat shares


@dataclass(frozen=True)
class Job:
    index: int
    kind: str                   # chat | long
    prompt: tuple[int, ...]
    max_new_tokens: int
    abort_after: int | None     # None: the client stays to the end
    abort_delay_s: float = 0.0  # abort_after 0: how long after the response headers
    direct: bool = False        # sent to the decoder itself, not through the router


def plan(n: int, seed: int, abort_fraction: float, vocab: int = 4000) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        long = rng.random() < 0.1
        if long:
            prompt = [1] + [rng.randrange(10, vocab) for _ in range(rng.randrange(2 * CHUNK + 40, 7 * CHUNK))]
            out = rng.randrange(8, 33)
        else:
            prompt = SYSTEM + [rng.randrange(10, vocab) for _ in range(rng.randrange(8, 160))]
            out = rng.randrange(16, 65)
        abort = rng.randrange(0, 5) if rng.random() < abort_fraction else None
        if abort is not None:
            out = 256  # still streaming when the client leaves
        # The router notices a client has gone only when it forwards the next chunk, so
        # through it a client that leaves before its first token aborts at that token: these
        # go to the decoder directly, to land while pages are allocated, routed or written.
        delay = rng.uniform(0.0, 0.6) if abort == 0 else 0.0
        jobs.append(Job(i, "long" if long else "chat", tuple(prompt), out, abort, delay, abort == 0))
    return jobs


def body(job: Job) -> dict:
    return {"input_ids": list(job.prompt),
            "sampling_params": {"max_new_tokens": job.max_new_tokens, "temperature": 0.0, "ignore_eos": True}}


async def drive(url: str, direct_url: str, jobs: list[Job], concurrency: int, on_done,
                timeout_s: float = 300.0) -> tuple[list[Result], float]:
    import aiohttp

    queue: asyncio.Queue[Job] = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    results: list[Result | None] = [None] * len(jobs)
    # A request that hangs becomes an error instead of hanging the run.
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # One connection per client, none reused after a deliberate close.
    conn = aiohttp.TCPConnector(limit=concurrency + 4)

    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        t0 = last_done = time.perf_counter()

        async def client() -> None:
            nonlocal last_done
            while not queue.empty():
                if time.perf_counter() - last_done > timeout_s:
                    break  # nothing completes any more: a stalled stack would take every request's timeout
                job = queue.get_nowait()
                res = await stream_generate(session, direct_url if job.direct else url, body(job), t0, job.kind,
                                            job.abort_after, job.abort_delay_s)
                results[job.index] = res
                last_done = time.perf_counter() if not res.error else last_done
                on_done(res)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        for j in jobs:
            if results[j.index] is None:
                results[j.index] = Result(j.kind, wall, error=f"not sent: no request completed for {timeout_s:.0f}s")
        return results, wall


def sample_jobs(jobs: list[Job], k: int) -> list[int]:
    """Requests to replay on the colocated server, chosen from the plan (their clients stay):
    up to a quarter long prompts, the rest chats."""
    stay = [j for j in jobs if j.abort_after is None]
    longs = [j.index for j in stay if j.kind == "long"][: k // 4]
    chats = [j.index for j in stay if j.kind == "chat"]
    return sorted(longs + random.Random(7).sample(chats, min(len(chats), k - len(longs))))


def reference_outputs(cfg: LaunchConfig, jobs: list[Job], say) -> dict[int, list[int]]:
    """Greedy outputs of a colocated server, one request at a time, then the server stops."""
    ref = start(cfg, say)
    try:
        return {j.index: generate_ids(ref.url, list(j.prompt), j.max_new_tokens) for j in jobs}
    finally:
        ref.stop()


def wait_ports_free(cfg: LaunchConfig, timeout_s: float = 120.0) -> None:
    """A port a stack just closed, or one a probe connected to itself on, stays in TIME_WAIT
    for a minute, and the launcher's port check counts that as in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check_ports_free(cfg)
        except PreflightError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def start(cfg: LaunchConfig, say, attempts: int = 3) -> Stack:
    for attempt in range(1, attempts + 1):
        wait_ports_free(cfg)
        stack = Stack.for_config(cfg)
        t0 = time.monotonic()
        try:
            stack.start(progress=lambda m: say(f"  {m}"))
        except http.client.HTTPException as e:
            # Our ports lie in Linux's ephemeral range: a health probe to a port nobody listens
            # on yet can connect to itself and read its own request back (BadStatusLine), which
            # the launcher's probe does not catch. The stack was stopped: start it again.
            if attempt == attempts:
                raise
            say(f"[load] start-up probe failed ({type(e).__name__}: {e}); starting again")
            continue
        say(f"{cfg.role.value} stack up on {stack.url} after {time.monotonic() - t0:.0f}s")
        return stack
    raise AssertionError("unreachable")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="200 requests at concurrency 16")
    ap.add_argument("--requests", type=int, default=None, help="default 1000 (--quick: 200)")
    ap.add_argument("--concurrency", type=int, default=None, help="default 32 (--quick: 16)")
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--sample", type=int, default=20, help="completed requests replayed on a colocated server")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--port", type=int, default=45000, help="the stack uses PORT..PORT+9, the colocated server PORT+10..")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of each server, in tokens")
    ap.add_argument("--request-timeout-s", type=float, default=300.0, help="a request still open then is an error")
    ap.add_argument("--settle-s", type=float, default=60.0, help="how long pages/threads/fds may take to settle")
    args = ap.parse_args(argv)
    # The machine's load average at the start is in the document: other work on the same cores.
    record = results_doc.Run.begin(argv, __file__)
    # Killed (timeout, CI): unwind through the finally blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    n = args.requests or (200 if args.quick else 1000)
    concurrency = args.concurrency or (16 if args.quick else 32)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-load-"))
    from tqdm import tqdm

    say = tqdm.write
    jobs = plan(n, args.seed, args.abort_fraction)
    common = dict(model=args.model, port=args.port, max_total_tokens=args.max_total_tokens, extra_args=EXTRA_ARGS)
    cfg = LaunchConfig(role=Role.ALL, log_dir=str(logs / "all"), **common)
    say(f"[load] {n} requests, concurrency {concurrency}, {sum(j.abort_after is not None for j in jobs)} "
        f"clients leave mid-stream; logs in {logs}")
    ref_cfg = dataclasses.replace(cfg, role=Role.COLOCATED, port=args.port + 10, log_dir=str(logs / "colocated"))
    picked = [jobs[i] for i in sample_jobs(jobs, args.sample)]
    stack = None
    # The colocated reference starts alongside the stack (start-up is most of a short run)
    # and is stopped before the load begins, so it never competes with it for the cores.
    with ThreadPoolExecutor(1) as pool:
        ref_future = pool.submit(reference_outputs, ref_cfg, picked, lambda m: say(f"[colocated] {m.strip()}"))
        try:
            stack = start(cfg, lambda m: say(f"[all] {m.strip()}"))
            reference = ref_future.result()
            # Warm-up: the first requests of each kind (a reused prefix, several chunks, an
            # abort) create what a server keeps for its lifetime (threads, connections,
            # caches); only growth after that is a leak.
            decoder = next(p.url for p in stack.servers if p.spec.name == "decode")
            asyncio.run(drive(stack.url, decoder, plan(24, args.seed + 1, 0.25), 8, lambda r: None))
            before = settle(stack, None, args.settle_s, say)
            say(f"[load] idle before: {before.brief()}")
            bar = tqdm(total=n, unit="req", desc="load")
            results, wall = asyncio.run(drive(stack.url, decoder, jobs, concurrency, lambda r: bar.update(1),
                                              args.request_timeout_s))
            bar.close()
            say(f"[load] {n} requests in {wall:.1f}s; settling")
            after = settle(stack, before, args.settle_s, say)
            say(f"[load] idle after: {after.brief()}")
            messenger = {"decode": stack.messenger_stats("decode"), "prefill": stack.messenger_stats("prefill")}
        finally:
            if stack is not None:
                stack.stop()

    doc, failures = summarize(jobs, results, wall, concurrency, reference, before, after)
    doc.update({"logs": str(logs),
                "config": {"stack": "--role all (messenger, shmem)", "model": args.model,
                           "max_total_tokens": args.max_total_tokens, "extra_args": list(EXTRA_ARGS), "seed": args.seed,
                           "abort_fraction": args.abort_fraction},
                "messenger_counters": {k: {x: y for x, y in (v or {}).items() if x != "recent"}
                                       for k, v in messenger.items()}})
    path = write_report(args.out, doc, record)
    say(f"[load] wrote {path}")
    for f in failures:
        print(f"[load] FAILED: {f}", file=sys.stderr)
    if not failures:
        print(f"[load] OK: {doc['requests']} requests ({doc['aborted']} aborted), 0 errors, "
              f"{doc['requests_per_s']} req/s, p99 {doc['p99_latency_ms']} ms, {doc['outputs_identical']}/"
              f"{doc['outputs_compared']} outputs identical, pages/threads/fds back to idle")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
