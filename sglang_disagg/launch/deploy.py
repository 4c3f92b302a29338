"""A deployment described in one TOML file: the model and transfer settings shared by every
server, the prefill and decode groups (each one SGLang server, possibly a multi-node TP
group), which prefill groups each decoder may use, and the router.

    [deployment]
    model = "tiny-llama"          # built-in name or a model directory present on every node
    mode = "messenger"            # or "upstream"
    backend = "libfabric"
    provider = "tcp"
    port = 30000                  # every group uses the launcher's port plan from here
    device = "cpu"                # or "cuda"
    image = "sglang-disagg:latest"  # container image (Kubernetes and OME renderings only)
    cpu = 4                       # each server pod's cores and memory (renderings only;
    memory = "16Gi"               #   defaults: pods.server_resources)

    [[prefill]]
    name = "prefill-0"
    host = "10.0.0.1"
    tp = 2
    attn_dp = 1                   # attention-DP groups inside the TP group (--prefill-attn-dp), or
    dp = 1                        #   replicas of it (--prefill-dp; one machine): launch/parallel.py
    nodes = 1                     # machines in this TP group
    gpus = 2                      # --device cuda: GPUs on each of its machines (default tp * dp / nodes)
    rails = ["eth0", "eth1"]      # --rails: interfaces its KV writes leave through ("auto": all usable)

    [[decode]]
    name = "decode-0"
    host = "10.0.0.2"
    prefill = ["prefill-0"]       # default: every prefill group

    [router]
    host = "10.0.0.9"
    sse_keepalive_secs = 0        # SSE comments on silent streams: 0 none; behind a proxy, below its idle timeout
    tls_cert_path = "/etc/sglang-disagg/tls.crt"  # optional: HTTPS on the front door (PEM, on the router's machine)
    tls_key_path = "/etc/sglang-disagg/tls.key"

``python -m sglang_disagg.launch --config FILE --node NAME`` starts one group (or the
router, ``--node router``) with flags given on the command line overriding the file;
``render.py`` turns the same file into Kubernetes manifests, OME objects and a Slurm batch script
(``render_k8s.py``, ``render_ome.py``, ``render_slurm.py``).
A bad file raises DeploymentError naming the field and the reason, and so does a deployment
a start of one of its nodes would refuse on any machine (checks.check_deployment: the
model's shape against the TP sizes, the port plan).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checks import check_deployment
from .config import DrainMode, LaunchConfig, Mode, Ports, Role
from .parallel import Parallel, problem as parallel_problem
from ..rails.choose import check_names

ROUTER = "router"


class DeploymentError(ValueError):
    pass


@dataclass(frozen=True)
class Group:
    """One SGLang server: a prefill or decode TP group, with its data parallelism (parallel.py)."""

    name: str
    role: Role
    host: str
    tp: int = 1
    nodes: int = 1
    prefill: tuple[str, ...] = ()  # decode groups: the prefill groups it may use
    gpus: int | None = None  # --device cuda: GPUs on each of its machines (None: ranks_per_node)
    attn_dp: int = 1  # attention-DP groups inside the TP group
    dp: int = 1  # replicas of the TP group (on one machine)
    rails: tuple[str, ...] = ()  # interface names of its machines (or "auto"): per group, names differ per host

    @property
    def ranks_per_node(self) -> int:
        """Rank processes on each machine: replica DP runs tp * dp (one core or GPU each)."""
        return self.tp * self.dp // self.nodes


@dataclass(frozen=True)
class Deployment:
    model: str
    groups: tuple[Group, ...]
    router_host: str
    router_sse_keepalive_s: float = 0.0  # [router] sse_keepalive_secs (LaunchConfig.sse_keepalive_s)
    router_tls_cert_path: str | None = None  # [router] tls_cert_path / tls_key_path: HTTPS on the front door
    router_tls_key_path: str | None = None
    mode: Mode = Mode.MESSENGER
    backend: str | None = None
    provider: str | None = None
    port: int = 30000
    device: str = "cpu"
    max_total_tokens: int = 8192
    page_size: int | None = None
    image: str = "sglang-disagg:latest"
    extra_args: tuple[str, ...] = ()
    secret_file: str | None = None  # the same path (and content) on every machine, the router's included
    cpu: float | None = None  # a server pod's cores (renderings; None: render's default for its ranks)
    memory: str | None = None  # a server pod's memory, a Kubernetes quantity (None: render's default)

    @property
    def ports(self) -> Ports:
        return Ports(self.port)

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        names = ", ".join([g.name for g in self.groups] + [ROUTER])
        raise DeploymentError(f"no node named {name!r} in the deployment (it has: {names})")

    def of(self, role: Role) -> list[Group]:
        return [g for g in self.groups if g.role is role]

    def prefill_messenger(self, g: Group) -> str:
        return f"{g.host}:{self.ports.bootstrap}"

    def launch_config(self, name: str, **override: Any) -> LaunchConfig:
        """What the launcher runs for node `name` (a group or "router")."""
        common = dict(model=self.model, port=self.port, mode=self.mode, backend=self.backend,
                      provider=self.provider, device=self.device, max_total_tokens=self.max_total_tokens,
                      page_size=self.page_size, extra_args=self.extra_args)
        common["secret_file"] = self.secret_file  # the router's too: its HTTP keys derive from it (keys.py)
        if name == ROUTER:
            decodes = tuple(f"http://{g.host}:{self.ports.decode}" for g in self.of(Role.DECODE))
            prefills = tuple(f"http://{g.host}:{self.ports.prefill}@{self.ports.bootstrap}"
                             for g in self.of(Role.PREFILL)) if self.mode is Mode.UPSTREAM else ()
            kw = dict(role=Role.ROUTER, host=self.router_host, decode_urls=decodes, prefill_urls=prefills,
                      sse_keepalive_s=self.router_sse_keepalive_s, tls_cert_path=self.router_tls_cert_path,
                      tls_key_path=self.router_tls_key_path)
        else:
            g = self.group(name)
            kw = dict(role=g.role, host=g.host, prefill_tp=g.tp, decode_tp=g.tp, prefill_attn_dp=g.attn_dp,
                      decode_attn_dp=g.attn_dp, prefill_dp=g.dp, decode_dp=g.dp, rails=g.rails)
            if self.device == "cuda":  # the group's machine, planned as such on any machine
                kw["gpus"] = g.gpus or g.ranks_per_node
            if g.role is Role.DECODE and self.mode is Mode.MESSENGER:
                kw["prefill_messengers"] = tuple(self.prefill_messenger(self.group(p)) for p in g.prefill)
                if len(self.of(Role.DECODE)) > 1 and not self.router_tls_cert_path:
                    # On SIGTERM its running requests migrate to the router's other decoders
                    # (launch/drain.py). Not behind an HTTPS router: a decoder holds no trust for it.
                    kw |= dict(router_url=f"http://{self.router_host}:{self.ports.front}",
                               member_url=f"http://{g.host}:{self.ports.decode}", drain_mode=DrainMode.MIGRATE)
        return LaunchConfig(**(common | kw | override))


_TOP = {"deployment", "prefill", "decode", "router"}
_DEPLOYMENT = {"model", "mode", "backend", "provider", "port", "device", "max_total_tokens", "page_size", "image",
               "extra_args", "secret_file", "cpu", "memory"}
_GROUP = {"name", "host", "tp", "attn_dp", "dp", "nodes", "prefill", "gpus", "rails"}
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$")  # a Kubernetes memory quantity


def _typed(where: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DeploymentError(f"{where}: expected {want}, got {type(value).__name__} {value!r}")
    return value


def _unknown(where: str, table: dict, known: set[str]) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise DeploymentError(f"{where}: unknown field(s) {', '.join(extra)} (known: {', '.join(sorted(known))})")


def _group(where: str, t: Any, role: Role) -> Group:
    if not isinstance(t, dict):
        raise DeploymentError(f"{where}: expected a table ([[{role.value}]])")
    _unknown(where, t, _GROUP)
    for key in ("name", "host"):
        if key not in t:
            raise DeploymentError(f"{where}.{key}: missing")
    name = _typed(f"{where}.name", t["name"], str)
    if not name or name == ROUTER or not name.replace("-", "").isalnum() or not name[0].isalpha():
        raise DeploymentError(f"{where}.name: {name!r} must start with a letter and hold letters, digits and "
                              f"'-' only (it names pods and services), and cannot be {ROUTER!r}")
    tp, nodes = _typed(f"{where}.tp", t.get("tp", 1), int), _typed(f"{where}.nodes", t.get("nodes", 1), int)
    if tp < 1 or nodes < 1 or tp % nodes:
        raise DeploymentError(f"{where}: tp {tp} over nodes {nodes} must be >= 1 and split evenly")
    attn_dp, dp = _typed(f"{where}.attn_dp", t.get("attn_dp", 1), int), _typed(f"{where}.dp", t.get("dp", 1), int)
    reason = parallel_problem(Parallel(tp, attn_dp, dp), ("tp", "attn_dp", "dp"))
    if reason:
        raise DeploymentError(f"{where}: {reason}")
    if dp > 1 and nodes > 1:
        raise DeploymentError(f"{where}: dp {dp} over nodes {nodes}: the launcher runs a group's replicas on one "
                              f"machine; give each machine's replicas a group of their own")
    gpus, ranks = t.get("gpus"), tp * dp // nodes
    if gpus is not None and _typed(f"{where}.gpus", gpus, int) < ranks:
        replicas = f" x dp {dp}" if dp > 1 else ""
        raise DeploymentError(f"{where}.gpus: {gpus} GPU(s) per machine cannot hold tp {tp}{replicas} over {nodes} "
                              f"machine(s): each runs {ranks} rank(s), one per GPU")
    prefill = t.get("prefill", None)
    if prefill is not None and role is not Role.DECODE:
        raise DeploymentError(f"{where}.prefill: only decode groups name prefill groups")
    if prefill is not None:
        prefill = tuple(_typed(f"{where}.prefill[{i}]", p, str) for i, p in enumerate(_typed(f"{where}.prefill",
                                                                                               prefill, list)))
    rails = tuple(_typed(f"{where}.rails[{i}]", r, str) for i, r in enumerate(_typed(f"{where}.rails",
                                                                                       t.get("rails", []), list)))
    try:
        rails = check_names(rails)
    except ValueError as e:
        raise DeploymentError(f"{where}.rails: {e}") from None
    return Group(name, role, _typed(f"{where}.host", t["host"], str), tp, nodes, prefill or (), gpus, attn_dp, dp,
                 rails)


def parse(doc: dict) -> Deployment:
    _unknown("the file", doc, _TOP)
    d = doc.get("deployment")
    if not isinstance(d, dict):
        raise DeploymentError("[deployment]: missing (it names at least the model)")
    _unknown("deployment", d, _DEPLOYMENT)
    if "model" not in d:
        raise DeploymentError("deployment.model: missing")
    kw: dict[str, Any] = {"model": _typed("deployment.model", d["model"], str)}
    for key, kind in (("backend", str), ("provider", str), ("port", int), ("device", str),
                      ("max_total_tokens", int), ("page_size", int), ("image", str), ("secret_file", str)):
        if key in d:
            kw[key] = _typed(f"deployment.{key}", d[key], kind)
    if "cpu" in d:
        kw["cpu"] = float(_typed("deployment.cpu", d["cpu"], (int, float)))
        if kw["cpu"] <= 0:
            raise DeploymentError(f"deployment.cpu: {d['cpu']} must be > 0 (cores per server pod)")
    if "memory" in d and not _QUANTITY.match(_typed("deployment.memory", d["memory"], str)):
        raise DeploymentError(f"deployment.memory: {d['memory']!r} is not a Kubernetes quantity (e.g. \"16Gi\")")
    kw["memory"] = d.get("memory")
    if "mode" in d:
        try:
            kw["mode"] = Mode(_typed("deployment.mode", d["mode"], str))
        except ValueError:
            raise DeploymentError(f"deployment.mode: {d['mode']!r} is not one of "
                                  f"{', '.join(m.value for m in Mode)}") from None
    if "extra_args" in d:
        kw["extra_args"] = tuple(_typed(f"deployment.extra_args[{i}]", a, str)
                                 for i, a in enumerate(_typed("deployment.extra_args", d["extra_args"], list)))
    groups = [_group(f"{role.value}[{i}]", t, role) for role in (Role.PREFILL, Role.DECODE)
              for i, t in enumerate(_typed(role.value, doc.get(role.value, []), list))]
    for role in (Role.PREFILL, Role.DECODE):
        if not any(g.role is role for g in groups):
            raise DeploymentError(f"[[{role.value}]]: the deployment needs at least one {role.value} group")
    seen: set[str] = set()
    for g in groups:
        if g.name in seen:
            raise DeploymentError(f"{g.role.value} {g.name!r}: the name is used twice")
        seen.add(g.name)
    prefills = [g.name for g in groups if g.role is Role.PREFILL]
    for i, g in enumerate([g for g in groups if g.role is Role.DECODE]):
        for p in g.prefill:
            if p not in prefills:
                raise DeploymentError(f"decode[{i}].prefill: {p!r} is not a prefill group ({', '.join(prefills)})")
    groups = [dataclasses.replace(g, prefill=tuple(prefills)) if g.role is Role.DECODE and not g.prefill else g
              for g in groups]
    router = doc.get("router", {})
    if not isinstance(router, dict):
        raise DeploymentError("[router]: expected a table")
    _unknown("router", router, {"host", "sse_keepalive_secs", "tls_cert_path", "tls_key_path"})
    keepalive = float(_typed("router.sse_keepalive_secs", router.get("sse_keepalive_secs", 0), (int, float)))
    tls = {f"router_{k}": _typed(f"router.{k}", router[k], str) for k in ("tls_cert_path", "tls_key_path")
           if k in router}
    dep = Deployment(groups=tuple(groups), router_host=_typed("router.host", router.get("host", "127.0.0.1"), str),
                     router_sse_keepalive_s=keepalive, **tls, **kw)
    for g in groups:
        if g.gpus is not None and dep.device != "cuda":
            raise DeploymentError(f"{g.role.value} {g.name!r}: gpus applies to device \"cuda\", not {dep.device!r}")
        if dep.device == "cuda" and g.nodes > 1:  # gpu.py plans the GPUs of one machine's server
            raise DeploymentError(f"{g.role.value} {g.name!r}: nodes {g.nodes} on device \"cuda\": the launcher "
                                  f"places a TP group on one machine's GPUs only; use nodes = 1")
    for name in [g.name for g in groups] + [ROUTER]:  # the launcher's own checks, field by field
        try:
            dep.launch_config(name)
        except DeploymentError:
            raise
        except ValueError as e:
            raise DeploymentError(f"node {name!r}: {e}") from None
    try:
        check_deployment(dep.model, dep.mode, dep.ports, dep.groups)
    except ValueError as e:
        raise DeploymentError(str(e)) from None
    return dep


def load(path: str | Path) -> Deployment:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise DeploymentError(f"{path}: cannot read the deployment file: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise DeploymentError(f"{path}: not valid TOML: {e}") from None
    try:
        return parse(doc)
    except DeploymentError as e:
        raise DeploymentError(f"{path}: {e}") from None
