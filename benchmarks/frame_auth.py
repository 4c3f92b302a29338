"""What sealing every control frame costs (backends/frames.py), per order and per write notification.

    python benchmarks/frame_auth.py --out benchmarks/results/frame_auth [--repeats 2000]

Two measurements in one process, so their ratio means something on a noisy machine:
- the MAC work alone: seal + open (HMAC-SHA256 over sequence, header and payload, both ends)
  of the real payloads: a PrefillOrder as the decoder encodes it for 512, 4096 and 32768-token
  prompts (16-token pages), and a NOTIFY(tag, count) as a shmem writer sends one per batch;
- the baseline: one such frame's one-way trip on a real control connection (two shmem
  backends on loopback, `Peer.send` to `recv`; NOTIFY: `Peer.notify` to the credit landing),
  MAC included, median of `--repeats` / 10 ping-pongs halved;
- for an order, what its receiver pays anyway: `wire.decode` of it (bounded JSON, checked fields).
Writes DIR/frame_auth.json (medians in microseconds, the MAC's share of the trip) and
DIR/frame_auth.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time
from pathlib import Path

from sglang_disagg.backends import BackendConfig, create_backend, frames
from sglang_disagg.messenger import wire

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402

HEADER = struct.Struct("!IB")


def order_payload(tokens: int) -> bytes:
    pages = (tokens + 15) // 16
    return wire.encode(wire.PrefillOrder(rid="0123456789abcdef0123456789abcdef", tag=123456,
                                         token_ids=tuple(range(1000, 1000 + tokens - 1)),
                                         dst_pages=tuple(range(5000, 5000 + pages)), start_page=0, last_token=7))


# Every timing sample of a figure, microseconds, by figure name ("order-512-tokens/mac_us"):
# the document keeps their deciles beside the medians (thousands of samples per figure).
SAMPLES: dict[str, list[float]] = {}


def _keep(name: str | None, times_ns: list[int], scale: float = 1e3) -> None:
    if name:
        SAMPLES[name] = [t / scale for t in times_ns]


def deciles(values: list[float]) -> dict[str, float]:
    """min, p10 ... p90, max of `values` (nearest rank), rounded to 0.001."""
    v = sorted(values)
    out = {"samples": len(v), "min": round(v[0], 3)}
    out |= {f"p{q}": round(v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))], 3) for q in range(10, 100, 10)}
    return out | {"max": round(v[-1], 3)}


def median_us(fn, repeats: int, name: str | None = None) -> float:
    """Median wall time of `fn()`, microseconds (every sample kept under `name`)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t)
    _keep(name, times)
    return statistics.median(times) / 1e3


def mac_us(payload: bytes, repeats: int, name: str | None = None) -> float:
    """Median seal + open of one frame carrying `payload`, microseconds."""
    d, a = (frames.FrameKeys.derive(b"k" * 32, b"d" * 32, b"a" * 32, dialed) for dialed in (True, False))
    header = HEADER.pack(len(payload), 2)

    def one() -> None:
        tag = d.seal(header, payload)
        d.commit()
        a.open(header, payload, tag)
    return median_us(one, repeats, name)


def decode_us(payload: bytes, repeats: int, name: str | None = None) -> float:
    """Median wire.decode of `payload`, microseconds: what the receiver already pays per order."""
    return median_us(lambda: wire.decode(payload), repeats, name)


def trip_us(payloads: dict[str, bytes], repeats: int) -> dict[str, float]:
    """Median one-way trip of a MSG (and a NOTIFY) between two shmem backends on loopback."""
    cfg = BackendConfig(host="127.0.0.1", port=0, secret=b"s" * 32)
    a, b = create_backend("shmem", cfg), create_backend("shmem", cfg)
    out = {}
    try:
        ab = a.connect(b.address, 5.0)
        ba = b.peers()[0]  # b admitted a before its HELLO reply reached connect()
        for name, payload in payloads.items():
            times = []
            for _ in range(repeats):
                t = time.perf_counter_ns()
                ab.send(payload)
                b.recv(5.0)
                ba.send(payload)
                a.recv(5.0)
                times.append(time.perf_counter_ns() - t)
            _keep(f"{name}/trip_us", times, 2e3)
            out[name] = statistics.median(times) / 2e3
        times = []
        for i in range(repeats):
            tag = 1 + i
            fut = b.expect(tag, 1, 5.0)
            t = time.perf_counter_ns()
            ab.notify(tag, 1)
            fut.wait(5.0)
            times.append(time.perf_counter_ns() - t)
        _keep("notify/trip_us", times)
        out["notify"] = statistics.median(times) / 1e3
    finally:
        a.close()
        b.close()
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["frames"])
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [doc["frames"][n]["trip_us"] for n in names], 0.4, label="one-way trip (MAC included)")
    ax.bar([x + 0.2 for x in xs], [doc["frames"][n]["mac_us"] for n in names], 0.4, label="seal + open")
    ax.set_xticks(list(xs), [f"{n}\n{doc['frames'][n]['bytes']} B" for n in names], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("microseconds (median)")
    ax.set_title("control frame authentication: cost against the trip it rides on")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    payloads = {f"order-{n}-tokens": order_payload(n) for n in (512, 4096, 32768)}
    notify = json.dumps({"tag": 123456, "count": 2048}).encode()  # as Peer.notify encodes it
    trips = trip_us(payloads, max(50, args.repeats // 10))
    rows = {}
    for name, payload in payloads.items() | {"notify": notify}.items():
        mac = mac_us(payload, args.repeats, f"{name}/mac_us")
        rows[name] = {"bytes": len(payload) + HEADER.size + frames.TAG_BYTES, "mac_us": round(mac, 3),
                      "trip_us": round(trips[name], 3), "mac_share_of_trip": round(mac / trips[name], 4)}
        if name != "notify":
            dec = decode_us(payload, max(20, args.repeats // 10), f"{name}/decode_us")
            rows[name] |= {"decode_us": round(dec, 3), "mac_over_decode": round(mac / dec, 4)}
    doc = {"python": record.machine.python, "frames": dict(sorted(rows.items())),
           "deciles_us": {k: deciles(v) for k, v in sorted(SAMPLES.items())}}
    record.write(args.out / "frame_auth.json", doc, indent=2, notes=[
        "each figure is the median of its timing samples (--repeats per MAC figure; a tenth of that, at least "
        "50 per trip and 20 per decode figure); deciles_us: every figure's sample distribution",
        "trip_us: half a ping-pong between two shmem backends on loopback, MAC included; notify: one way"])
    plot(doc, args.out / "frame_auth.png")
    print(json.dumps(doc["frames"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
