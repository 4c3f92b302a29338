"""Command lines and environments for each process of a stack (pure: no I/O).

Why each CPU flag is there:
- ``--attention-backend torch_native``: the only attention backend without
  CUDA/Triton kernels.
- ``--max-total-tokens``: the default KV pool is sized from device memory and
  on CPU comes out at millions of tokens (tens of GB).
- ``--skip-server-warmup``: the warm-up request is routed through the PD
  handshake before a router exists, and times out.
- ``--sleep-on-idle``: in PD mode an idle scheduler otherwise spins at 100 %
  of a core; on a small machine the prefill server's spinning starves the
  decode server (one request measured 7 tok/s without, ~130 tok/s with, on
  2 cores). The sleep is a zmq poll, so a new request still wakes it at once.
- ``OMP_NUM_THREADS``: each server sizes its OpenMP pool to the whole machine
  by default, so two servers on 2 cores run 4 compute threads and spin at
  barriers (measured: 34 -> ~190 output tok/s for the upstream stack under
  concurrency). Each server gets threads for the cores it is given: the cores
  the launcher may run on (its affinity: ``taskset``, a container's cpuset, a
  Slurm step's binding), not the machine's count. A decoder launched under
  ``taskset -c 1`` on 2 cores ran 2 OpenMP threads on its one core and froze
  for seconds at a time under load, long enough for its peers to declare it
  silent mid-drain (CI of 6dcbbf6, ``tests/e2e/test_drain_router.py``).
- ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``: SGLang's ``/health`` otherwise runs a
  one-token generation through the scheduler, which a long prefill blocks for seconds; the
  router (checks every 2 s, 2 failures) then declared a busy prefill server dead (measured:
  upstream PD refused a 2048-token prompt on small-llama with "No available prefill
  workers"). A busy server is not a dead one: the probe answers from the HTTP process, and
  a dead scheduler takes its server process down with it.
- messenger decode ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT=1``: a request with no output yet
  (its prompt is being prefilled elsewhere) notices its client went away only when this
  wait times out (SGLang's default 4 s); then its pages on both servers are freed.
- upstream prefill ``--disable-overlap-schedule``: the overlap path records a
  CUDA event. Messenger prefill servers disable it too, on every device: on CPU a
  forward runs synchronously, so overlap would only delay a chunk's KV writes by one
  forward; on CUDA the messenger's hooks take a batch's KV as computed once its
  forward call returned, which under the overlap scheduler it is not yet. Messenger
  decoders keep SGLang's overlap scheduler, as SGLang's own PD decoder does (SGLang
  itself turns it off where it has no overlap path, e.g. speculative decoding on CPU):
  the messenger's per-iteration work happens on the scheduler thread between steps and
  touches only requests that have not joined a batch yet.
- upstream decode ``--disaggregation-decode-retraction-backup cpu_tensor``: the
  default host backup pool calls cudaHostRegister.
- messenger ``SGLANG_USE_HND_KVCACHE=1`` and ``--page-size 16``: the KV pool
  keeps heads before tokens inside a page, so a page's head-shard is one
  contiguous range and moves with one write.

On CUDA none of the CPU settings apply; each server gets its GPUs (gpu.py), built-in
models run bfloat16, messenger servers read their HND pool with fa3 and skip SGLang's
warm-up (_messenger_server says why), CUDA graphs stay on.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from sglang_disagg.backends.auth import SECRET_FILE_ENV
from sglang_disagg.env import CPU_SERVER_ENV, SUBPROCESS_START_ENV
from sglang_disagg.launch import gpu, keys, smg_router
from sglang_disagg.launch.config import LaunchConfig, Mode, Role
from sglang_disagg.messenger.config import ENV as MESSENGER_ENV
from sglang_disagg.messenger.config import MessengerConfig, MessengerRole
from sglang_disagg.rails import choose


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    port: int  # the HTTP port to health-check
    cpus: tuple[int, ...] = ()  # pinned to these cores (sched_setaffinity), inherited by its children
    ports: tuple[tuple[str, int], ...] = ()  # (purpose, port) it binds: named when a bind fails

    def environ(self) -> dict[str, str]:
        return os.environ.copy() | dict(self.env)


def server_cores(cfg: LaunchConfig, role: Role) -> list[int]:
    """The cores a server's ranks get: `--role all` splits the machine between
    prefill and decode, every other role has it all."""
    cores = sorted(os.sched_getaffinity(0)) or [0]
    if cfg.role is not Role.ALL or len(cores) == 1:
        return cores
    half = max(1, len(cores) // 2)
    return cores[:half] if role is Role.PREFILL else cores[half:]


def _pinned(cfg: LaunchConfig, role: Role) -> tuple[int, ...]:
    """--pin-cores: each server of `--role all` on its own cores (its children inherit them);
    the router shares the prefill server's."""
    if not cfg.pin_cores or cfg.device != "cpu" or cfg.role is not Role.ALL:
        return ()
    return tuple(server_cores(cfg, role))


