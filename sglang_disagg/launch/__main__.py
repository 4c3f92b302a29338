"""Command line of the launcher; see ``python -m sglang_disagg.launch --help``."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from sglang_disagg.launch.client import chat
from sglang_disagg.launch.config import LaunchConfig, Mode, Role
from sglang_disagg.launch.preflight import PreflightError
from sglang_disagg.launch.process import StartupError, log_tail
from sglang_disagg.launch.stack import Stack
from sglang_disagg.models import DEFAULT_MODEL

EPILOG = """Modes: messenger (default) = decoders allocate KV pages and ask prefill servers
to fill them through sglang_disagg's transfer backends (--backend libfabric|nixl|mooncake,
--provider shm|tcp for libfabric); the router sits in front of the decoders only.
upstream = SGLang's own PD path (--backend mooncake|nixl), router in PD mode.

Arguments not listed here are passed through to every SGLang server,
e.g. --chunked-prefill-size 256. Built-in models (random weights, for plumbing,
tests and benchmarks): tiny-llama (default), tiny-qwen3, small-llama."""


def parse(argv: list[str]) -> tuple[LaunchConfig, bool]:
    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.launch", epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", type=Role, choices=list(Role), required=True,
                    metavar="{" + ",".join(r.value for r in Role) + "}")
    ap.add_argument("--model-path", default=DEFAULT_MODEL, help="built-in model name or a model directory")
    ap.add_argument("--port", type=int, default=30000,
                    help="front door: the router (all/router) or the server; the stack also uses the 7 ports above")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--mode", type=Mode, choices=list(Mode), default=Mode.MESSENGER,
                    metavar="{" + ",".join(m.value for m in Mode) + "}")
    ap.add_argument("--backend", "--transfer-backend", dest="backend", default=None,
                    help="messenger: libfabric (default), nixl, mooncake; upstream: mooncake (default), nixl")
    ap.add_argument("--provider", default=None,
                    help="libfabric provider: shm (default for --role all), tcp (default across machines)")
    ap.add_argument("--page-size", type=int, default=None, help="KV page size in tokens (messenger default 16)")
    ap.add_argument("--prefill-messenger", action="append", default=[],
                    help="decode role, messenger mode: host:port of a prefill server's messenger (repeatable)")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                    help="messenger: prefill writes each layer's KV as its forward passes the layer "
                         "(--no-stream: a chunk's KV after its forward)")
    ap.add_argument("--decode-prefix-reuse", action=argparse.BooleanOptionalAction, default=True,
                    help="messenger: a decoder asks prefill only for the pages its radix cache lacks")
    ap.add_argument("--transfer-timeout", type=float, default=60.0,
                    help="messenger: seconds a decoder waits for a request's KV before failing it")
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
        role=args.role, model=args.model_path, port=args.port, host=args.host, mode=args.mode,
        backend=args.backend, provider=args.provider, device=args.device, prefill_tp=prefill_tp,
        decode_tp=decode_tp, dtype=args.dtype, max_total_tokens=args.max_total_tokens, page_size=args.page_size,
        prefill_urls=tuple(args.prefill_url), decode_urls=tuple(args.decode_url),
        prefill_messengers=tuple(args.prefill_messenger), extra_args=tuple(extra), log_dir=args.log_dir,
        startup_timeout_s=args.startup_timeout, transfer_timeout_s=args.transfer_timeout, stream=args.stream,
        reuse_prefix=args.decode_prefix_reuse,
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
    say(f"carried by: {carrier(stack)}")


def carrier(stack: Stack, wait_s: float = 3.0) -> str:
    """What moved the KV of the requests so far, from the decoder's own counters."""
    cfg = stack.cfg
    if cfg.role is Role.COLOCATED or cfg.mode is Mode.UPSTREAM:
        return cfg.describe_transfer()
    deadline = time.monotonic() + wait_s
    while True:  # the counters are published a few hundred ms after they change
        stats = stack.messenger_stats("decode") or {}
        if stats.get("requests_carried") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return (f"{cfg.describe_transfer()}: {stats.get('requests_carried', 0)} request(s) through the messenger, "
            f"{stats.get('writes_received', 0)} KV writes received by the decoder")


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
        say(f"starting {cfg.role.value} with model {stack.model_path or '-'}, {cfg.describe_transfer()}; "
            f"logs in {stack.log_dir}")
        for what, port in cfg.ports.all(cfg.role, cfg.mode).items():
            say(f"  port {port}: {what}")
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
