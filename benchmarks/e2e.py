"""End to end: short chats decoding while long prompts keep arriving, colocated vs upstream
SGLang PD vs the messenger, on the same cores, one configuration after the other.

    python benchmarks/e2e.py --out DIR [--quick] [--model small-llama] [--configs ...] [--repeats 1]
        [--chat-rate 0.5 --chat-count 24 --chat-input 128 --chat-output 96]
        [--long-rate 0.1 --long-count 5 --long-input 2048 --long-output 4]

Each configuration is started with the launcher (`--role colocated`, or `--role all` which
pins its prefill server and its decode server to their own halves of the cores; the router and
this client share the prefill server's; the split is written in the results), then gets
(1) the chats alone, the decode-only baseline, and (2) the chats with the long prompts
arriving meanwhile (Poisson arrivals, load_client.py).
Writes DIR/e2e.json (one row per configuration: TTFT/ITL p50/p99/max of the chats under
the mixed load, ITL p50/p99 of the chats alone (the same chat arrivals), both again by how
many requests were decoding, tokens/s per user and in total, requests ok/failed, the
configuration's start-up time, and for the messenger the transfer tail) and
DIR/e2e.png (ITL over time, TTFT and ITL CDFs).

With --repeats N every configuration runs N times, interleaved (repeat r runs each
configuration once), one row per run (its "repeat"); "summary" gives per configuration the
median of the runs and their range, and each configuration's ratio to upstream PD's median
for every figure (one run of this workload moves by 10-20 %: a single run cannot say whether
two configurations differ by less). "decoding_mean" is the mean number of requests decoding
when a chat token came: the batch its decode step ran at, which sets its ITL (a prefill that
releases more requests together gives larger decode batches: lower TTFT, lower rate per user).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sglang_disagg.launch import Role, Stack
from sglang_disagg.launch.commands import server_cores

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from load_client import RequestClass, Result, run  # noqa: E402
from stack_configs import launch_config  # noqa: E402

CONFIGS = ["colocated", "upstream:mooncake", "upstream:nixl", "messenger:shmem", "messenger:libfabric:tcp",
           "messenger:nixl", "messenger:mooncake"]
QUICK = ["colocated", "upstream:mooncake", "messenger:shmem", "messenger:libfabric:tcp"]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def measure(stack: Stack, chat: RequestClass, long: RequestClass, bar) -> tuple[dict, list[Result]]:
    # The same chat arrivals both times (other prompts, so the second run reuses no prefix).
    alone = run(stack.url, [chat], seed=2, prompt_seed=2, on_done=lambda r: bar.update(1))
    mixed = run(stack.url, [chat, long], seed=2, prompt_seed=3, on_done=lambda r: bar.update(1))
    chats = [r for r in mixed if r.klass == "chat" and not r.error]
    itls = [x for r in chats for x in r.itls]
    alone_itls = [x for r in alone if not r.error for x in r.itls]
    per_user = [(len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0]) for r in chats
                if len(r.token_times) > 1 and r.token_times[-1] > r.token_times[0]]
    ok = [r for r in mixed if not r.error]
    span = max((r.token_times[-1] for r in ok if r.token_times), default=0.0) - min((r.start for r in mixed),
                                                                                    default=0.0)
    row = {
        "ttft_p50_ms": ms(pct([r.ttft for r in chats], 50)), "ttft_p99_ms": ms(pct([r.ttft for r in chats], 99)),
        "long_ttft_p50_ms": ms(pct([r.ttft for r in ok if r.klass == "long"], 50)),
        "itl_p50_ms": ms(pct(itls, 50)), "itl_p99_ms": ms(pct(itls, 99)), "itl_max_ms": ms(max(itls, default=None)),
        "itl_alone_p50_ms": ms(pct(alone_itls, 50)), "itl_alone_p99_ms": ms(pct(alone_itls, 99)),
        # Median: a client that got its tokens in one burst (no streaming) has no decode rate.
        "tokens_per_s_per_user": round(statistics.median(per_user), 2) if per_user else None,
        "tokens_per_s_total": round(sum(len(r.token_times) for r in ok) / span, 2) if span > 0 else None,
        "requests_ok": len(ok), "requests_failed": len(mixed) - len(ok),
        "errors": sorted({r.error for r in mixed if r.error})[:3],
        "decoding_mean": decoding_mean(mixed),
        "itl_by_decoding_alone": by_decoding(alone), "itl_by_decoding_mixed": by_decoding(mixed),
    }
    return row, mixed


def chat_tokens_by_decoding(results: list[Result]) -> list[tuple[int, float]]:
    """(how many requests were decoding when the token came, its ITL) for every chat token
    after the first: a request decodes from its first token to its last, as the client saw them."""
    spans = [(r.token_times[0], r.token_times[-1]) for r in results if len(r.token_times) > 1]
    return [(sum(a <= t <= b for a, b in spans), x) for r in results if r.klass == "chat" and not r.error
            for t, x in zip(r.token_times[1:], r.itls)]


def by_decoding(results: list[Result]) -> dict[str, dict]:
    """Chat ITL p50/p99 by how many requests were decoding when the token came: a decode
    step's time grows with its batch, so this tells a step that is slow because of its batch
    from one slowed by something else."""
    groups: dict[int, list[float]] = {}
    for n, x in chat_tokens_by_decoding(results):
        groups.setdefault(n, []).append(x)
    return {str(n): {"p50_ms": ms(pct(v, 50)), "p99_ms": ms(pct(v, 99)), "count": len(v)}
            for n, v in sorted(groups.items())}


def decoding_mean(results: list[Result]) -> float | None:
    """Mean over the chats' tokens of how many requests were decoding when the token came."""
    seen = [n for n, _ in chat_tokens_by_decoding(results)]
    return round(statistics.fmean(seen), 2) if seen else None


