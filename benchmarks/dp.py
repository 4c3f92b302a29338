"""Attention DP against TP on the decoder, through the messenger, at a fixed load.

    python benchmarks/dp.py --out DIR [--model tiny-deepseek-v3] [--rates 1 8] [--count 32] [--repeats 2]

Two stacks on this machine, the same prefill server (TP 2: the MLA latent is on both ranks,
each request's source rank drawn at random) and a decoder on the same 2 ranks: TP 2, or
TP 2 with 2 attention-DP groups of one rank (the seed's claim: DP takes more load per rank).
Each serves the same Poisson arrivals (load_client.py: streamed /generate, greedy,
ignore_eos) of `count` requests of 64 prompt and 32 output tokens at each offered rate
(requests per second: one the stacks keep up with, one beyond what they serve); configurations
interleave over `repeats`. Per run: requests per second served (completed
requests over the time from the first arrival to the last completion), ITL p50/p99, TTFT
p50, errors, the decode groups' share of requests, the prefill's requests per source rank.
Writes DIR/dp.json and DIR/dp.png. On 2 cores (4 scheduler processes) absolute numbers are
small; the comparison is the point.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sglang_disagg.launch import LaunchConfig, Role, Stack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load_client  # noqa: E402
import results_doc  # noqa: E402

CONFIGS = {"decode-tp2": dict(decode_tp=2), "decode-attn-dp2": dict(decode_tp=2, decode_attn_dp=2)}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def one(name: str, cfg: LaunchConfig, rate: float, count: int, seed: int) -> dict:
    with Stack.for_config(cfg) as stack:
        load_client.run(stack.url, [load_client.RequestClass("warm", 64, 4, 10.0, 2)], seed=seed + 1000)
        time.sleep(1.0)
        results = load_client.run(stack.url, [load_client.RequestClass("chat", 64, 32, rate, count)], seed=seed)
        groups = cfg.decode_attn_dp
        decode = [stack.messenger_stats("decode", g) or {} for g in range(groups)]
        prefill = stack.messenger_stats("prefill") or {}
    ok = [r for r in results if not r.error]
    itls = [x for r in ok for x in r.itls]
    span = max(r.end for r in ok) - min(r.start for r in results) if ok else None
    return {"config": name, "seed": seed, "requests": len(results), "errors": len(results) - len(ok),
            "requests_per_s": round(len(ok) / span, 3) if span else None,
            "itl_p50_ms": round(1000 * pct(itls, 0.5), 1) if itls else None,
            "itl_p99_ms": round(1000 * pct(itls, 0.99), 1) if itls else None,
            "ttft_p50_s": round(statistics.median(r.ttft for r in ok), 3) if ok else None,
            "carried_per_decode_group": [d.get("requests_carried", 0) for d in decode],
            "prefill_requests_by_source": prefill.get("requests_by_source", {})}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="tiny-deepseek-v3")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 8.0])
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--port", type=int, default=30400)
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-dp-"))
    rows, t0 = [], time.time()
    for rep in range(args.repeats):
        for rate in args.rates:
            for k, (name, kw) in enumerate(CONFIGS.items()):
                cfg = LaunchConfig(role=Role.ALL, model=args.model, backend="shmem", prefill_tp=2,
                                   max_total_tokens=8192, port=args.port + 30 * k,
                                   log_dir=str(logs / f"{name}-{rate:g}-{rep}"), **kw)
                rows.append(one(name, cfg, rate, args.count, seed=7 + rep) | {"offered_rate": rate, "repeat": rep})
                print(f"[bench] {rows[-1]}", flush=True)
    summary = []
    for rate in args.rates:
        for name in CONFIGS:
            mine = [r for r in rows if r["config"] == name and r["offered_rate"] == rate]
            summary.append({"config": name, "offered_rate": rate}
                           | {k: statistics.median(r[k] for r in mine if r[k] is not None)
                              for k in ("requests_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_s")
                              if any(r[k] is not None for r in mine)}
                           | {"errors": sum(r["errors"] for r in mine)})
        base, dp = summary[-2], summary[-1]
        if base.get("requests_per_s") and dp.get("requests_per_s"):
            dp["vs_tp2"] = {k: round(dp[k] / base[k], 3) for k in ("requests_per_s", "itl_p50_ms", "itl_p99_ms")
                            if base.get(k) and dp.get(k)}
    doc = {"model": args.model, "rates": args.rates, "count": args.count, "repeats": args.repeats,
           "wall_s": round(time.time() - t0), "summary": summary, "rows": rows}
    record.write(args.out / "dp.json", doc, indent=1, raw_repeats=results_doc.group_repeats(
        rows, ("config", "offered_rate"), ("repeat", "requests_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_s")),
        notes=["summary: per (config, offered rate) the median over repeats of each run's figures, errors summed; "
               "rows: every run"])
    plot(doc, args.out / "dp.png")
    for s in summary:
        print(s)
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = doc["summary"]
    rates = doc["rates"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    width = 0.38
    for ax, key, label in zip(axes, ("requests_per_s", "itl_p50_ms", "itl_p99_ms"),
                              ("requests/s served", "ITL p50 (ms)", "ITL p99 (ms)")):
        for j, (name, color) in enumerate(zip(CONFIGS, ("tab:blue", "tab:orange"))):
            vals = [next((s.get(key, 0) for s in summary if s["config"] == name and s["offered_rate"] == r), 0)
                    for r in rates]
            ax.bar([i + (j - 0.5) * width for i in range(len(rates))], vals, width, label=name, color=color)
        ax.set_xticks(range(len(rates)), [f"{r:g}/s" for r in rates])
        ax.set_xlabel("requests offered")
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{doc['model']}: decoder TP 2 vs attention DP 2 (same 2 ranks), medians of {doc['repeats']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
