"""``render k8s FILE``: a deployment file (deploy.py) as Kubernetes manifests.

One LeaderWorkerSet per group (size = the group's machines; the leader is the TP group's node
rank 0 and serves), a Service per group in front of its leader (peers reach it by the group's
name), and the router as a Deployment + Service. Every process runs the launcher with flags
computed from the LaunchConfig the launcher builds for ``--config FILE --node NAME``
(``pods.launcher_argv``). Pods bind their own pod IP; containers, resources, probes and the
secret: pods.py. With more than one decoder, each decoder's pod stop drains it first (a preStop
hook running ``launch drain``, a termination grace that covers it: pods.drain_on_stop).
"""

from __future__ import annotations

import dataclasses

from . import pods
from .config import DrainMode, LaunchConfig
from .deploy import ROUTER, Deployment
from .pods import dist_port, launcher_argv, multinode_flags


def _service(name: str, selector: dict, cfg: LaunchConfig, namespace: str) -> dict:
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["containerPort"], "protocol": "TCP"}
             for p in pods.container_ports(cfg, serving=True)]
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": selector, "ports": ports}}


def for_cluster(dep: Deployment) -> Deployment:
    """The deployment as pods see it: peers named by their Services, the secret from a Secret."""
    return dataclasses.replace(dep, groups=tuple(dataclasses.replace(g, host=g.name) for g in dep.groups),
                               router_host=ROUTER, secret_file=None)


def kubernetes(dep: Deployment, namespace: str = "default") -> list[dict]:
    k8s = for_cluster(dep)
    docs: list[dict] = []
    for g in k8s.groups:
        cfg = k8s.launch_config(g.name, host="$(POD_IP)")
        base, dist = launcher_argv(cfg), dist_port(k8s, g)
        resources = pods.server_resources(dep, g)
        leader = pods.container(g.role.value, dep.image, cfg,
                                base + multinode_flags(g, "$(LWS_LEADER_ADDRESS)", "0", dist), resources)
        labels = {"app.kubernetes.io/part-of": "sglang-disagg", "sglang-disagg/role": g.role.value}
        pod = {"tolerations": [pods.GPU_TOLERATION]} if dep.device == "cuda" else {}
        if cfg.drain_mode is DrainMode.MIGRATE:  # a pod stop migrates its running requests first
            leader["lifecycle"], grace = pods.drain_on_stop(cfg)
            pod["terminationGracePeriodSeconds"] = grace
        # LWS v1 requires workerTemplate; a one-machine group is its leader alone, made from it.
        template = {"size": g.nodes, "workerTemplate": {"metadata": {"labels": labels},
                                                        "spec": pod | {"containers": [leader]}}}
        if g.nodes > 1:
            worker = pods.container(g.role.value, dep.image, cfg, base + multinode_flags(
                g, "$(LWS_LEADER_ADDRESS)", "$(LWS_WORKER_INDEX)", dist), resources, serving=False)
            template["leaderTemplate"] = template["workerTemplate"]
            template["workerTemplate"] = {"metadata": {"labels": labels}, "spec": pod | {"containers": [worker]}}
        docs.append({"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                     "metadata": {"name": g.name, "namespace": namespace},
                     "spec": {"replicas": 1, "leaderWorkerTemplate": template}})
        docs.append(_service(g.name, {"leaderworkerset.sigs.k8s.io/name": g.name,
                                      "leaderworkerset.sigs.k8s.io/worker-index": "0"}, cfg, namespace))
    cfg, volumes = pods.with_tls_secret(k8s.launch_config(ROUTER, host="$(POD_IP)"))
    labels = {"app.kubernetes.io/part-of": "sglang-disagg", "sglang-disagg/role": ROUTER}
    router = pods.container(ROUTER, dep.image, cfg, launcher_argv(cfg), pods.router_resources())
    pod = {"containers": [router]} | ({"volumes": volumes} if volumes else {})
    docs.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": ROUTER, "namespace": namespace},
                 "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                          "template": {"metadata": {"labels": labels}, "spec": pod}}})
    docs.append(_service(ROUTER, labels, cfg, namespace))
    return docs
