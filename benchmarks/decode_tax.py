"""What the messenger costs a decoder: decode step time (ITL) and per-thread CPU of the
decode server, against SGLang's own PD decoder, at the same batch, on the same core.

    python benchmarks/decode_tax.py --out DIR [--quick] [--batches 1 4 8 16] [--repeats 5]
        [--configs upstream:mooncake messenger:shmem messenger:libfabric:tcp ...]

A configuration may carry SGLang flags for both of its servers after a slash, comma-separated,
to find which difference between the two decoders costs a step (an A/B, not a deployment):
`upstream:mooncake/--page-size,16` runs SGLang's PD with the messenger's page size,
`upstream:mooncake/--enable-mixed-chunk` with its mixed chunks, `messenger:shmem/--disable-radix-cache`
the messenger without the radix cache.

Each configuration is a `--role all --pin-cores` stack of smollm2-135m (prefill server and
router on core 0 with this client, the decode server alone on core 1). For each batch size
B, B streams of short prompts decode (greedy, ignore_eos); once every stream has its first
tokens (steady state) a window opens:
- idle: nothing else happens for WINDOW_S;
- kv: a long prompt is sent meanwhile, and the window closes when its first token arrives
  (its prefill, its KV arriving on the decoder, its first decoder step).
Over the window: the ITL of the B streams (token intervals inside it) p50/p99, and the CPU
time of every thread of the decode server, by OS thread name (harness/threadcpu.py; our
threads are named "sd:..."). Then the streams are closed and the next measurement starts.

Repeats are interleaved: repeat r runs every configuration (one stack at a time: a stack
is started, measured at every B in both conditions, stopped), so that drift of the machine
spreads over all rows. DIR/decode_tax.json holds every run; the summary gives per row the
median of the repeats' ITL p50 and its range, and the ratio of each messenger row's median
to SGLang's PD decoder's in the same condition. DIR/decode_tax.png plots them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import results_doc  # noqa: E402
from harness import threadcpu  # noqa: E402
from load_client import Result, stream_generate  # noqa: E402
from stack_configs import launch_config  # noqa: E402

from sglang_disagg.launch import Stack  # noqa: E402

MODEL = "smollm2-135m"
CONFIGS = ["upstream:mooncake", "messenger:shmem", "messenger:libfabric:tcp", "messenger:nixl", "messenger:mooncake"]
QUICK = ["upstream:mooncake", "messenger:shmem", "messenger:libfabric:tcp"]
WINDOW_S = 3.0
WARM_TOKENS = 4
PROMPT_LEN, LONG_LEN = 8, 1536
# Each stream may decode this many tokens (windows end long before). SGLang admits a request
# only while the pool can hold what every running request may still generate (times its
# new-token ratio): with 4000 tokens each in an 8192-token pool, only 2-3 of B streams ran and
# the rest queued, so "B" was not the batch. The pool below holds B = 16 such streams.
MAX_NEW_TOKENS = 1024
POOL_TOKENS = 65536
# /v1/loads reads a snapshot SGLang publishes every N decode steps (15 by default): every step
# here, or the count of running requests checked above and in _drain() lags (both modes alike).
SERVER_ARGS = ("--load-snapshot-publish-interval", "1")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


async def one_window(url: str, decoder_url: str, decoder_pid: int, batch: int, kv: bool, seed: int,
                     admin_key: str = "") -> dict:
    import aiohttp

    t0 = time.perf_counter()
    streams, results = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for i in range(batch):
            prompt = [1] + [(seed * 7919 + i * 104729 + k * 31) % 4000 + 10 for k in range(PROMPT_LEN - 1)]
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0,
                                                             "ignore_eos": True}}
            results.append(Result("decode", time.perf_counter() - t0))
            streams.append(asyncio.create_task(stream_generate(session, url, body, t0, res=results[-1])))
        # steady state: every stream has decoded a few tokens
        deadline = time.perf_counter() + 120
        while not all(len(r.token_times) >= WARM_TOKENS for r in results) and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        start = time.perf_counter() - t0
        for _ in range(20):  # a window measures B requests decoding, no more, no fewer
            if (running := await _running(session, decoder_url)) == batch:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"B={batch}: the decoder runs {running} requests at the window's start")
        before = threadcpu.sample(threadcpu.tree(decoder_pid))
        long_first = None
        if kv:
            prompt = [1] + [(seed * 131 + k * 17) % 4000 + 10 for k in range(LONG_LEN - 1)]
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0,
                                                             "ignore_eos": True}}
            long = await stream_generate(session, url, body, t0, "long", abort_after=1)
            long_first = long.token_times[0] if long.token_times else None
            end = time.perf_counter() - t0
        else:
            await asyncio.sleep(WINDOW_S)
            end = time.perf_counter() - t0
        after = threadcpu.sample(threadcpu.tree(decoder_pid))
        await _drain(session, decoder_url, admin_key)
        await asyncio.gather(*streams, return_exceptions=True)
    itls = []
    for r in results:
        t = [x for x in r.token_times if start <= x <= end]
        itls += [b - a for a, b in zip(t, t[1:])]
    window = end - start
    threads = {name: round(share, 2) for name, share in threadcpu.by_name(threadcpu.between(before, after, window)).items()}
    return {"window_s": round(window, 3), "tokens": len(itls), "itl_p50_ms": _ms(pct(itls, 50)),
            "itl_p99_ms": _ms(pct(itls, 99)), "long_first_token_s": long_first and round(long_first - start, 3),
            "threads_pct": threads,
            "ours_pct": round(sum(v for k, v in threads.items() if k.startswith(threadcpu.PREFIX)), 2)}


async def _drain(session, decoder_url: str, admin_key: str) -> None:
    """Abort every request on the decode server and wait until it runs none. A client that
    closes its stream at the router did not stop the request on the decoder in our runs,
    and an abort sent once was sometimes not seen: abort again until the decoder is empty,
    so that no stream of one window runs on into the next. /abort_request is an admin endpoint:
    it takes the stack's admin key (on loopback too, keys.Scope.ADMIN)."""
    auth = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    for _ in range(40):
        async with session.post(decoder_url + "/abort_request", json={"abort_all": True}, headers=auth) as r:
            r.raise_for_status()
        await asyncio.sleep(0.5)
        loads = await _loads(session, decoder_url)
        if not sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads):
            return
    raise RuntimeError(f"the decoder on {decoder_url} still runs requests after 40 aborts: {loads}")


