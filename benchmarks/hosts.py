"""Bandwidth across hosts: the transfer tail on a capped link, streaming vs --no-stream vs upstream PD.

    python benchmarks/hosts.py --out DIR [--quick] [--rates 50 100 200 400]
        [--prompt-tokens 512 2048 4096] [--repeats 2] [--model small-llama]

Prefill, decode and the router on three hosts (harness/hosts/netns.py), the link into
the decode host (the KV flows into decode) capped with shaping.cap at each rate in turn,
changed in place between measurements. First the uncapped veth goodput from the prefill host
to the decode host is measured (a TCP stream: the rates must stay below it), then the goodput
each cap really gives. Configurations, one deployment each on the same network: ``streaming``
(messenger, libfabric provider tcp), ``no_stream`` (the same with --no-stream: a chunk's KV
posted once, after its forward) and ``upstream`` (SGLang's own PD over Mooncake). SGLang's
--chunked-prefill-size is the largest prompt, so each prompt is one forward. Every request
has a fresh prompt (no radix-cache hit), is sent from inside the router's host and asks for
one token, so its latency is the TTFT.

Each row (config, rate_mbit, prompt_tokens): medians of ttft_ms and tail_ms (prefill forward
end -> decoder ready, read as harness/hosts/tail.py says: upstream's understates),
kv_bytes (the decoder's sglang_disagg_kv_bytes_total delta; upstream: tokens x the model's
KV per token), predicted_transfer_ms (kv_bytes*8/rate), predicted_one_layer_ms (that over
the layers), and for streaming layer_compute_ms (the prefill's forward / layers) and the
target: when the link carries a layer's KV faster than a layer computes (target_applies),
the tail must be at most one layer's share plus 5 ms (target_holds); prefill_cpu_s and
decode_cpu_s, the CPU seconds each host's processes used during the request (the hosts share
this machine's cores: a decode host that busy-waits slows the prefill's forward, as on
separate machines it would not). Writes DIR/hosts.json and DIR/hosts.png (tail and TTFT vs
link rate, the predicted lines drawn).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the namespace harness lives beside the benchmarks, outside the installed package
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import results_doc  # noqa: E402
from harness.hosts import netns, shaping  # noqa: E402
from harness.hosts.deployment import Deployment, Layout  # noqa: E402
from harness.hosts.tail import Geometry, Probe, goodput_mbit, transfer_ms  # noqa: E402
from single_request import prompt_of  # noqa: E402

TARGET_SLACK_MS = 5.0
SYMLOG_MS = 10.0
MARKS = "osD"
# name -> (mode, backend, provider, prefill launcher flags, extra SGLang flags)
CONFIGS = {
    "streaming": ("messenger", "libfabric", "tcp", (), ()),
    "no_stream": ("messenger", "libfabric", "tcp", ("--no-stream",), ()),
    "upstream": ("upstream", "mooncake", None, (), ("--enable-metrics",)),
}
# For the printed estimate only: seen on this 2-core machine (small-llama, prefill host with
# both cores): a 2048-token forward ~5 s; a deployment 20-50 s to start, ~15 s to stop.
FORWARD_S_PER_TOKEN = 2.5e-3
DEPLOYMENT_S = 45.0


def estimate_s(args: argparse.Namespace, geo: Geometry) -> float:
    total = 5 + 2 * len(args.rates)  # goodputs
    for name in args.configs:
        total += DEPLOYMENT_S + FORWARD_S_PER_TOKEN * max(args.prompt_tokens)  # start, stop, warm-up
        for rate, n in itertools.product(args.rates, args.prompt_tokens):
            fwd, xfer = FORWARD_S_PER_TOKEN * n, transfer_ms(n * geo.bytes_per_token, rate) / 1000
            total += args.repeats * ((max(fwd, xfer) if name == "streaming" else fwd + xfer) + 0.5)
    return total


def summarize(name: str, rate: float, n: int, samples: list[dict], geo: Geometry) -> dict:
    def median(key: str) -> float | None:
        vals = [s[key] for s in samples if s[key] is not None]
        return statistics.median(vals) if vals else None

    counted = median("kv_bytes")
    kv = counted if counted else n * geo.bytes_per_token
    row = {"config": name, "rate_mbit": rate, "prompt_tokens": n, "ttft_ms": median("ttft_ms"),
           "tail_ms": median("tail_ms"), "kv_bytes": kv,
           "kv_bytes_from": "decoder counter" if counted else "tokens x KV per token",
           "predicted_transfer_ms": transfer_ms(kv, rate), "predicted_one_layer_ms": transfer_ms(kv, rate) / geo.layers,
           "layer_compute_ms": None, "target_applies": None, "target_holds": None, "samples": samples}
    for host in ("prefill", "decode"):  # the hosts share the cores: a busy decode host slows the prefill
        row[f"{host}_cpu_s"] = statistics.median(s["cpu_s"][host] for s in samples)
    if row["tail_ms"] is not None:
        row["tail_over_predicted"] = row["tail_ms"] / row["predicted_transfer_ms"]
    forward = median("forward_ms")
    if forward is not None:
        row["forward_ms"] = forward
        row["layer_compute_ms"] = forward / geo.layers
        row["target_applies"] = row["predicted_one_layer_ms"] < row["layer_compute_ms"]
        if row["target_applies"] and row["tail_ms"] is not None:
            row["target_holds"] = row["tail_ms"] <= row["predicted_one_layer_ms"] + TARGET_SLACK_MS
    return row


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def run_config(name: str, net: netns.Network, args: argparse.Namespace, geo: Geometry, root: Path,
               variants: itertools.count) -> list[dict]:
    mode, backend, provider, prefill_flags, extra = CONFIGS[name]
    largest = max(args.prompt_tokens)
    dep = Deployment.write(root / name, net, Layout(), model=args.model, mode=mode, backend=backend,
                           provider=provider, max_total_tokens=4 * largest,
                           extra_args=("--chunked-prefill-size", str(largest), "--dtype", "float32", *extra))
    probe, rows = Probe(dep, upstream=mode == "upstream"), []
    shaping.cap(net, "decode", None)
    t0 = time.monotonic()
    try:
        ups = dep.start(flags={"prefill-0": prefill_flags})
        print(f"[hosts] {name} up in {time.monotonic() - t0:.0f} s ({ups})", flush=True)
        # uncapped, the largest prompt: its allocations serve every smaller one
        probe.warm_up(prompt_of(largest, next(variants)), time.monotonic() + 180)
        for rate in args.rates:
            shaping.cap(net, "decode", rate)  # in place once capped
            for n in args.prompt_tokens:
                samples = [probe.measure(prompt_of(n, v), f"hosts-{name}-{rate:g}-{n}-{v}")
                           for v in itertools.islice(variants, args.repeats)]
                rows.append(summarize(name, rate, n, samples, geo))
                r = rows[-1]
                print(f"[hosts] {name} {rate:g} Mbit/s {n} tok: TTFT {_ms(r['ttft_ms'])}, tail {_ms(r['tail_ms'])}, "
                      f"predicted {_ms(r['predicted_transfer_ms'])} (one layer {_ms(r['predicted_one_layer_ms'])}), "
                      f"layer compute {_ms(r['layer_compute_ms'])}, CPU s prefill/decode host "
                      f"{r['prefill_cpu_s']:.1f}/{r['decode_cpu_s']:.1f}, "
                      f"target {r['target_holds'] if r['target_applies'] else 'n/a'}", flush=True)
    finally:
        dep.close()
        shaping.cap(net, "decode", None)
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--rates", nargs="+", type=float, default=[50, 100, 200, 400], help="link caps, Mbit/s")
    ap.add_argument("--prompt-tokens", nargs="+", type=int, default=[512, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="100 Mbit/s only, 512/2048-token prompts, 1 repeat")
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    if args.quick:
        args.rates, args.prompt_tokens, args.repeats = [100.0], [512, 2048], 1
    reason = netns.can_create()
    if reason:
        print(f"[hosts] cannot make hosts here: {reason}", file=sys.stderr)
        return 2
    netns.sweep()
    geo = Geometry.of(args.model)
    print(f"[hosts] estimated duration ~{estimate_s(args, geo) / 60:.0f} min", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    t0, rows, variants = time.monotonic(), [], itertools.count(1000)
    with netns.Network.create("bench-hosts", Layout().names) as net:
        link = {"uncapped_goodput_mbit": goodput_mbit(net, "prefill", "decode", 2.0)}
        print(f"[hosts] uncapped veth goodput prefill -> decode: {link['uncapped_goodput_mbit']:.0f} Mbit/s",
              flush=True)
        too_fast = [r for r in args.rates if r >= link["uncapped_goodput_mbit"]]
        if too_fast:
            print(f"[hosts] rates {too_fast} are not below what the link carries uncapped", file=sys.stderr)
            return 2
        link["capped_goodput_mbit"] = {}
        for rate in args.rates:
            shaping.cap(net, "decode", rate)
            link["capped_goodput_mbit"][f"{rate:g}"] = goodput_mbit(net, "prefill", "decode", 1.5)
        shaping.cap(net, "decode", None)
        print(f"[hosts] capped goodput: {link['capped_goodput_mbit']}", flush=True)
        for name in args.configs:
            rows += run_config(name, net, args, geo, root, variants)
    doc = {"model": args.model, "repeats": args.repeats, "kv_bytes_per_token": geo.bytes_per_token,
           "layers": geo.layers, "target_slack_ms": TARGET_SLACK_MS, "link": link,
           "wall_s": round(time.monotonic() - t0), "rows": rows}
    series = ("config", "rate_mbit", "prompt_tokens")
    repeats = [{k: r[k] for k in series} | s for r in rows for s in r["samples"]]
    record.write(args.out / "hosts.json", doc, indent=2,
                 raw_repeats=results_doc.group_repeats(repeats, series, ("ttft_ms", "tail_ms", "forward_ms")),
                 notes=["each row: the median over its repeats (its samples, one request each, every one its "
                        "own prompt) at one link cap; the hosts are network namespaces sharing this "
                        "machine's cores"])
    plot(doc, args.out / "hosts.png")
    print(f"[hosts] wrote {args.out / 'hosts.json'} and hosts.png in {doc['wall_s']} s")
    return 0


def plot(doc: dict, path: Path) -> None:
    """Per prompt size: tail (top) and TTFT (bottom) vs link rate; the predicted whole transfer
    and one layer's share + slack drawn as lines; a dotted line where a layer's KV starts to
    cross faster than a layer computes (streaming's forward / layers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows, layers, slack = doc["rows"], doc["layers"], doc["target_slack_ms"]
    sizes = sorted({r["prompt_tokens"] for r in rows})
    names = list(dict.fromkeys(r["config"] for r in rows))
    rates = sorted({r["rate_mbit"] for r in rows})
    fig, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 8), squeeze=False)
    for j, n in enumerate(sizes):
        tail_ax, ttft_ax = axes[0][j], axes[1][j]
        at_n = [r for r in rows if r["prompt_tokens"] == n]
        kv = max(r["kv_bytes"] for r in at_n)
        line = [rates[0] * 0.8 + k * (rates[-1] * 1.25 - rates[0] * 0.8) / 99 for k in range(100)]
        whole = [transfer_ms(kv, x) for x in line]
        tail_ax.plot(line, whole, "k-", lw=1, label="predicted: whole transfer")
        tail_ax.plot(line, [w / layers + slack for w in whole], "k--", lw=1, label=f"one layer's share + {slack:g} ms")
        for k, name in enumerate(names):
            mine = sorted((r for r in at_n if r["config"] == name and r["tail_ms"] is not None),
                          key=lambda r: r["rate_mbit"])
            tail_ax.plot([r["rate_mbit"] for r in mine], [r["tail_ms"] for r in mine], MARKS[k % 3] + "-", label=name)
            both = sorted((r for r in at_n if r["config"] == name), key=lambda r: r["rate_mbit"])
            ttft_ax.plot([r["rate_mbit"] for r in both], [r["ttft_ms"] for r in both], MARKS[k % 3] + "-", label=name)
        tail_ax.set_yscale("symlog", linthresh=SYMLOG_MS)  # streamed tails can be negative
        compute = [r["layer_compute_ms"] for r in at_n if r["layer_compute_ms"]]
        crossover = kv / layers * 8 / (statistics.median(compute) / 1000) / 1e6 if compute else 0
        if line[0] <= crossover <= line[-1]:  # a layer's KV crosses in one layer's compute time at this rate
            for ax in (tail_ax, ttft_ax):
                ax.axvline(crossover, color="grey", ls=":", lw=1)
            tail_ax.text(crossover, tail_ax.get_ylim()[0], " link faster than a layer's compute ->", fontsize=7,
                         color="grey", rotation=90, va="bottom")
        tail_ax.set_title(f"{n} tokens ({kv / 2**20:.0f} MiB of KV): forward end -> decoder ready (ms)", fontsize=9)
        ttft_ax.set_title(f"{n} tokens: TTFT (ms)", fontsize=9)
        for ax in (tail_ax, ttft_ax):
            ax.set_xscale("log")
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xticks(rates, [f"{r:g}" for r in rates])
            ax.set_xlabel("link into decode (Mbit/s)")
            ax.legend(fontsize=7)
    fig.suptitle(f"{doc['model']} across hosts: capped link (tail axis linear within +-{SYMLOG_MS:g} ms)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
