"""Transfer benchmark: KV-shaped workloads over every backend / provider in one run.

    python benchmarks/transfer.py --out DIR [--quick] [--backends libfabric:tcp,nixl] [--workloads page-1M]

Writes DIR/transfer.json (rows: backend, provider, workload, page_bytes, gbps, writes_per_s,
p50_ms, p99_ms, ...; top level: memcpy_gbps (one stream) and memcpy_256k_pages_gbps (scattered
pages, the physical limit of the page workloads), tcp_loopback_gbps, measured in the same run)
and DIR/transfer.png (process_vm_writev_gbps too: one-copy writes into another process, CMA, a
same-host transport's floor). Each backend runs as a writer process and a reader process; the
"raw" rows are our libfabric shim posting and polling in a C loop, with no Python per
batch, on the same provider, to show what the Python layer costs.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from transfer_limits import (memcpy_gbps, memcpy_pages_gbps, process_vm_writev_gbps,  # noqa: E402
                             tcp_loopback_gbps)
from transfer_workloads import region_bytes, workloads  # noqa: E402

from sglang_disagg.backends import available  # noqa: E402

HERE = Path(__file__).parent
TARGETS = [("libfabric", "tcp"), ("nixl", None), ("mooncake", None), ("shmem", None)]
ENV = {**os.environ, "UCX_NET_DEVICES": "lo", "GLOG_minloglevel": "2", "NIXL_LOG_LEVEL": "WARN"}


def _readable(f, timeout: float) -> bool:
    """Whether `f` has something to read within `timeout` s. poll, not select: select() fails
    outright on a descriptor numbered 1,024 or more, which a long test process reaches."""
    p = select.poll()
    p.register(f, select.POLLIN)
    return bool(p.poll(timeout * 1000))


class Endpoint:
    def __init__(self, backend: str, provider: str | None) -> None:
        self.p = subprocess.Popen([sys.executable, str(HERE / "transfer_worker.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
        self.address = self.call("init", backend=backend, provider=provider)["address"]

    def call(self, op: str, timeout: float = 300.0, **kw) -> dict:
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        if not _readable(self.p.stdout, timeout):
            self.p.kill()
            raise RuntimeError(f"benchmark worker: no answer to {op} in {timeout} s")
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker died during {op} (rc={self.p.wait(5)})")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(reply["error"])
        return reply

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"op": "exit"}\n')
                self.p.stdin.flush()
                self.p.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_target(backend: str, provider: str | None, wls: list, args, bar) -> list[dict]:
    rows = []
    tx, rx = Endpoint(backend, provider), Endpoint(backend, provider)
    try:
        tx.call("connect", address=rx.address)
        rx.call("accept")
        for w in wls:
            src_size, dst_size = region_bytes(w)
            src, dst = tx.call("alloc", size=src_size), rx.call("alloc", size=dst_size)
            mode = "both" if backend == "libfabric" and w.kind == "page" else "python"
            r = tx.call("run", spec=w.to_dict(), region=src["region"], desc=dst["desc"], mode=mode,
                        budget_s=args.budget, min_iters=3, max_iters=200)
            for name, lat in ((backend, r["lat"]), (f"{backend}-raw-c", r["lat_raw"])):
                if not lat:
                    continue
                total = sum(lat)
                rows.append({
                    "backend": name, "provider": provider or {"nixl": "ucx", "mooncake": "tcp", "shmem": "memfd"}[backend],
                    "workload": w.name, "kind": w.kind, "layout": w.layout or None,
                    "page_bytes": w.page_bytes, "write_bytes": r["bytes"] // r["writes"],
                    "writes_per_request": r["writes"], "batches_per_request": r["batches"],
                    "bytes_per_request": r["bytes"], "requests": len(lat),
                    "gbps": r["bytes"] * len(lat) / total / 1e9,
                    "writes_per_s": r["writes"] * len(lat) / total,
                    "p50_ms": statistics.median(lat) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
                })
            tx.call("free", region=src["region"])
            rx.call("free", region=dst["region"])
            bar.update(1)
    finally:
        tx.stop()
        rx.stop()
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    series = list(dict.fromkeys(f"{r['backend']}/{r['provider']}" for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(names)), 5))
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        vals = {r["workload"]: r["gbps"] for r in rows if f"{r['backend']}/{r['provider']}" == s}
        ax.bar([j + i * width for j in range(len(names))], [vals.get(n, 0) for n in names], width, label=s)
    ax.axhline(result["memcpy_gbps"], color="k", ls="--", lw=1, label=f"memcpy {result['memcpy_gbps']:.1f}")
    if "memcpy_256k_pages_gbps" in result:
        ax.axhline(result["memcpy_256k_pages_gbps"], color="k", ls=":", lw=1,
                   label=f"memcpy 256K pages {result['memcpy_256k_pages_gbps']:.1f}")
    ax.axhline(result["tcp_loopback_gbps"], color="gray", ls=":", lw=1,
               label=f"TCP loopback {result['tcp_loopback_gbps']:.1f}")
    if "process_vm_writev_gbps" in result:
        ax.axhline(result["process_vm_writev_gbps"], color="brown", ls="-.", lw=1,
                   label=f"process_vm_writev {result['process_vm_writev_gbps']:.1f}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("GB/s")
    ax.set_title("KV transfer bandwidth by backend (loopback, one writer, one reader)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="small workloads, short budget (< 1 min)")
    ap.add_argument("--backends", help="comma list of backend[:provider], e.g. libfabric:tcp,nixl")
    ap.add_argument("--workloads", help="comma list of workload names (see transfer_workloads.py)")
    ap.add_argument("--budget", type=float, help="seconds per (target, workload)")
    ap.add_argument("--request-mib", type=int, help="bytes per request of the page-* workloads (MiB)")
    ap.add_argument("--limits-mib", type=int, help="bytes moved by the memcpy / TCP limit probes (MiB)")
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    args.budget = args.budget or (0.3 if args.quick else 2.0)
    wls = workloads(args.quick, args.request_mib)
    if args.workloads:
        keep = set(args.workloads.split(","))
        wls = [w for w in wls if w.name in keep]
        if not wls:
            ap.error(f"no workload matches {args.workloads}")
    targets = TARGETS
    if args.backends:
        want = [tuple((b.split(":") + [None])[:2]) for b in args.backends.split(",")]
        targets = [t for t in TARGETS if t in want or (t[0], None) in want]
    skipped = {}
    usable = []
    for b, p in targets:
        ok, why = available(b)
        (usable.append((b, p)) if ok else skipped.setdefault(b, why))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"host": record.machine.host, "cpus": record.machine.cores, "quick": args.quick,
              "time": record.date, "skipped": skipped}
    with tqdm(total=len(usable) * len(wls) + 4, desc="transfer bench", unit="cell") as bar:
        size = (args.limits_mib or (64 if args.quick else 256)) << 20
        result["memcpy_gbps"] = memcpy_gbps(size)
        bar.update(1)
        result["memcpy_256k_pages_gbps"] = memcpy_pages_gbps(size)
        bar.update(1)
        result["tcp_loopback_gbps"] = tcp_loopback_gbps(size)
        bar.update(1)
        result["process_vm_writev_gbps"] = process_vm_writev_gbps(size)
        bar.update(1)
        rows = []
        for b, p in usable:
            bar.set_postfix_str(f"{b}{':' + p if p else ''}")
            rows += run_target(b, p, wls, args, bar)
    result["rows"] = rows
    # One run, no repeats: each row's p50/p99 are over its requests (the "requests" field), one cell each.
    record.write(args.out / "transfer.json", result, indent=1, notes=[
        f"budget {args.budget} s per (backend, workload) cell, 3 to 200 requests each; p50/p99 over a cell's requests",
        "memcpy_gbps, memcpy_256k_pages_gbps, tcp_loopback_gbps, process_vm_writev_gbps: the limits, "
        "measured in this run before the backends"])
    plot(result, args.out / "transfer.png")
    for r in rows:
        tqdm.write(f"{r['backend']:>16} {r['provider']:>5} {r['workload']:>20}  {r['gbps']:6.2f} GB/s  "
                   f"{r['writes_per_s']:10.0f} writes/s  p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms")
    tqdm.write(f"memcpy {result['memcpy_gbps']:.2f} GB/s (256 KiB scattered pages "
               f"{result['memcpy_256k_pages_gbps']:.2f}), TCP loopback {result['tcp_loopback_gbps']:.2f} GB/s, "
               f"process_vm_writev {result['process_vm_writev_gbps']:.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
