"""What each transfer backend does with several NICs over TCP today: which interfaces carry a
transfer's bytes, and the throughput, on namespace hosts with 1, 2 and 3 rails.

    python benchmarks/rails.py --out DIR [--rails 1 2 4] [--rate 200] [--mib 32] [--rounds 3]
        [--backends libfabric-tcp nixl mooncake]

Two hosts (harness/hosts/netns.py, ``rails=N``): eth0 on 10.77.0.0/24 and rail1.. on
10.77.k.0/24, each rail its own bridge; every port into the receiving host capped at --rate
Mbit/s (a tbf qdisc per switch port), so one rail's worth is known and a backend that spreads
over k rails could reach k times it. A listener in host b registers --mib MiB
(rails_worker.py); a dialer in host a writes all of it --rounds times in 64 KiB pages, 1 MiB
per write call (as the messenger posts a layer's pages), each
backend as the messenger starts it across hosts (NIXL with UCX_NET_DEVICES=all, as the
launcher sets it off loopback; Mooncake and libfabric given the host's eth0 address, as the
messenger gives them). Per row: the median round's throughput (Mbit/s of payload), its ratio
to one rail's cap and to the same backend over one rail, and the share of the dialer's transmitted bytes each interface carried
(kernel counters, /proc/<pid>/net/dev of the host). Writes DIR/rails.json and DIR/rails.png.

`libfabric-tcp` is our backend as the messenger starts it without --rails (one endpoint on the
host address); `libfabric-tcp-rails` with an endpoint per interface (what --rails auto gives it),
striping each transfer's batches over them. `nixl` with UCX_NET_DEVICES=all (the launcher's
setting off loopback), `nixl-rails` with the interface list and UCX_MAX_RMA_RAILS that --rails
gives it; Mooncake as it is: which of them stripe, bind one NIC, or cannot.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import results_doc  # noqa: E402
from harness.hosts import netns  # noqa: E402

WORKER = Path(__file__).with_name("rails_worker.py")
# "+rails": the backend opens an endpoint per interface of its host (--rails auto); the others as
# the messenger starts them without --rails
BACKENDS = {"libfabric-tcp": ("libfabric", "tcp"), "libfabric-tcp-rails": ("libfabric", "tcp+rails"),
            "nixl": ("nixl", "-"), "nixl-rails": ("nixl", "-"), "mooncake": ("mooncake", "-")}
PORT = 7300


def cap_ports(net: netns.Network, host: str, mbit: float) -> None:
    h = net[host]
    for port in [h.port] + [r[2] for r in h.rails]:
        net.tc("qdisc", "replace", "dev", port, "root", "tbf", "rate", f"{mbit}mbit", "burst", "64kb",
               "latency", "50ms")


def interfaces(h: netns.Host) -> list[str]:
    return [h.interface] + [r[0] for r in h.rails]


def measure(net: netns.Network, label: str, args: argparse.Namespace, work: Path) -> dict:
    backend, provider = BACKENDS[label]
    a, b = net["a"], net["b"]
    d = Path(tempfile.mkdtemp(prefix=f"rails-{label}-", dir=work))
    env = dict(os.environ, UCX_NET_DEVICES="all")
    if label == "nixl-rails":  # what `--rails eth0,rail1,...` gives NIXL's servers (launch/commands.py)
        names = interfaces(a)
        env.update(UCX_NET_DEVICES=",".join(names), UCX_MAX_RMA_RAILS=str(min(len(names), 4)))
    port = PORT + list(BACKENDS).index(label)  # one port each: nothing of the last one may still hold it
    listener = subprocess.Popen(b.argv([sys.executable, str(WORKER), "listen", backend, provider, b.address, str(port),
                                        str(d), str(args.mib)]), env=env, stdout=subprocess.DEVNULL,
                                stderr=open(d / "listen.log", "w"), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (d / "listening").exists():
            if listener.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{label} listener did not start: {(d / 'listen.log').read_text()[-2000:]}")
            time.sleep(0.1)
        before = {i: a.counters(i)["tx_bytes"] for i in interfaces(a)}
        r = subprocess.run(a.argv([sys.executable, str(WORKER), "dial", backend, provider, a.address,
                                   (d / "listening").read_text(), str(d), str(args.mib), str(args.rounds)]),
                           env=env, capture_output=True, text=True, timeout=900)
        if r.returncode:
            raise RuntimeError(f"{label} dialer failed: {r.stderr[-2000:]}")
        sent = {i: a.counters(i)["tx_bytes"] - before[i] for i in interfaces(a)}
    finally:  # nsenter forks the worker (PID namespace): the whole session goes
        os.killpg(listener.pid, signal.SIGKILL)
        listener.wait(10)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    seconds = statistics.median(out["round_s"])
    mbit = out["bytes_per_round"] * 8 / seconds / 1e6
    total = sum(sent.values()) or 1
    return {"backend": label, "rails": len(interfaces(a)), "rate_mbit_per_rail": args.rate,
            "throughput_mbit": round(mbit, 1), "x_one_rail_cap": round(mbit / args.rate, 2),
            "share": {i: round(v / total, 3) for i, v in sent.items()}, "round_s": out["round_s"],
            "bytes_per_round": out["bytes_per_round"]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rails", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--rate", type=float, default=200.0, help="cap of each port into the receiver, Mbit/s")
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for n in args.rails:
            with netns.Network.create(f"rails{n}", ["a", "b"], rails=n) as net:
                cap_ports(net, "b", args.rate)
                for label in args.backends:
                    row = measure(net, label, args, Path(work))
                    rows.append(row)
                    print(f"[rails] {label} over {n} rail(s): {row['throughput_mbit']} Mbit/s "
                          f"({row['x_one_rail_cap']}x one rail's cap), bytes by interface {row['share']}", flush=True)
    one = {r["backend"]: r["throughput_mbit"] for r in rows if r["rails"] == 1}
    for r in rows:  # the ratio that says whether a backend spreads: against itself over one rail
        r["x_same_backend_one_rail"] = round(r["throughput_mbit"] / one[r["backend"]], 2) if r["backend"] in one else None
    record.write(out / "rails.json", {"rows": rows, "rate_mbit_per_rail": args.rate, "mib": args.mib},
                 notes=["libfabric-tcp-rails: an endpoint per interface (BackendConfig.rails, what --rails auto "
                        "gives); the other rows as the messenger starts each backend without --rails.",
                        "share: the dialer host's transmitted bytes per interface during the transfer (acks "
                        "and control traffic included)."])
    plot(rows, args.rate, out / "rails.png")
    return 0


def plot(rows: list[dict], rate: float, path: Path) -> None:
    """Throughput per rail count, one line per backend, and the ideal (k rails x one rail's cap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    counts = sorted({r["rails"] for r in rows})
    ax.plot(counts, [k * rate for k in counts], "k:", label="k rails x cap")
    for label in dict.fromkeys(r["backend"] for r in rows):
        mine = sorted((r["rails"], r["throughput_mbit"]) for r in rows if r["backend"] == label)
        ax.plot([k for k, _ in mine], [v for _, v in mine], "o-", label=label)
    ax.set_xlabel("rails (each capped at %g Mbit/s)" % rate)
    ax.set_ylabel("throughput, Mbit/s")
    ax.set_xticks(counts)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
