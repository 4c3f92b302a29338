"""Command line of the launcher; see ``python -m sglang_disagg.launch --help``."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time

from sglang_disagg.launch import dryrun, gpu, keys
from sglang_disagg.launch.client import chat
from sglang_disagg.launch.config import DrainMode, LaunchConfig, Mode, Role
from sglang_disagg.launch.deploy import load as load_deployment
from sglang_disagg.launch.preflight import PreflightError, check_cuda, ephemeral_overlap
from sglang_disagg.launch.process import StartupError, log_tail
from sglang_disagg.launch.stack import Stack
from sglang_disagg.models import DEFAULT_MODEL, ModelError

EPILOG = """Modes: messenger (default) = decoders allocate KV pages and ask prefill servers
to fill them through sglang_disagg's transfer backends (--backend shmem|libfabric|nixl|mooncake,
--provider tcp for libfabric); the router sits in front of the decoders only.
upstream = SGLang's own PD path (--backend mooncake|nixl), router in PD mode.

Arguments not listed here are passed through to every SGLang server,
e.g. --chunked-prefill-size 256. Built-in models (random weights, for plumbing,
tests and benchmarks): tiny-llama, tiny-qwen3, tiny-qwen2, small-llama, tiny-deepseek-v3;
smollm2-135m (the default) is a real model converted on first use.

Data parallelism, per server: --prefill-attn-dp/--decode-attn-dp (attention DP inside the TP
group) or --prefill-dp/--decode-dp (replicas of it); a colocated server takes the prefill
ones. In messenger mode on CPU only; upstream and colocated run what SGLang runs. SGLang's own
--attn-dp-size/--dp-size/--enable-dp-attention are refused in messenger mode: the launcher's
flags also size each server's cores and GPUs and its checks.

GPUs (--device cuda): prefill on the first --prefill-tp GPUs, decode on the next --decode-tp,
or sharing GPUs (each with --shared-gpu-fraction of their memory) when there are too few;
--prefill-gpus/--decode-gpus choose them. --dry-run prints what would run, on any machine
(--gpus N plans for a machine with N GPUs).

A deployment file: --config FILE --node NAME starts one of its groups (flags override the
file; with --dry-run, after the checks a start makes that do not depend on this machine);
"render k8s|ome|slurm FILE [--validate]" prints Kubernetes manifests, OME objects or a Slurm
batch script for it.