async def _loads(session, decoder_url: str) -> list[dict]:
    async with session.get(decoder_url + "/v1/loads", params={"include": "core"}) as r:
        return (await r.json())["loads"]


async def _running(session, decoder_url: str) -> int:
    return sum(int(x.get("num_running_reqs", 0)) for x in await _loads(session, decoder_url))


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def summarize(runs: list[dict]) -> list[dict]:
    rows: dict[tuple, list[dict]] = {}
    for r in runs:
        rows.setdefault((r["config"], r["condition"], r["batch"]), []).append(r)
    out = []
    for (config, cond, batch), rs in sorted(rows.items()):
        p50s = [r["itl_p50_ms"] for r in rs if r["itl_p50_ms"] is not None]
        p99s = [r["itl_p99_ms"] for r in rs if r["itl_p99_ms"] is not None]
        ours = [r["ours_pct"] for r in rs]
        out.append({"config": config, "condition": cond, "batch": batch, "repeats": len(rs),
                    "itl_p50_ms_median": statistics.median(p50s) if p50s else None,
                    "itl_p50_ms_range": [min(p50s), max(p50s)] if p50s else None,
                    "itl_p99_ms_median": statistics.median(p99s) if p99s else None,
                    "ours_cpu_pct_median": statistics.median(ours)})
    # The baseline is SGLang's PD as shipped: an upstream row without flags of an A/B (sorted
    # first, so a plain upstream row, when there is one, is the one kept).
    base: dict = {}
    for r in sorted(out, key=lambda r: "/" in r["config"]):
        if r["config"].startswith("upstream"):
            base.setdefault((r["condition"], r["batch"]), r["itl_p50_ms_median"])
    for r in out:
        b = base.get((r["condition"], r["batch"]))
        r["vs_upstream_pd"] = round(r["itl_p50_ms_median"] / b, 3) if b and r["itl_p50_ms_median"] else None
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, cond in zip(axes, ("idle", "kv")):
        for config in sorted({r["config"] for r in summary}):
            rows = sorted((r for r in summary if r["config"] == config and r["condition"] == cond
                           and r["itl_p50_ms_median"] is not None), key=lambda r: r["batch"])
            xs = [r["batch"] for r in rows]
            ys = [r["itl_p50_ms_median"] for r in rows]
            lo = [y - r["itl_p50_ms_range"][0] for y, r in zip(ys, rows)]
            hi = [r["itl_p50_ms_range"][1] - y for y, r in zip(ys, rows)]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=config)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests decoding (B)")
        ax.set_title("B decoding, nothing arriving" if cond == "idle" else "B decoding while another request's KV arrives")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ITL p50, ms (median of repeats, range)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"decode step on one core, {MODEL}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="3 configurations, B 1 and 4, 2 repeats")
    ap.add_argument("--configs", nargs="+")
    ap.add_argument("--batches", nargs="+", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--port", type=int, default=29000)
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    configs = args.configs or (QUICK if args.quick else CONFIGS)
    batches = args.batches or ([1, 4] if args.quick else [1, 4, 8, 16])
    repeats = args.repeats or (2 if args.quick else 5)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="decode-tax-"))
    os.sched_setaffinity(0, {0})  # the client with the prefill server and the router
    runs: list[dict] = []
    failures: list[dict] = []
    started = record.started

    def write() -> list[dict]:
        # After every stack, so that a run stopped or broken midway keeps what it measured.
        summary = summarize(runs)
        result = {"host": record.machine.host, "cpus": record.machine.cores, "model": MODEL, "time": record.date,
                  "duration_s": round(time.time() - started), "window_s": WINDOW_S, "prompt_len": PROMPT_LEN,
                  "long_len": LONG_LEN, "max_new_tokens": MAX_NEW_TOKENS, "pool_tokens": POOL_TOKENS,
                  "server_args": SERVER_ARGS, "configs": configs, "batches": batches, "repeats": repeats,
                  "layout": "--role all --pin-cores: prefill + router + client on core 0, decode server on core 1",
                  "failures": failures, "summary": summary, "runs": runs}
        # "runs" holds every window; raw_repeats the same figures per row of the summary.
        record.write(out / "decode_tax.json", result, indent=1, raw_repeats=results_doc.group_repeats(
            sorted(runs, key=lambda r: r["repeat"]), ("config", "condition", "batch"),
            ("repeat", "itl_p50_ms", "itl_p99_ms", "ours_pct", "long_first_token_s")),
            notes=["summary: per (config, condition, batch) the median over repeats of each window's ITL p50 "
                   "and its range; vs_upstream_pd: that median over SGLang's PD decoder's (a plain "
                   "upstream row) in the same condition and batch"])
        if summary:
            plot(summary, out / "decode_tax.png")
        return summary

    for rep in range(repeats):
        for i, config in enumerate(configs):
            name, _, flags = config.partition("/")  # variants of one name get log dirs of their own
            cfg = dataclasses.replace(launch_config(name, MODEL, args.port, logs / f"r{rep}" / str(i),
                                                    max_total_tokens=POOL_TOKENS),
                                      pin_cores=True, extra_args=SERVER_ARGS + tuple(f for f in flags.split(",") if f))
            try:
                with Stack.for_config(cfg) as stack:
                    decoder = next(p for p in stack.servers if p.spec.name == "decode")
                    for batch in batches:
                        for cond in ("idle", "kv"):
                            seed = rep * 1000 + batch * 10 + (cond == "kv")
                            row = asyncio.run(one_window(stack.url, decoder.url, decoder.pid, batch, cond == "kv",
                                                         seed, stack.admin_key))
                            row.update(config=config, condition=cond, batch=batch, repeat=rep)
                            runs.append(row)
                            print(f"r{rep} {config:26s} B={batch:<3d} {cond:4s} ITL p50 {row['itl_p50_ms']} ms "
                                  f"p99 {row['itl_p99_ms']} ms, ours {row['ours_pct']} %", flush=True)
                            time.sleep(1.0)  # the aborted requests' pages go back
            except Exception as e:  # one configuration broken: say so, keep measuring the others
                failures.append({"config": config, "repeat": rep, "error": f"{type(e).__name__}: {e}"[:2000],
                                 "logs": str(logs / f"r{rep}" / str(i))})
                print(f"r{rep} {config}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            write()
    summary = write()
    for r in summary:
        print(f"{r['config']:26s} {r['condition']:4s} B={r['batch']:<3d} ITL p50 {r['itl_p50_ms_median']} ms "
              f"{r['itl_p50_ms_range']} x{r['vs_upstream_pd']} ours {r['ours_cpu_pct_median']} %")
    if failures:
        sys.exit(f"{len(failures)} configuration run(s) failed: {[f['config'] for f in failures]}")


if __name__ == "__main__":
    main(sys.argv[1:])
