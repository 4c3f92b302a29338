"""Print this node's topology and the rail plan of a server with one TP rank per GPU (or one
CPU rank), as the device check records it: ``python -m sglang_disagg.rails [--json FILE]``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .plan import choose_rails, describe, plan_rails
from .topology import NicKind, read_topology


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.rails", description=__doc__)
    ap.add_argument("--sysfs", default="/sys", help="a sysfs tree (default: this machine's)")
    ap.add_argument("--kind", choices=[k.value for k in NicKind], default=None,
                    help="rdma (verbs, efa) or net (tcp); default: rdma when the node has any, else net")
    ap.add_argument("--json", help="also write topology and plan to this file")
    args = ap.parse_args(argv)
    topo = read_topology(args.sysfs)
    kind = NicKind(args.kind) if args.kind else (NicKind.RDMA if topo.rails(NicKind.RDMA) else NicKind.NET)
    devices = [f"cuda:{g.index}" for g in topo.gpus] or ["cpu"]
    try:
        plan = plan_rails(devices, topo, choose_rails(topo, kind))
    except ValueError as e:
        print(f"no rail plan: {e}", file=sys.stderr)
        return 1
    print("\n".join(describe(plan, topo, devices)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": kind.value, "devices": devices, "topology": dataclasses.asdict(topo),
                       "plan": dataclasses.asdict(plan)}, f, indent=1, default=lambda o: o.value)  # NicKind
    return 0


if __name__ == "__main__":
    sys.exit(main())
