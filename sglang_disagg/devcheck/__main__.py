"""python -m sglang_disagg.devcheck --device cuda --out DIR [--parts a,b] [--part-timeout S]

Each part runs in its own process under its own timeout; the JSON file
DIR/devcheck-<device>.json is rewritten as each part ends, so a part that hangs or a
machine taken back mid-run still leaves every finished part's result. Exit 0 only when
every part ran and passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from pathlib import Path

PARTS = ("streaming", "bandwidth", "fdpass")


def _part(name: str, device: str) -> dict:
    secret = bytes.fromhex(os.environ["SGLANG_DISAGG_DEVCHECK_SECRET"])
    if name == "streaming":
        from .streaming import run
    elif name == "bandwidth":
        from .bandwidth import run
    else:
        from .handoff import run
    return run(device, secret)


def _environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.devcheck")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=".")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--part-timeout", type=float, default=90.0)
    ap.add_argument("--run-part", help=argparse.SUPPRESS)  # internal: one part, JSON on stdout
    args = ap.parse_args()
    if args.run_part:
        print(json.dumps(_part(args.run_part, args.device)))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    out = Path(args.out) / f"devcheck-{args.device.partition(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": args.device, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "environment": _environment(args.device), "parts": {}}
    env = dict(os.environ, SGLANG_DISAGG_DEVCHECK_SECRET=secrets.token_hex(32))
    for name in parts:
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, "-m", "sglang_disagg.devcheck", "--device", args.device,
                                "--run-part", name], capture_output=True, text=True, env=env,
                               timeout=args.part_timeout)
            lines = p.stdout.strip().splitlines()
            part = json.loads(lines[-1]) if p.returncode == 0 and lines else \
                {"ok": False, "error": f"exit {p.returncode}: {p.stderr.strip()[-2000:]}"}
        except subprocess.TimeoutExpired as e:
            part = {"ok": False, "error": f"timed out after {args.part_timeout:.0f} s",
                    "stderr": (e.stderr or b"")[-2000:].decode(errors="replace") if isinstance(e.stderr, bytes)
                    else str(e.stderr or "")[-2000:]}
        part["seconds"] = round(time.monotonic() - t0, 3)
        result["parts"][name] = part
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{name}: {'ok' if part.get('ok') else 'FAILED'} in {part['seconds']} s", flush=True)
    print(f"wrote {out}")
    return 0 if all(p.get("ok") for p in result["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
