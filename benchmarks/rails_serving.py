"""Rails end to end: KV transfer time, TTFT and the streaming tail of ~2k-token prompts per rail count.

    python benchmarks/rails_serving.py --out DIR [--rails 1 2 4] [--rate 100] [--tokens 2048]
        [--repeats 3] [--models smollm2-135m tiny-deepseek-v3]

Prefill, decode and the router on three namespace hosts (harness/hosts/netns.py) with N rails
each (eth0, rail1.., one subnet and bridge per rail), every switch port into the decode host
capped at --rate Mbit/s (so k rails carry at most k times one rail's rate into it), the
messenger over libfabric tcp with `--rails` naming every interface of the host (eth0 alone for
one rail). Per model and rail count one deployment, warmed up, then --repeats requests, each a
fresh --tokens prompt (no radix-cache hit) asking one token, so its latency is the TTFT. The
repeats of a rail count run back to back on its deployment (one deployment at a time fits the two
cores), not interleaved with other rail counts: compare rows of one run.
Per request (harness/hosts/tail.py): ttft_ms, tail_ms (prefill forward end -> decoder ready),
transfer_ms (the prefill's first post -> last write done), kv_bytes (the decoder's counter), the
CPU seconds each host used. Rows are medians; x_one_rail is one rail's transfer_ms over this
row's. Writes DIR/rails_serving.json and DIR/rails_serving.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import results_doc  # noqa: E402
from harness.hosts import netns  # noqa: E402
from harness.hosts.deployment import Deployment, Layout  # noqa: E402
from harness.hosts.tail import Probe  # noqa: E402
from single_request import prompt_of  # noqa: E402


def cap(net: netns.Network, host: str, mbit: float) -> None:
    h = net[host]
    for port in [h.port] + [r[2] for r in h.rails]:
        net.tc("qdisc", "replace", "dev", port, "root", "tbf", "rate", f"{mbit}mbit", "burst", "64kb",
               "latency", "200ms")


def transfer_ms(probe: Probe, rid: str) -> float | None:
    pre = probe._recent(probe.dep.layout.prefill_node(0), "prefill", rid)
    if "first_post" in pre and "last_write" in pre:
        return 1000 * (pre["last_write"] - pre["first_post"])
    return None


def run(model: str, rails: int, args: argparse.Namespace, root: Path, variant: int) -> list[dict]:
    layout = Layout()
    with netns.Network.create(f"rs{rails}", layout.names, rails=rails) as net:
        names = ",".join(["eth0"] + [f"rail{k}" for k in range(1, rails)])
        dep = Deployment.write(root / f"{model}-{rails}", net, layout, model=model, backend="libfabric", provider="tcp",
                               max_total_tokens=4 * args.tokens,
                               extra_args=("--chunked-prefill-size", str(args.tokens), "--dtype", "float32"))
        flags = ("--rails", names)
        t0 = time.monotonic()
        try:
            dep.start(flags={"prefill-0": flags, "decode-0": flags})
            dep.wait_links_ready(30)
            print(f"[rails-serving] {model}, {rails} rail(s): up in {time.monotonic() - t0:.0f} s", flush=True)
            probe = Probe(dep)
            probe.warm_up(prompt_of(64, variant), time.monotonic() + 120)
            cap(net, layout.decode, args.rate)
            samples = []
            for r in range(args.repeats):
                rid = f"rails-{model}-{rails}-{r}"
                row = probe.measure(prompt_of(args.tokens, variant + 1 + r), rid)
                row["transfer_ms"] = transfer_ms(probe, rid)
                samples.append(row)
                print(f"[rails-serving] {model} {rails} rail(s) #{r}: TTFT {row['ttft_ms']:.0f} ms, tail "
                      f"{row['tail_ms']:.0f} ms, transfer {row['transfer_ms'] or 0:.0f} ms, "
                      f"{row['kv_bytes'] / 2**20:.1f} MiB, CPU s {row['cpu_s']}", flush=True)
        finally:
            dep.close()
    return samples


def median(samples: list[dict], key: str) -> float | None:
    vals = [s[key] for s in samples if s.get(key) is not None]
    return round(statistics.median(vals), 1) if vals else None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rails", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--rate", type=float, default=100.0, help="cap of each port into the decode host, Mbit/s")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "tiny-deepseek-v3"])
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    reason = netns.can_create()
    if reason:
        print(f"[rails-serving] cannot make hosts here: {reason}", file=sys.stderr)
        return 2
    netns.sweep()
    args.out.mkdir(parents=True, exist_ok=True)
    root, t0, rows, raw = Path(tempfile.mkdtemp(prefix="bench-rails-")), time.monotonic(), [], []
    for model in args.models:
        for i, n in enumerate(args.rails):
            samples = run(model, n, args, root, 5000 + 100 * i)
            raw += [{"model": model, "rails": n} | s for s in samples]
            rows.append({"model": model, "rails": n, "rate_mbit_per_rail": args.rate, "tokens": args.tokens,
                         **{k: median(samples, k) for k in ("ttft_ms", "tail_ms", "transfer_ms", "kv_bytes")},
                         "cpu_s": {h: round(statistics.median(s["cpu_s"][h] for s in samples), 2)
                                   for h in ("prefill", "decode")}})
    for r in rows:
        one = next((x for x in rows if x["model"] == r["model"] and x["rails"] == 1), None)
        r["x_one_rail"] = (round(one["transfer_ms"] / r["transfer_ms"], 2)
                           if one and one["transfer_ms"] and r["transfer_ms"] else None)
    doc = {"rows": rows, "wall_s": round(time.monotonic() - t0)}
    record.write(args.out / "rails_serving.json", doc, indent=2,
                 raw_repeats=results_doc.group_repeats(raw, ("model", "rails"), ("ttft_ms", "tail_ms", "transfer_ms")),
                 notes=["each row: medians over its repeats, one request each with its own prompt; the hosts are "
                        "network namespaces sharing this machine's two cores (cpu_s: what each host used)"])
    plot(rows, args.out / "rails_serving.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["rails"])
        for key in ("transfer_ms", "tail_ms", "ttft_ms"):
            ax.plot([r["rails"] for r in mine], [r[key] or 0 for r in mine], "o-", label=key)
        ax.set_title(model)
        ax.set_xlabel("rails")
        ax.set_ylabel("ms")
        ax.set_xticks([r["rails"] for r in mine])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
