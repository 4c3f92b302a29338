"""Command line of the launcher; see ``python -m sglang_disagg.launch --help``."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from sglang_disagg.launch.client import chat
from sglang_disagg.launch.config import LaunchConfig, Role, TransferBackend
from sglang_disagg.launch.preflight import PreflightError
from sglang_disagg.launch.process import StartupError, log_tail
from sglang_disagg.launch.stack import Stack
from sglang_disagg.models import DEFAULT_MODEL

EPILOG = """Arguments not listed here are passed through to every SGLang server,
e.g. --chunked-prefill-size 256. Built-in models (random weights, for plumbing,
tests and benchmarks): tiny-llama (default), tiny-qwen3, small-llama."""


def parse(argv: list[str]) -> tuple[LaunchConfig, bool]:
    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.launch", epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", type=Role, choices=list(Role), required=True,
                    metavar="{" + ",".join(r.value for r in Role) + "}")
    ap.add_argument("--model-path", default=DEFAULT_MODEL, help="built-in model name or a model directory")
    ap.add_argument("--port", type=int, default=30000,
                    help="front door: the router (all/router) or the server; the stack also uses the 6 ports above")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--transfer-backend", type=TransferBackend, default=TransferBackend.MOONCAKE,
                    choices=list(TransferBackend), metavar="{" + ",".join(b.value for b in TransferBackend) + "}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", type=int, default=None, help="TP size of a single-server role")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="default: float32 for built-in models, SGLang's choice otherwise")
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool size per server (CPU)")
    ap.add_argument("--prefill-url", action="append", default=[], help="router role: http://host:port[@bootstrap]")
    ap.add_argument("--decode-url", action="append", default=[], help="router role: http://host:port")
    ap.add_argument("--log-dir", default=None, help="where server logs go (default: a new temp dir)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--smoke", action="store_true",
                    help="start, send one chat completion through the front door, print it, stop; exit 0 on success")
    args, extra = ap.parse_known_args(argv)
    prefill_tp, decode_tp = args.prefill_tp, args.decode_tp
    if args.tp is not None:
        prefill_tp = decode_tp = args.tp
    cfg = LaunchConfig(
        role=args.role, model=args.model_path, port=args.port, host=args.host, backend=args.transfer_backend,
        device=args.device, prefill_tp=prefill_tp, decode_tp=decode_tp, dtype=args.dtype,
        max_total_tokens=args.max_total_tokens, prefill_urls=tuple(args.prefill_url),
        decode_urls=tuple(args.decode_url), extra_args=tuple(extra), log_dir=args.log_dir,
        startup_timeout_s=args.startup_timeout,
    )
    return cfg, args.smoke


def say(msg: str) -> None:
    print(f"[sglang-disagg] {msg}", flush=True)


def smoke(stack: Stack) -> None:
    t0 = time.monotonic()
    out = chat(stack.url, "Say something about disaggregated serving.", max_tokens=32)
    dt = time.monotonic() - t0
    n = out["usage"]["completion_tokens"]
    say(f"completion ({n} tokens in {dt * 1000:.0f} ms, {n / dt:.1f} tok/s end to end):")
    print("    " + out["choices"][0]["message"]["content"], flush=True)


def serve(stack: Stack) -> int:
    say(f"serving on {stack.url} (OpenAI-compatible); logs in {stack.log_dir}; Ctrl-C to stop")
    say("try: curl -s " + stack.url + "/v1/chat/completions -H 'Content-Type: application/json' "
        "-d '{\"model\": \"default\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 32}'")
    while True:
        time.sleep(1)
        dead = stack.dead()
        if dead:
            p = dead[0]
            say(f"{p.spec.name} exited with code {p.poll()}; last lines of {p.log_path}:\n{log_tail(p.log_path)}")
            return 1


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM takes the same clean path as Ctrl-C: every child is stopped."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, do_smoke = parse(sys.argv[1:] if argv is None else argv)
        stack = Stack.for_config(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        say(f"starting {cfg.role.value} with model {stack.model_path or '-'}, backend {cfg.backend.value}; "
            f"logs in {stack.log_dir}")
        stack.start(progress=say)
        say(f"up in {stack.startup_s:.1f}s")
        if do_smoke:
            smoke(stack)
            return 0
        return serve(stack)
    except (PreflightError, StartupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("stopping")
        return 130 if not do_smoke else 1
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