SUMMARIZED = ("ttft_p50_ms", "ttft_p99_ms", "long_ttft_p50_ms", "itl_p50_ms", "itl_p99_ms", "itl_alone_p50_ms",
              "tokens_per_s_per_user", "tokens_per_s_total", "decoding_mean")


def summarize(rows: list[dict]) -> list[dict]:
    """Per configuration: the median of its runs and their range for each figure, and the
    ratio of that median to upstream PD's (the first upstream configuration of the run)."""
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        runs = [r for r in rows if r["config"] == name]
        entry = {"config": name, "runs": len(runs)}
        for key in SUMMARIZED:
            vals = [r[key] for r in runs if r.get(key) is not None]
            entry[key] = round(statistics.median(vals), 2) if vals else None
            entry[key + "_range"] = [min(vals), max(vals)] if vals else None
        out.append(entry)
    base = next((e for e in out if e["config"].startswith("upstream")), None)
    if base is not None:
        for e in out:
            e["vs_upstream"] = {k: round(e[k] / base[k], 3) for k in SUMMARIZED if e[k] and base[k]}
    return out


def transfer_tail(stack: Stack) -> float | None:
    """Median end of the prefill forward -> decoder hand-off over the requests both
    messengers still list (their last 64)."""
    dec = {r["rid"]: r for r in (stack.messenger_stats("decode") or {}).get("recent", [])}
    pre = {r["rid"]: r for r in (stack.messenger_stats("prefill") or {}).get("recent", [])}
    tails = [dec[rid]["handoff"] - pre[rid]["forward_end"] for rid in dec.keys() & pre.keys()
             if "forward_end" in pre[rid]]
    return ms(statistics.median(tails)) if tails else None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--configs", nargs="+", default=None)
    ap.add_argument("--chat-rate", type=float, default=0.5)
    ap.add_argument("--chat-count", type=int, default=24)
    ap.add_argument("--chat-input", type=int, default=128)
    ap.add_argument("--chat-output", type=int, default=96)
    ap.add_argument("--long-rate", type=float, default=0.1)
    ap.add_argument("--long-count", type=int, default=5)
    ap.add_argument("--long-input", type=int, default=2048)
    ap.add_argument("--long-output", type=int, default=4)
    ap.add_argument("--port", type=int, default=32300)
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)}; 12 chats, 3 long prompts")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each configuration, interleaved")
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    configs = args.configs or (QUICK if args.quick else CONFIGS)
    if args.quick:
        args.chat_count, args.long_count = 12, 3
    chat = RequestClass("chat", args.chat_input, args.chat_output, args.chat_rate, args.chat_count)
    long = RequestClass("long", args.long_input, args.long_output, args.long_rate, args.long_count)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    from tqdm import tqdm

    rows, timelines = [], {}
    all_cores = os.sched_getaffinity(0)
    bar = tqdm(total=args.repeats * len(configs) * (2 * chat.count + long.count), unit="req", desc="e2e")
    for rep, name in ((rep, name) for rep in range(args.repeats) for name in configs):
        cfg = dataclasses.replace(launch_config(name, args.model, args.port, logs / f"r{rep}", max_total_tokens=16384),
                                  pin_cores=True)
        colocated = cfg.role is Role.COLOCATED
        # The client and the router share the prefill server's cores: the decode server's run
        # decoding only, as on a dedicated decode node. Colocated, everything shares all cores.
        client_cores = server_cores(cfg, Role.COLOCATED if colocated else Role.PREFILL)
        split = ("all cores: " + ",".join(map(str, client_cores)) + " (with the client)" if colocated
                 else f"prefill cores {client_cores} (with the router and the client), "
                      f"decode cores {server_cores(cfg, Role.DECODE)}")
        bar.set_postfix_str(f"starting {name}")
        stack = Stack.for_config(cfg)
        stack.start()
        try:
            bar.set_postfix_str(name)
            os.sched_setaffinity(0, client_cores)
            row, mixed = measure(stack, chat, long, bar)
            row = {"config": name, "repeat": rep, "cores": split, "startup_s": round(stack.startup_s, 2), **row}
            if cfg.role is Role.ALL and cfg.mode.value == "messenger":
                row["transfer_tail_ms"] = transfer_tail(stack)
        finally:
            os.sched_setaffinity(0, all_cores)
            stack.stop()
        rows.append(row)
        if rep == 0:  # the plot shows the first run of each configuration
            timelines[name] = [(t, x) for r in mixed if r.klass == "chat" for t, x in zip(r.token_times[1:], r.itls)]
            timelines[name + ":long"] = [r.start for r in mixed if r.klass == "long"]
            timelines[name + ":ttft"] = [r.ttft for r in mixed if r.klass == "chat" and r.ttft is not None]
        tqdm.write(f"[e2e] {json.dumps(row)}")
        time.sleep(1)
    bar.close()
    doc = {"model": args.model, "workload": {"chat": vars(chat), "long": vars(long)}, "repeats": args.repeats,
           "summary": summarize(rows), "rows": rows}
    record.write(args.out / "e2e.json", doc, indent=2,
                 raw_repeats=results_doc.group_repeats(rows, ("config",), ("repeat", *SUMMARIZED)),
                 notes=["rows: one per run (its repeat); summary: per configuration the median of its runs, "
                        "their range and the median's ratio to upstream PD's; percentiles are over the "
                        "chats' tokens of one run", "the plot shows the first run of each configuration"])
    plot(doc, timelines, args.out / "e2e.png")
    print(f"[e2e] wrote {args.out / 'e2e.json'} and e2e.png")
    failed = {r["config"]: r["requests_failed"] for r in rows if r["requests_failed"]}
    if failed:  # kept in the results, but the run is not a clean sample
        print(f"[e2e] FAILED: requests lost per configuration: {failed}; errors in e2e.json", file=sys.stderr)
        return 1
    return 0


def plot(doc: dict, timelines: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["config"] for r in doc["rows"]))
    fig, axes = plt.subplots(len(names) + 2, 1, figsize=(11, 2.2 * (len(names) + 2)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        pts = timelines[name]
        ax.scatter([t for t, _ in pts], [1000 * x for _, x in pts], s=3)
        for t in timelines[name + ":long"]:
            ax.axvline(t, color="red", alpha=0.3)
        ax.set_title(f"{name}: chat inter-token latency (ms) over time; red = a long prompt arrives", fontsize=8)
    for ax, what, key in ((axes[-2, 0], "ITL", ""), (axes[-1, 0], "TTFT", ":ttft")):
        for name in names:
            vals = sorted(1000 * (x[1] if isinstance(x, tuple) else x) for x in timelines[name + key])
            if vals:
                ax.plot(vals, [i / len(vals) for i in range(len(vals))], label=name)
        ax.set_xscale("log")
        ax.set_title(f"chat {what} CDF (ms)", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
