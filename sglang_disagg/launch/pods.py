"""The containers of a rendered deployment (render_k8s.py,
render_slurm.py, render_ome.py): each runs the launcher with its node's flags (``launcher_argv``, the inverse of the
launcher's parser, and the tests hold it to that), asks for its resources, is probed on the
port it serves, and reads the shared secret from a Kubernetes Secret.

- resources: requests = limits (a pod is Guaranteed: an evicted or throttled server stalls
  every request it holds). A server pod: the deployment file's ``cpu``/``memory``, else one
  core per rank plus one (HTTP server, tokenizer, messenger) and a memory default for
  its device; ``nvidia.com/gpu`` = the group's GPUs per machine on ``--device cuda``. A
  rank: a TP rank, of each replica with replica DP (``dp``: tp * dp ranks).
- probes: on the container's serving port (named ``http``), SGLang's and smg's ``/health``
  (which the launcher sets to answer without a generation, commands.py). A startup probe
  covers model loading (minutes on GPUs), so liveness cannot kill a server still loading.
  Ranks above 0 of a multi-node group serve nothing: no serving port, no probes.
- the secret: ``SGLANG_DISAGG_SECRET`` from the Secret ``sglang-disagg-secret`` (key
  ``secret``), never a value in a manifest, for every launcher container (servers and router:
  bound to the pod's address, each derives its HTTP keys from it, keys.py):
  ``kubectl create secret generic sglang-disagg-secret --from-literal=secret=$(openssl rand -hex 32)``.
"""

from __future__ import annotations

import dataclasses

from sglang_disagg.backends.auth import SECRET_ENV
from sglang_disagg.launch import secret
from sglang_disagg.launch.config import LaunchConfig, Ports, Role
from sglang_disagg.launch.deploy import Deployment, Group

K8S_SECRET = "sglang-disagg-secret"
K8S_TLS_SECRET, TLS_VOLUME, TLS_DIR = "sglang-disagg-tls", "tls", "/etc/sglang-disagg/tls"  # the router's HTTPS
SECRET_KEY = "secret"
CONTAINER_LAUNCH = ["python", "-m", "sglang_disagg.launch"]
GPU = "nvidia.com/gpu"
SERVING_PORT = "http"  # the name of the port a container serves and is probed on
HEALTH = "/health"
ROUTER_RESOURCES = {"cpu": "1", "memory": "2Gi"}
MEMORY_DEFAULT = {"cpu": "8Gi", "cuda": "64Gi"}  # a server pod's, when the file names none
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}


def launcher_argv(cfg: LaunchConfig) -> list[str]:
    """Launcher flags that rebuild `cfg` (defaults left out)."""
    defaults = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
    argv = ["--role", cfg.role.value, "--model-path", cfg.model]
    for flag, field in (("--port", "port"), ("--host", "host"), ("--mode", "mode"), ("--backend", "backend"),
                        ("--provider", "provider"), ("--device", "device"), ("--prefill-tp", "prefill_tp"),
                        ("--decode-tp", "decode_tp"), ("--prefill-attn-dp", "prefill_attn_dp"),
                        ("--decode-attn-dp", "decode_attn_dp"), ("--prefill-dp", "prefill_dp"),
                        ("--decode-dp", "decode_dp"), ("--dtype", "dtype"), ("--max-total-tokens", "max_total_tokens"),
                        ("--page-size", "page_size"), ("--transfer-timeout", "transfer_timeout_s"),
                        ("--migration-rate", "migration_rate_mb_s"),
                        ("--link-recheck", "link_recheck_s"), ("--sse-keepalive-secs", "sse_keepalive_s"),
                        ("--startup-timeout", "startup_timeout_s"), ("--drain-timeout", "drain_timeout_s"),
                        ("--drain-mode", "drain_mode"), ("--router", "router_url"), ("--member-url", "member_url"),
                        ("--secret-file", "secret_file"), ("--attention-backend", "attention_backend"),
                        ("--gpus", "gpus"), ("--shared-gpu-fraction", "shared_gpu_fraction"),
                        ("--tls-cert-path", "tls_cert_path"), ("--tls-key-path", "tls_key_path")):
        value = getattr(cfg, field)
        if value != defaults[field]:
            argv += [flag, str(getattr(value, "value", value))]
    for flag, field in (("--prefill-url", "prefill_urls"), ("--decode-url", "decode_urls"),
                        ("--prefill-messenger", "prefill_messengers")):
        for v in getattr(cfg, field):
            argv += [flag, v]
    for flag, field in (("--prefill-gpus", "prefill_gpus"), ("--decode-gpus", "decode_gpus"), ("--rails", "rails")):
        if getattr(cfg, field):
            argv += [flag, ",".join(map(str, getattr(cfg, field)))]
    if cfg.deterministic:
        argv.append("--enable-deterministic-inference")
    if not cfg.stream:
        argv.append("--no-stream")
    if not cfg.reuse_prefix:
        argv.append("--no-decode-prefix-reuse")
    if cfg.pin_cores:
        argv.append("--pin-cores")
    return argv + list(cfg.extra_args)


def multinode_flags(g: Group, leader: str, rank: str, dist_port: int) -> list[str]:
    """SGLang's own multi-node TP flags, passed through to the server."""
    if g.nodes == 1:
        return []
    return ["--nnodes", str(g.nodes), "--node-rank", rank, "--dist-init-addr", f"{leader}:{dist_port}"]