def _threads_env(cfg: LaunchConfig, role: Role, ranks: int) -> dict[str, str]:
    """`ranks`: the server's rank processes, tp * dp (replica DP: each replica's TP ranks are
    processes of their own; attention DP runs inside the TP group, tp)."""
    cores = server_cores(cfg, role)
    env = {"OMP_NUM_THREADS": str(max(1, len(cores) // ranks))}
    if ranks > 1:
        # SGLang's CPU engine binds one OpenMP pool per rank, the rank's entry found by its
        # device id (replica d's rank r: d * tp + r): one core set per rank ("0|1" for TP 2
        # on 2 cores), ranks share cores when there are fewer.
        per = max(1, len(cores) // ranks)
        sets = [cores[(r * per) % len(cores):(r * per) % len(cores) + per] for r in range(ranks)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in sets)
    return env


def _server_base(cfg: LaunchConfig, model_path: str, builtin: bool, port: int, dist_port: int,
                 role: Role) -> list[str]:
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", cfg.host,
        "--port", str(port),
        "--device", cfg.device,
        *cfg.parallel(role).argv(),  # --tp, and --attn-dp-size / --dp-size (parallel.py)
    ]
    par = cfg.parallel(role)
    if par.dp == 1:  # replica DP: SGLang gives each replica a free port of its own (one would clash)
        argv += ["--nccl-port", str(dist_port)]
    if par.attn_dp > 1:
        # Attention DP talks over TCP: SGLang derives 7 ports from --dist-init-addr (else from
        # --port + 233, which collide for a prefill and a decode server one port apart).
        argv += ["--dist-init-addr", f"127.0.0.1:{cfg.ports.attn_dp_base(role)}"]
    # /v1/models names it "tiny-llama" (or the directory's name), not the path it was loaded
    # from: the router (smg) routes OpenAI requests by that name, so clients must know it.
    argv += ["--served-model-name", cfg.served_model_name]
    dtype = cfg.dtype or (_builtin_dtype(cfg) if builtin else None)
    if dtype:
        argv += ["--dtype", dtype]
    if cfg.device == "cpu":
        argv += [
            "--attention-backend", cfg.attention_backend or "torch_native",
            "--max-total-tokens", str(cfg.max_total_tokens),
            "--skip-server-warmup",
            "--sleep-on-idle",
        ]
    elif cfg.device == "cuda":
        argv += _gpus(cfg, role).argv()
        if cfg.cuda_attention_backend:
            argv += ["--attention-backend", cfg.cuda_attention_backend]
        # CUDA graphs stay on (SGLang's default): nothing here disables them.
    elif cfg.attention_backend:
        argv += ["--attention-backend", cfg.attention_backend]
    if cfg.deterministic:
        # Equivalence runs: in bf16 a whole-prompt prefill and a prefix-plus-one-token extend
        # run different kernels and differ in the last bits; batch-invariant ops make them agree.
        argv += ["--enable-deterministic-inference"]
    return argv


def _builtin_dtype(cfg: LaunchConfig) -> str:
    """Built-in models are stored in float32: served so on CPU (exact comparisons), in bfloat16
    on CUDA, as the real models they stand for run and as fa3 requires. Named, not "auto":
    SGLang's auto turns a float32 checkpoint into float16."""
    return "bfloat16" if cfg.device == "cuda" else "float32"


def _gpus(cfg: LaunchConfig, role: Role) -> gpu.ServerGpus:
    plan = cfg.gpu_plan()
    placed = plan.decode if role is Role.DECODE else plan.prefill
    if placed is None:
        raise ValueError(f"no GPUs planned for the {role.value} server")
    return placed


def _env(cfg: LaunchConfig, role: Role, ranks: int, extra: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    env = dict(CPU_SERVER_ENV) if cfg.device == "cpu" else {}
    env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "0"  # /health answers without the scheduler
    env["SGLANG_DISAGG_CLIENT_ABORT_DELAY_S"] = "0.2"  # a client that left frees its pages at once
    if cfg.host not in ("0.0.0.0", "::"):
        # Bootstrap and transfer engines advertise this address to peers.
        env["SGLANG_HOST_IP"] = cfg.host
    if cfg.device == "cpu" and not cfg.host.startswith("127.") and cfg.host != "localhost":
        # Off loopback UCX must reach peers on the host's interfaces: said explicitly, since a
        # UCX_NET_DEVICES=lo inherited from the caller's environment would win over its absence.
        env["UCX_NET_DEVICES"] = "all"
    if cfg.device == "cpu":
        env.update(_threads_env(cfg, role, ranks))
        # Forked, a server's scheduler and detokenizer skip importing torch and SGLang again
        # (hooks.subprocess_start_method): --role all ready in 15 s instead of 33 s here.
        env[SUBPROCESS_START_ENV] = os.environ.get(SUBPROCESS_START_ENV, "fork")
    if cfg.rails and cfg.transfer_backend == "nixl":
        # UCX's own device list: it picks among (and may stripe over) these; the rails json
        # benchmark measures what it does with them.
        names = list(cfg.rails) if cfg.rails != (choose.AUTO,) else choose.interface_names(choose.resolve(cfg.rails))
        env["UCX_NET_DEVICES"] = ",".join(names)
        env["UCX_MAX_RMA_RAILS"] = str(min(len(names), 4))
    env.update(extra or {})
    env.update(dict(cfg.env))
    return tuple(sorted(env.items()))


def messenger_config(cfg: LaunchConfig, role: Role, log_dir: Path | None = None) -> MessengerConfig:
    ports = cfg.ports
    name = role.value
    stats = str(log_dir / f"{name}.messenger.json") if log_dir else ""
    common = dict(backend=cfg.transfer_backend, provider=cfg.transfer_provider, host=cfg.host, name=name,
                  rails=choose.resolve(cfg.rails) if cfg.transfer_backend == "libfabric" else (),
                  stats_file=stats, transfer_timeout_s=cfg.transfer_timeout_s,
                  recheck_s=cfg.link_recheck_s, stream=cfg.stream, reuse_prefix=cfg.reuse_prefix)
    if role is Role.PREFILL:
        return MessengerConfig(role=MessengerRole.PREFILL, port=ports.bootstrap, metrics_port=ports.prefill_metrics,
                               **common)
    prefill = cfg.prefill_messengers or (f"{cfg.host}:{ports.bootstrap}",)
    return MessengerConfig(role=MessengerRole.DECODE, prefill=prefill, metrics_port=ports.decode_metrics,
                           migration_rate_bps=cfg.migration_rate_mb_s * 1e6, **common)


def _messenger_server(cfg: LaunchConfig, role: Role, argv: list[str], log_dir: Path | None) -> tuple:
    argv += ["--page-size", str(cfg.kv_page_size)]
    if role is Role.PREFILL:  # a decoder keeps SGLang's overlap scheduler (module docstring)
        argv += ["--disable-overlap-schedule"]
    if cfg.device != "cpu":  # on CPU _server_base skips it for every server
        # SGLang's warm-up posts a plain /generate and kills its server unless it gets 200.
        # Prefill: the messenger answers plain requests 503 (only decoders' orders are
        # served). Skipped rather than served: recognising "the warm-up" would open a way
        # past that refusal for any client, and a warm-up that bypasses the messenger proves
        # nothing about it. Decode: its warm-up would become an order to a prefill server
        # that may not be up yet (--role decode; or still loading in --role all), and a
        # timeout kills the decoder. The launcher's own checks stand in for both: a decoder
        # is ready once it linked to a prefill server (Stack._wait_links), and --role all
        # is up once a real request went router -> decoder -> prefill (Stack._wait_routable),
        # which also warms both servers' kernels.
        argv += ["--skip-server-warmup"]
    if role is Role.DECODE:
        # A request's last prompt token runs as a one-token extend: mixed with the running
        # decode batch it costs no forward of its own, so decoding never pauses for it.
        argv += ["--enable-mixed-chunk"]
    extra = {"SGLANG_USE_HND_KVCACHE": "1", MESSENGER_ENV: messenger_config(cfg, role, log_dir).to_env()}
    if role is Role.DECODE:
        extra["SGLANG_REQUEST_STATE_WAIT_TIMEOUT"] = "1"  # see the module doc: client aborts during prefill
    if cfg.secret_file:
        extra[SECRET_FILE_ENV] = cfg.secret_file
    return argv, _env(cfg, role, cfg.parallel(role).processes, extra)


def server_spec(cfg: LaunchConfig, role: Role, model_path: str, builtin: bool,
                log_dir: Path | None = None) -> ProcessSpec:
    spec = dataclasses.replace(_server_spec(cfg, role, model_path, builtin, log_dir),
                               ports=tuple(cfg.ports.all(role, cfg.mode).items()))
    scope = keys.scope(cfg)
    # A spec built without a log dir is only looked at (every start, and the dry run, give one):
    # on loopback it goes without its admin key's file; beyond it is refused.
    if scope is keys.Scope.ALL or (scope is keys.Scope.ADMIN and log_dir is not None):
        # Its keys from a file (keys.py; on loopback the admin key only), before the rest:
        # SGLang reads --config first and lets the command line override it.
        if log_dir is None:
            raise ValueError(f"the {spec.name} server's keys go to a file in the log dir: none given")
        spec = dataclasses.replace(spec, argv=spec.argv[:3] + ("--config", str(keys.server_config(log_dir, spec.name)))
                                   + spec.argv[3:])
    multinode = any(a in ("--nnodes", "--dist-init-addr") or a.startswith(("--nnodes=", "--dist-init-addr="))
                    for a in cfg.extra_args)
    if log_dir is None or multinode or cfg.parallel(role).dp > 1:
        # Replica DP: each replica is a torch world of its own; one file (one env variable for
        # them all) would put every replica's ranks in one rendezvous. SGLang gives each its
        # own port instead.
        return spec
    # torch's TCPStore for the TP group's rendezvous listens on every interface whatever
    # --host says; a server on one machine meets its ranks through a file instead.
    # absolute: a relative --log-dir (a Slurm job's logs/...) would read as file://HOST/PATH
    store = f"file://{(Path(log_dir) / (spec.name + '.dist-store')).resolve()}"
    return dataclasses.replace(spec, env=tuple(sorted(dict(spec.env, **{DIST_STORE_ENV: store}).items())))


DIST_STORE_ENV = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"


def _extra(cfg: LaunchConfig) -> list[str]:
    """Pass-through arguments, a built-in draft model's name resolved to its directory."""
    from sglang_disagg.messenger.speculative import with_draft_paths

    return with_draft_paths(cfg.extra_args)


def _server_spec(cfg: LaunchConfig, role: Role, model_path: str, builtin: bool,
                 log_dir: Path | None = None) -> ProcessSpec:
    ports = cfg.ports
    ranks = cfg.parallel(role).processes
    if role is Role.COLOCATED:
        argv = _server_base(cfg, model_path, builtin, ports.front, ports.colocated_dist, role)
        if cfg.page_size is not None:
            argv += ["--page-size", str(cfg.page_size)]
        return ProcessSpec("colocated", tuple(argv + _extra(cfg)), _env(cfg, role, ranks), ports.front)
    if role is Role.PREFILL:
        port = ports.prefill
        argv = _server_base(cfg, model_path, builtin, port, ports.prefill_dist, role)
        if cfg.mode is Mode.MESSENGER:
            argv, env = _messenger_server(cfg, role, argv, log_dir)
        else:
            argv += ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", cfg.transfer_backend,
                     "--disaggregation-bootstrap-port", str(ports.bootstrap)]
            if cfg.device == "cpu":
                argv += ["--disable-overlap-schedule"]
            if cfg.page_size is not None:
                argv += ["--page-size", str(cfg.page_size)]
            env = _env(cfg, role, ranks)
        return ProcessSpec("prefill", tuple(argv + _extra(cfg)), env, port, _pinned(cfg, role))
    if role is Role.DECODE:
        port = ports.decode
        argv = _server_base(cfg, model_path, builtin, port, ports.decode_dist, role)
        if cfg.mode is Mode.MESSENGER:
            argv, env = _messenger_server(cfg, role, argv, log_dir)
        else:
            argv += ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", cfg.transfer_backend]
            if cfg.device == "cpu":
                argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
            if cfg.page_size is not None:
                argv += ["--page-size", str(cfg.page_size)]
            env = _env(cfg, role, ranks)
        return ProcessSpec("decode", tuple(argv + _extra(cfg)), env, port, _pinned(cfg, role))
    raise ValueError(f"{role} is not a server role")


def _split_url(url: str, default_bootstrap: int | None) -> list[str]:
    """'http://h:p@8998' -> ['http://h:p', '8998']; bootstrap optional."""
    base, _, boot = url.partition("@")
    if boot:
        return [base, boot]
    return [base] + ([str(default_bootstrap)] if default_bootstrap else [])


def launcher_registered_workers(cfg: LaunchConfig) -> list[str]:
    """Workers the launcher adds to its router itself (POST /workers) once they are healthy:
    a messenger `--role all` starts its router together with its servers, so the router's
    Python start-up (~6 s of imports) overlaps theirs; given on its command line instead, a
    worker not up yet is retried with a growing back-off (1, 2, 3, 4 s...) that costs seconds."""
    if cfg.role is Role.ALL and cfg.mode is Mode.MESSENGER:
        return [f"http://{cfg.host}:{cfg.ports.decode}"]
    return []


def bind_address(host: str) -> str:
    """`host` as the IP address a listener binds: itself when it is one, else what the name
    resolves to here (a rendered Slurm job's hosts are the job's machine names)."""
    name = host.strip("[]")
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ValueError(f"--host {host!r}: not an IP address, and it does not resolve here: {e}") from None


def router_spec(cfg: LaunchConfig) -> ProcessSpec:
    ports = cfg.ports
    decodes = [f"http://{cfg.host}:{ports.decode}"] if cfg.role is Role.ALL else list(cfg.decode_urls)
    late = launcher_registered_workers(cfg)
    # With keys, smg is started in-process with its keys set there (smg_router.py): on its own
    # command line they would be readable by any user of the machine. The scope is no secret.
    scope = keys.scope(cfg)
    module = ["smg.launch_router"] if scope is keys.Scope.NONE else [
        "sglang_disagg.launch.smg_router", smg_router.SCOPE_FLAG, scope.value]
    bind = bind_address(cfg.host)  # smg binds IP literals only; Slurm names machines by hostname
    argv = [sys.executable, "-m", *module, "--host", bind, "--port", str(ports.front),
            # its metrics listener defaults to 0.0.0.0:29000: keep it on our host and port range
            "--prometheus-host", bind, "--prometheus-port", str(ports.router_metrics)]
    if cfg.mode is Mode.MESSENGER:
        # Regular mode in front of the decoders only: each decoder finds its prefill server.
        if not late:
            argv += ["--worker-urls", *decodes]
    else:
        if cfg.role is Role.ALL:
            prefills = [[f"http://{cfg.host}:{ports.prefill}", str(ports.bootstrap)]]
        else:
            prefills = [_split_url(u, None) for u in cfg.prefill_urls]
        argv += ["--pd-disaggregation"]
        for p in prefills:
            argv += ["--prefill", *p]
        for d in decodes:
            argv += ["--decode", d]
    # The router's own health checks and retries would hide a dead worker for
    # tens of seconds; fail fast and let the client see the error.
    argv += ["--health-check-interval-secs", "2", "--health-failure-threshold", "2"]
    # Two attempts, not smg's five (its "max retries" counts attempts: 1 never retries): a
    # request the decoder failed after some of its KV landed (a prefill server lost) is
    # served by the retry, while one that ran past its transfer deadline on a slow link
    # fails after two deadlines instead of five.
    argv += ["--retry-max-retries", "2"]
    # SSE keep-alives: smg's default (a comment after 15 s of silence) reaches any stream whose
    # first token is slow (a long prompt, a queue) and breaks clients that read every line as
    # JSON, SGLang's own bench_serving among them; a colocated server never sends one. Off
    # unless asked for (a deployment behind an idle-timeout proxy sets it below that timeout).
    argv += ["--sse-keepalive-secs", f"{cfg.sse_keepalive_s:g}"]
    if cfg.tls_cert_path:  # HTTPS on the front door (the router's own listener; workers stay HTTP)
        argv += ["--tls-cert-path", cfg.tls_cert_path, "--tls-key-path", cfg.tls_key_path]
    extra = {SECRET_FILE_ENV: cfg.secret_file} if scope is not keys.Scope.NONE and cfg.secret_file else {}
    # Pinned with the prefill server: a decode server's cores run decoding only, as on a
    # dedicated decode node, and the router's work lands where a prefill stall costs no ITL.
    return ProcessSpec("router", tuple(argv), _env(cfg, Role.ROUTER, 1, extra), ports.front,
                       _pinned(cfg, Role.PREFILL), tuple(ports.all(Role.ROUTER, cfg.mode).items()))