HTTP keys: off loopback (--host, a deployment file) every SGLang server and the router ask for
keys derived from the deployment's shared secret: clients send the API key (LOG_DIR/api-key,
said at start) as "Authorization: Bearer KEY"; the admin key (LOG_DIR/admin-key) opens SGLang's
admin endpoints and the router's /workers. "key api|admin [--secret-file FILE]" prints one,
derived from the secret. On 127.0.0.1 (--role all, colocated) serving takes no key, but any user
of this machine reaches loopback: the admin endpoints and the router's /workers still take the
admin key (LOG_DIR/admin-key)."""


# argparse destination -> LaunchConfig field
FIELDS = {"role": "role", "model_path": "model", "port": "port", "host": "host", "mode": "mode",
          "backend": "backend", "provider": "provider", "rails": "rails", "device": "device", "prefill_tp": "prefill_tp",
          "decode_tp": "decode_tp", "prefill_attn_dp": "prefill_attn_dp", "decode_attn_dp": "decode_attn_dp",
          "prefill_dp": "prefill_dp", "decode_dp": "decode_dp", "dtype": "dtype",
          "max_total_tokens": "max_total_tokens",
          "page_size": "page_size", "prefill_url": "prefill_urls", "decode_url": "decode_urls",
          "prefill_messenger": "prefill_messengers", "log_dir": "log_dir", "startup_timeout": "startup_timeout_s",
          "transfer_timeout": "transfer_timeout_s", "link_recheck": "link_recheck_s",
          "migration_rate": "migration_rate_mb_s",
          "sse_keepalive_secs": "sse_keepalive_s", "drain_timeout": "drain_timeout_s", "pin_cores": "pin_cores",
          "drain_mode": "drain_mode", "router": "router_url", "member_url": "member_url",
          "stream": "stream", "decode_prefix_reuse": "reuse_prefix",
          "secret_file": "secret_file", "attention_backend": "attention_backend",
          "enable_deterministic_inference": "deterministic", "gpus": "gpus", "prefill_gpus": "prefill_gpus",
          "decode_gpus": "decode_gpus", "shared_gpu_fraction": "shared_gpu_fraction",
          "tls_cert_path": "tls_cert_path", "tls_key_path": "tls_key_path"}


def _rails_flag(text: str) -> tuple[str, ...]:
    from sglang_disagg.rails.choose import parse_flag

    try:
        return parse_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.launch", epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", type=Role, choices=list(Role), default=None,
                    metavar="{" + ",".join(r.value for r in Role) + "}", help="required unless --config names it")
    ap.add_argument("--config", default=None, help="a deployment TOML file (launch/deployment.example.toml); "
                                                   "flags given here override it")
    ap.add_argument("--node", default=None, help="with --config: the group (or 'router') to start on this machine")
    ap.add_argument("--model-path", default=DEFAULT_MODEL, help="built-in model name or a model directory")
    ap.add_argument("--port", type=int, default=30000,
                    help="front door: the router (all/router) or the server; the stack also uses the 9 ports above")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--mode", type=Mode, choices=list(Mode), default=Mode.MESSENGER,
                    metavar="{" + ",".join(m.value for m in Mode) + "}")
    ap.add_argument("--backend", "--transfer-backend", dest="backend", default=None,
                    help="messenger: shmem (default for --role all on CPU), libfabric (default across machines "
                         "and on CUDA), nixl, mooncake; upstream: mooncake (default), nixl")
    ap.add_argument("--provider", default=None,
                    help="libfabric provider: tcp (default), efa/verbs on such hardware; shm is refused (libfabric "
                         "1.17's shm cannot be bounded when a peer dies: use shmem on one host)")
    ap.add_argument("--rails", type=_rails_flag, default=(), metavar="auto|NAME[,NAME...]",
                    help="messenger, libfabric or nixl: the interfaces KV writes leave through, one endpoint "
                         "each (auto: every interface that is up with IPv4, not loopback or a bridge); default: "
                         "one endpoint on --host. The control connection stays on --host")
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
    ap.add_argument("--migration-rate", type=float, default=0.0, metavar="MB_S",
                    help="decode: cap on the bytes/s (in MB/s) this decoder's outgoing live migrations write "
                         "together, so a drain does not starve the links' other traffic (0: no cap)")
    ap.add_argument("--link-recheck", type=float, default=1.0,
                    help="messenger: seconds a decoder keeps a prefill server whose last requests failed out "
                         "of use before trying it again (doubling while it keeps failing, up to 30)")
    ap.add_argument("--sse-keepalive-secs", type=float, default=0.0, metavar="S",
                    help="router: after S seconds without output on a stream, send an SSE comment line "
                         "(': ping'), so an idle-timeout proxy in front keeps it open; 0 (default) sends none, "
                         "as a plain SGLang server does: clients that parse every line as JSON (SGLang's "
                         "bench_serving) fail on comments")
    ap.add_argument("--secret-file", default=None,
                    help="file holding the deployment's shared secret: every prefill and decode server proves it "
                         "to its peers (messenger), and off loopback every node derives its HTTP keys from it "
                         "(default for --role all: a new one in the log dir; or set SGLANG_DISAGG_SECRET)")
    ap.add_argument("--tls-cert-path", default=None,
                    help="router (--role all/router): serve the front door over HTTPS with this PEM certificate")
    ap.add_argument("--tls-key-path", default=None, help="router: the PEM private key of --tls-cert-path")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--attention-backend", default=None,
                    help="default: torch_native on CPU; on CUDA fa3 with the messenger (its KV pool is HND: "
                         "fa3, trtllm_mha, torch_native read it), SGLang's choice otherwise")
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="SGLang's batch-invariant kernels on every server (equivalence runs in bf16)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="--device cuda: GPUs on this machine (default: those visible); with --dry-run, plan "
                         "for a machine with this many")
    ap.add_argument("--prefill-gpus", type=_gpu_ids, default=(), metavar="IDS",
                    help="--device cuda: the prefill server's GPUs, one per TP rank, evenly spaced (e.g. 0,1); "
                         "default: the first --prefill-tp")
    ap.add_argument("--decode-gpus", type=_gpu_ids, default=(), metavar="IDS",
                    help="--device cuda: the decode server's GPUs (default: the next --decode-tp, or the last "
                         "ones, shared with prefill, when there are too few)")
    ap.add_argument("--shared-gpu-fraction", type=float, default=gpu.DEFAULT_SHARE,
                    help="--device cuda: share of a GPU's memory each server's weights and KV pool take when "
                         "prefill and decode share that GPU")
    ap.add_argument("--dry-run", action="store_true",
                    help="print each process's command line and the environment the launcher sets, start nothing")
    ap.add_argument("--pin-cores", action="store_true",
                    help="--role all on CPU: pin the prefill server (with the router) and the decode server "
                         "to their own half of the cores")
    ap.add_argument("--tp", type=int, default=None, help="TP size of a single-server role")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--prefill-attn-dp", type=int, default=1, metavar="N",
                    help="attention DP of the prefill (or colocated) server: its --prefill-tp ranks form N groups "
                         "of tp/N attention ranks, each its own scheduler and KV pool, the MLP/MoE over all "
                         "ranks (SGLang's --attn-dp-size); N must divide --prefill-tp")
    ap.add_argument("--decode-attn-dp", type=int, default=1, metavar="N",
                    help="attention DP of the decode server (as --prefill-attn-dp); the messenger pairs attention "
                         "groups, so KV sizes are checked as prefill tp/N against decode tp/N")
    ap.add_argument("--prefill-dp", type=int, default=1, metavar="N",
                    help="replica DP of the prefill (or colocated) server: N copies of its --prefill-tp ranks "
                         "behind SGLang's data-parallel controller, each with its own model and KV pool "
                         "(SGLang's --dp-size); tp x N ranks, each a core (CPU) or GPU; not with --prefill-attn-dp")
    ap.add_argument("--decode-dp", type=int, default=1, metavar="N",
                    help="replica DP of the decode server (as --prefill-dp)")
    ap.add_argument("--dtype", default=None, help="default: float32 for built-in models, SGLang's choice otherwise")
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool size per server (CPU)")
    ap.add_argument("--prefill-url", action="append", default=[], help="router role: http://host:port[@bootstrap]")
    ap.add_argument("--decode-url", action="append", default=[], help="router role: http://host:port")
    ap.add_argument("--log-dir", default=None, help="where server logs go (default: a new temp dir)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM, seconds in-flight requests may take to finish before everything stops")
    ap.add_argument("--drain-mode", type=DrainMode, choices=list(DrainMode), default=DrainMode.WAIT,
                    help="--role decode, on SIGTERM: wait (default) lets running requests finish here within "
                         "--drain-timeout; migrate moves them to --router's other decoders first (their streams "
                         "stay on this decoder's HTTP front end until they end), then waits for what could not move")
    ap.add_argument("--router", default=None, metavar="URL",
                    help="--role decode (messenger): the deployment's router; this decoder joins its worker list "
                         "once up and leaves it when it drains")
    ap.add_argument("--member-url", default=None, metavar="URL",
                    help="--role decode: the URL the router lists this decoder at (default http://HOST:PORT+2)")
    ap.add_argument("--smoke", action="store_true",
                    help="start, send one chat completion through the front door, print it, stop; exit 0 on success")
    return ap


def _gpu_ids(text: str) -> tuple[int, ...]:
    try:
        return gpu.parse_ids(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fields(ns: dict) -> dict:
    out = {FIELDS[k]: (tuple(v) if isinstance(v, list) else v) for k, v in ns.items() if k in FIELDS}
    if ns.get("tp") is not None:
        out["prefill_tp"] = out["decode_tp"] = ns["tp"]
    return out


def parse(argv: list[str]) -> tuple[LaunchConfig, bool]:
    """The launch configuration and whether --smoke was given."""
    cfg, smoke, _ = parse_run(argv)
    return cfg, smoke


def parse_run(argv: list[str]) -> tuple[LaunchConfig, bool, bool]:
    """parse(), and whether --dry-run was given."""
    ap = _parser()
    args, extra = ap.parse_known_args(argv)
    if args.config is None:
        if args.node is not None:
            ap.error("--node names a node of a --config file")
        if args.role is None:
            ap.error("--role is required (or --config FILE --node NAME)")
        fields = _fields(vars(args))
        return LaunchConfig(**fields, extra_args=tuple(extra)), args.smoke, args.dry_run
    if args.node is None:
        ap.error("--config needs --node NAME: the group (or 'router') this machine runs")
    # Only the flags actually given override the file: parse again with no defaults.
    quiet = _parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    given, _ = quiet.parse_known_args(argv)
    base = load_deployment(args.config).launch_config(args.node)
    cfg = dataclasses.replace(base, **_fields(vars(given)), extra_args=base.extra_args + tuple(extra))
    return cfg, args.smoke, args.dry_run


def say(msg: str) -> None:
    print(f"[sglang-disagg] {msg}", flush=True)


SMOKE_QUESTION = "What is the capital of France?"  # smollm2-135m, greedy: "The capital of France is Paris."


def smoke(stack: Stack) -> None:
    t0 = time.monotonic()
    out = chat(stack.url, SMOKE_QUESTION, stack.cfg.served_model_name, max_tokens=32, **stack.client_kw)
    dt = time.monotonic() - t0
    n = out["usage"]["completion_tokens"]
    say(f"asked {SMOKE_QUESTION!r} ({n} tokens in {dt * 1000:.0f} ms, {n / dt:.1f} tok/s end to end); answer:")
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


def keys_lines(stack: Stack) -> list[str]:
    """What a client needs to know about keys, said at start (keys.py)."""
    d = stack.log_dir
    if stack.scope is keys.Scope.NONE:
        return [(f"HTTP keys: none; every HTTP port is bound to {stack.cfg.host} (loopback): every user of this "
                 "machine can send requests and use the admin endpoints (no secret here to derive a key from)")]
    if stack.scope is keys.Scope.ADMIN:
        return [(f"HTTP keys: admin only; every HTTP port is bound to {stack.cfg.host} (loopback): other users of "
                 "this machine can send requests (no key); the admin endpoints (/flush_cache, weight updates) and the "
                 f"router's /workers, /flush_cache, /get_loads take the admin key in {d / keys.ADMIN_KEY_FILE} "
                 "('Authorization: Bearer <admin key>')")]
    return ["HTTP keys: on (HTTP ports of this deployment reach beyond this machine); clients send "
            "'Authorization: Bearer <API key>'",
            f"  API key: {d / keys.API_KEY_FILE} (this project's clients read {keys.API_KEY_ENV}; OpenAI SDKs "
            f"OPENAI_API_KEY): export {keys.API_KEY_ENV}=$(cat {d / keys.API_KEY_FILE})",
            f"  admin key (SGLang's admin endpoints, the router's /workers): {d / keys.ADMIN_KEY_FILE}"]


def serve(stack: Stack) -> int:
    say(f"serving on {stack.url} (OpenAI-compatible); logs in {stack.log_dir}; Ctrl-C to stop")
    auth = f"-H \"Authorization: Bearer $(cat {stack.log_dir / keys.API_KEY_FILE})\" " if stack.api_key else ""
    tls = f"--cacert {stack.cfg.tls_cert_path} " if stack.cfg.tls_cert_path else ""
    say("try: curl -s " + tls + stack.url + "/v1/chat/completions " + auth + "-H 'Content-Type: application/json' "
        "-d '{\"model\": \"" + stack.cfg.served_model_name + "\", \"messages\": [{\"role\": \"user\", "
        "\"content\": \"" + SMOKE_QUESTION + "\"}], \"max_tokens\": 32, \"temperature\": 0}'")
    while True:
        time.sleep(1)
        dead = stack.dead()
        if dead:
            p = dead[0]
            say(f"{p.spec.name} exited with code {p.poll()}; last lines of {p.log_path}:\n{log_tail(p.log_path)}")
            return 1


_terminated = False


def migrate_away(stack: Stack, say) -> object | None:
    """--drain-mode migrate on SIGTERM: the router's other decoders take this one's running
    requests (launch/drain.py); returns what tells Stack.stop that relayed streams still run
    here (their clients stay on this front end), or None when nothing migrated."""
    from sglang_disagg.launch.drain import DrainFailed, DrainTarget, drain, relaying

    target = DrainTarget.local(stack.cfg.host, stack.cfg.port, stack.cfg.member)
    try:
        status = drain(target, stack.admin_key, router=stack.cfg.router_url,
                       timeout_s=stack.cfg.drain_timeout_s, say=say)
    except DrainFailed as e:
        say(f"no migration ({e}); running requests finish here")
        return None
    return relaying(target, stack.admin_key) if status.get("migrated") else None


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM drains (in-flight requests finish, within --drain-timeout), then every child
    is stopped; Ctrl-C stops at once."""
    global _terminated
    _terminated = True
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:
        from sglang_disagg.launch.render import main as render

        return render(argv[1:])
    if argv[:1] == ["key"]:
        return keys.main(argv[1:])
    if argv[:1] == ["drain"]:
        from sglang_disagg.launch.drain import main as drain

        return drain(argv[1:])
    try:
        cfg, do_smoke, dry_run = parse_run(argv)
        if dry_run:
            sys.stdout.write(dryrun.render(cfg))
            return 0
        if cfg.device == "cuda" and cfg.role is not Role.ROUTER:
            # Before anything starts (or a model is generated): CUDA, its kernels, the GPU count.
            cfg = dataclasses.replace(cfg, gpus=check_cuda(cfg))
        stack = Stack.for_config(cfg)
    except (ValueError, FileNotFoundError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        say(f"starting {cfg.role.value} with model {stack.model_path or '-'}, {cfg.describe_transfer()}; "
            f"logs in {stack.log_dir}")
        for what, port in cfg.ports.all(cfg.role, cfg.mode).items():
            say(f"  port {port}: {what}")
        for line in keys_lines(stack):
            say(line)
        overlap = ephemeral_overlap(cfg)
        if overlap:
            say(f"warning: {overlap}")
        stack.start(progress=say)
        say(f"up in {stack.startup_s:.1f}s; listening on (also in {stack.log_dir}/ports.txt):")
        for line in (stack.log_dir / "ports.txt").read_text().splitlines():
            say(f"  {line}")
        if do_smoke:
            smoke(stack)
            return 0
        return serve(stack)
    except (PreflightError, StartupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("stopping")
        return 1 if do_smoke else 0 if _terminated else 130
    finally:
        relays, t0 = None, time.monotonic()
        if _terminated and cfg.drain_mode is DrainMode.MIGRATE:
            relays = migrate_away(stack, say)
        left = max(0.0, cfg.drain_timeout_s - (time.monotonic() - t0))  # --drain-timeout bounds both
        if _terminated:
            say(f"draining in-flight requests (at most {left:.0f}s"
                + (", and relayed streams until they end" if relays else "") + "), then stopping")
        stack.stop(drain_s=left if _terminated else 0.0, hold=relays)


if __name__ == "__main__":
    sys.exit(main())