def dist_port(dep: Deployment, g: Group) -> int:
    return dep.ports.prefill_dist if g.role is Role.PREFILL else dep.ports.decode_dist


def serving_port(role: Role, ports: Ports) -> int:
    return {Role.PREFILL: ports.prefill, Role.DECODE: ports.decode, Role.ROUTER: ports.front}[role]


def port_name(what: str) -> str:
    """A Kubernetes port name (<= 15 chars, lowercase, '-') for a port of the launcher's plan."""
    words = what.replace("dist-init", "dist").split()
    return "-".join(w[:7] for w in words)[:15]


def container_ports(cfg: LaunchConfig, serving: bool) -> list[dict]:
    """The serving port first, named ``http`` (OME builds a component's Service from the first
    container's ports; the probes name it); the others by purpose."""
    port = serving_port(cfg.role, cfg.ports)
    out = [{"name": SERVING_PORT, "containerPort": port, "protocol": "TCP"}] if serving else []
    return out + [{"name": port_name(w), "containerPort": p, "protocol": "TCP"}
                  for w, p in cfg.ports.all(cfg.role, cfg.mode).items() if p != port]


def _quantity(cpu: float) -> str:
    return str(int(cpu)) if float(cpu).is_integer() else f"{int(cpu * 1000)}m"


def server_resources(dep: Deployment, g: Group) -> dict:
    ranks = g.ranks_per_node
    res = {"cpu": _quantity(dep.cpu if dep.cpu is not None else ranks + 1),
           "memory": dep.memory or MEMORY_DEFAULT.get(dep.device, MEMORY_DEFAULT["cpu"])}
    if dep.device == "cuda":
        res[GPU] = str(g.gpus or ranks)
    return {"requests": dict(res), "limits": dict(res)}


def router_resources() -> dict:
    return {"requests": dict(ROUTER_RESOURCES), "limits": dict(ROUTER_RESOURCES)}


def probes(https: bool = False) -> dict:
    get = {"path": HEALTH, "port": SERVING_PORT} | ({"scheme": "HTTPS"} if https else {})
    return {"startupProbe": {"httpGet": dict(get), "periodSeconds": 10, "failureThreshold": 180},
            "readinessProbe": {"httpGet": dict(get), "periodSeconds": 10, "failureThreshold": 3},
            "livenessProbe": {"httpGet": dict(get), "periodSeconds": 15, "timeoutSeconds": 5, "failureThreshold": 4}}


def needs_secret(cfg: LaunchConfig) -> bool:
    """A messenger server proves the secret to its peers; every node bound to its pod's address
    derives its HTTP keys from it (keys.py), the router included."""
    return secret.needs_secret(cfg)


def container(name: str, image: str, cfg: LaunchConfig, argv: list[str], resources: dict,
              serving: bool = True) -> dict:
    """The launcher's container for one node: `argv` its flags (render.launcher_argv and any
    multi-node flags), `serving` False for a multi-node group's ranks above 0."""
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    if needs_secret(cfg):
        env.append({"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": K8S_SECRET, "key": SECRET_KEY}}})
    c = {"name": name, "image": image, "command": CONTAINER_LAUNCH[:1], "args": CONTAINER_LAUNCH[1:] + argv,
         "env": env, "ports": container_ports(cfg, serving),
         "resources": resources}
    if cfg.tls_cert_path:
        c["volumeMounts"] = [{"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}]
    return c | (probes(https=bool(cfg.tls_cert_path)) if serving else {})


def drain_on_stop(cfg: LaunchConfig) -> tuple[dict, int]:
    """A migrating decoder's pod (--drain-mode migrate): a preStop hook that drains it before the
    kubelet's SIGTERM (the launcher's own SIGTERM path then finds it drained), and the pod's
    termination grace: the drain, the relayed streams that outlive it on this pod's front end
    (drain.RELAYS_MAX_S) and the stop. Returns (the container's lifecycle, the grace seconds)."""
    import shlex

    from sglang_disagg.launch.drain import RELAYS_MAX_S
    from sglang_disagg.launch.process import STOP_GRACE_S

    argv = CONTAINER_LAUNCH + ["drain", "--port", str(cfg.port), "--router", cfg.router_url,
                               "--member-url", cfg.member, "--timeout", f"{cfg.drain_timeout_s:g}"]
    # exec hooks run no shell and expand no $(VAR): the pod's address comes from its environment
    script = "exec " + " ".join(map(shlex.quote, argv)) + ' --host "$POD_IP"'
    grace = int(cfg.drain_timeout_s + RELAYS_MAX_S + STOP_GRACE_S) + 10
    return {"preStop": {"exec": {"command": ["sh", "-c", script]}}}, grace


def with_tls_secret(cfg: LaunchConfig) -> tuple[LaunchConfig, list[dict]]:
    """A router serving HTTPS in a pod: its certificate and key from the Secret ``sglang-disagg-tls``
    (``kubectl create secret tls sglang-disagg-tls --cert=... --key=...``), mounted read-only (the
    deployment file's paths name files on the router's machine, which a pod does not have); the
    pod's volumes to add."""
    if not cfg.tls_cert_path:
        return cfg, []
    cfg = dataclasses.replace(cfg, tls_cert_path=f"{TLS_DIR}/tls.crt", tls_key_path=f"{TLS_DIR}/tls.key")
    return cfg, [{"name": TLS_VOLUME, "secret": {"secretName": K8S_TLS_SECRET}}]
