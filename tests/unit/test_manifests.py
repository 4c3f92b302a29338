"""Every rendering (Kubernetes: LeaderWorkerSets, Services, the router's Deployment; OME: the
InferenceService, its ServingRuntime, the BaseModel and a built-in's DaemonSet) of the CPU
and the GPU example validates offline against the pinned schemas (Kubernetes 1.33 from
kubernetes-validate, the vendored LWS and OME CRDs) and the structural rules: resources,
probes on the serving port, the secret from a Secret. And the validator catches each kind
of mistake it is there for."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml

from sglang_disagg.launch import pods
from sglang_disagg.launch.__main__ import main, parse
from sglang_disagg.launch.config import Role
from sglang_disagg.launch.deploy import load
from sglang_disagg.launch.render import kubernetes
from sglang_disagg.launch.render_ome import MODEL_ROOT, ome
from sglang_disagg.launch.validate_manifests import CRDS, K8S_VERSION, crd, crd_schema, crd_text, problems

LAUNCH = Path(__file__).parents[2] / "launch"
EXAMPLES = {"cpu": LAUNCH / "deployment.example.toml", "gpu": LAUNCH / "deployment.gpu.example.toml"}
RENDER = {"k8s": lambda dep: kubernetes(dep, "serving"), "ome": lambda dep: ome(dep, "smol", "serving")}
KINDS = {"k8s": {"LeaderWorkerSet", "Service", "Deployment"},
         "ome": {"DaemonSet", "BaseModel", "ServingRuntime", "InferenceService"}}


def _render(example: str, target: str) -> tuple[list[dict], str]:
    dep = load(EXAMPLES[example])
    return RENDER[target](dep), dep.device


def _containers(doc: dict) -> list[dict]:
    """The launcher containers of a rendered object (pod templates and OME runners)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "containers":
                    found.extend(c for c in v if "sglang_disagg.launch" in c.get("args", []))
                elif k == "runner":
                    found.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(doc)
    return found


@pytest.mark.parametrize("target", sorted(RENDER))
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_every_rendering_validates_against_its_pinned_schemas(example, target):
    docs, device = _render(example, target)
    assert {d["kind"] for d in docs} == KINDS[target]
    assert problems(docs, device) == []
    # and survives the trip through YAML (what kubectl reads)
    assert problems(list(yaml.safe_load_all(yaml.safe_dump_all(docs))), device) == []


@pytest.mark.parametrize("target", sorted(RENDER))
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_every_launcher_container_has_resources_probes_and_the_secret(example, target):
    docs, device = _render(example, target)
    containers = [c for d in docs for c in _containers(d)]
    assert len(containers) >= 3
    for c in containers:
        cfg, _ = parse([a.replace("$(POD_IP)", "10.9.9.9") for a in c["args"][2:]])
        assert c["resources"]["requests"] == c["resources"]["limits"]
        assert (pods.GPU in c["resources"]["limits"]) == (device == "cuda" and cfg.role is not Role.ROUTER)
        assert c["ports"][0] == {"name": "http", "containerPort": pods.serving_port(cfg.role, cfg.ports),
                                 "protocol": "TCP"}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        # every node, the router included: bound to its pod's address, each derives its HTTP keys from it
        secret = [e for e in c["env"] if e["name"] == "SGLANG_DISAGG_SECRET"]
        assert secret == [{"name": "SGLANG_DISAGG_SECRET", "valueFrom": {
            "secretKeyRef": {"name": "sglang-disagg-secret", "key": "secret"}}}]
        assert not [a for a in c["args"] if "key" in a.lower() and a.startswith("--")]  # no key on a command line


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_ome_maps_prefill_decode_and_router_onto_engine_decoder_and_router(example):
    dep = load(EXAMPLES[example])
    docs = {d["kind"]: d for d in ome(dep, "smol", "serving")}
    isvc, runtime, model = docs["InferenceService"]["spec"], docs["ServingRuntime"]["spec"], docs["BaseModel"]
    assert isvc["runtime"] == {"name": "smol", "kind": "ServingRuntime"}
    assert isvc["model"] == {"name": model["metadata"]["name"], "kind": "BaseModel"}
    for component, role in (("engine", Role.PREFILL), ("decoder", Role.DECODE)):
        assert isvc[component] == {"minReplicas": len(dep.of(role)), "maxReplicas": len(dep.of(role))}
    args = {k: parse([a.replace("$(POD_IP)", "10.9.9.9") for a in runtime[k]["runner"]["args"][2:]])[0]
            for k in ("engineConfig", "decoderConfig", "routerConfig")}
    assert [c.role for c in args.values()] == [Role.PREFILL, Role.DECODE, Role.ROUTER]
    assert args["decoderConfig"].prefill_messengers == ("smol-engine:30003",)  # the engine's Service
    assert args["routerConfig"].decode_urls == ("http://smol-decoder:30002",)
    want = dep.launch_config(dep.of(Role.PREFILL)[0].name)
    assert (args["engineConfig"].prefill_tp, args["engineConfig"].transfer_provider, args["engineConfig"].gpus) == (
        want.prefill_tp, want.transfer_provider, want.gpus)
    # a built-in is made on each node by the DaemonSet into the directory the BaseModel names
    assert model["spec"]["storage"] == {"storageUri": f"local://{MODEL_ROOT}", "path": MODEL_ROOT}
    convert = docs["DaemonSet"]["spec"]["template"]["spec"]["initContainers"][0]
    assert convert["command"][-1] == dep.model
    assert {"name": "SGLANG_DISAGG_CACHE", "value": MODEL_ROOT} in runtime["engineConfig"]["runner"]["env"]


@pytest.mark.parametrize("target", sorted(RENDER))
def test_a_multi_node_group_validates_and_only_its_leader_serves(target):
    import tomllib

    from sglang_disagg.launch.deploy import parse as parse_doc

    doc = tomllib.loads(EXAMPLES["cpu"].read_text())
    doc["deployment"]["model"] = "tiny-llama"  # 4 heads: TP 2 shards it
    doc["prefill"][0] |= {"tp": 2, "nodes": 2}
    docs = RENDER[target](parse_doc(doc))
    assert problems(docs, "cpu") == []
    prefill = [c for d in docs for c in _containers(d) if c["args"][c["args"].index("--role") + 1] == "prefill"]
    ranks = sorted(c["args"][c["args"].index("--node-rank") + 1] for c in prefill)
    assert ranks == ["$(LWS_WORKER_INDEX)", "0"]
    for c in prefill:  # ranks above 0 serve nothing: no serving port, no probes
        serving = c["args"][c["args"].index("--node-rank") + 1] == "0"
        assert ("readinessProbe" in c) == serving and (c["ports"][0]["name"] == "http") == serving


def test_ome_serves_a_model_directory_from_the_base_models_path():
    dep = dataclasses.replace(load(EXAMPLES["gpu"]), model="/models/Llama-3.1-8B-Instruct/")
    docs = ome(dep)
    assert [d["kind"] for d in docs] == ["BaseModel", "ServingRuntime", "InferenceService"]  # no DaemonSet
    assert docs[0]["metadata"]["name"] == "llama-3-1-8b-instruct"
    assert docs[0]["spec"]["storage"] == {"storageUri": "local:///models/Llama-3.1-8B-Instruct",
                                          "path": "/models/Llama-3.1-8B-Instruct"}
    assert problems(docs, "cuda") == []


@pytest.mark.parametrize("change, why", [
    (lambda dep: dataclasses.replace(dep, groups=(dataclasses.replace(dep.groups[0], tp=4, gpus=4),) + dep.groups[1:]),
     "must share tp, attn_dp, dp, nodes and gpus"),
    (lambda dep: dataclasses.replace(dep, groups=dep.groups[:2] + (dataclasses.replace(dep.groups[2],
                                                                                       prefill=("prefill-0",)),)),
     "decode group 'decode-0' may use prefill-0 only"),
])
def test_ome_refuses_a_deployment_its_components_cannot_express(change, why):
    with pytest.raises(ValueError, match=why):
        ome(change(load(EXAMPLES["gpu"])))


def _first(docs, kind):
    return next(d for d in docs if d["kind"] == kind)


def _server(docs):
    lws = _first(docs, "LeaderWorkerSet")
    return lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]


MISTAKES = [
    ("lws without workerTemplate", lambda docs: _first(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"].pop(
        "workerTemplate"), "'workerTemplate' is a required property"),
    ("a field lws does not have", lambda docs: _first(docs, "LeaderWorkerSet")["spec"].update(replica=1),
     "Additional properties are not allowed ('replica' was unexpected)"),
    ("a core field typo", lambda docs: _first(docs, "Service")["spec"].update(selectr={}),
     f"'selectr' was unexpected) (Kubernetes {K8S_VERSION})"),
    ("no resources", lambda docs: _server(docs).pop("resources"), "resources.requests: no cpu or memory"),
    ("no memory limit", lambda docs: _server(docs)["resources"]["limits"].pop("memory"), "resources.limits: no memory"),
    ("no gpu", lambda docs: _server(docs)["resources"]["limits"].pop(pods.GPU),
     "no nvidia.com/gpu for a prefill server on --device cuda"),
    ("no readiness probe", lambda docs: _server(docs).pop("readinessProbe"), "readinessProbe: missing"),
    ("liveness on another port", lambda docs: _server(docs)["livenessProbe"]["httpGet"].update(port=30003),
     "livenessProbe: on port 30003, not on the serving port 30001 (http)"),
    ("serving port moved", lambda docs: _server(docs)["ports"][0].update(containerPort=8080),
     "the port named 'http' is 8080; a prefill serves on 30001"),
    ("inlined secret", lambda docs: _server(docs)["env"][1].update(value="x" * 32),
     "the secret's value is in the manifest"),
    ("no secret", lambda docs: _server(docs)["env"].pop(1), "a messenger prefill server needs SGLANG_DISAGG_SECRET"),
    ("a rendered Secret", lambda docs: docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"},
                                                    "stringData": {"secret": "x"}}), "would put the key in the"),
]


@pytest.mark.parametrize("mistake, why", [(m, w) for _, m, w in MISTAKES], ids=[n for n, _, _ in MISTAKES])
def test_the_validator_names_each_mistake(mistake, why):
    docs, device = _render("gpu", "k8s")
    assert problems(docs, device) == []
    docs = copy.deepcopy(docs)
    mistake(docs)
    found = problems(docs, device)
    assert any(why in p for p in found), found


@pytest.mark.parametrize("source, accepted", [({"secret": {"secretName": "sglang-disagg-secret"}}, True),
                                              ({"emptyDir": {}}, False)])
def test_a_secret_file_counts_only_inside_a_mounted_secret_volume(source, accepted):
    docs, device = _render("cpu", "k8s")
    docs = copy.deepcopy(docs)
    server = _server(docs)
    server["env"][1] = {"name": "SGLANG_DISAGG_SECRET_FILE", "value": "/etc/sglang-disagg/secret"}
    server["volumeMounts"] = [{"name": "secret", "mountPath": "/etc/sglang-disagg", "readOnly": True}]
    _first(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["volumes"] = [
        {"name": "secret"} | source]
    assert (problems(docs, device) == []) is accepted


def test_a_crd_field_typo_in_an_ome_object_is_caught():
    docs, device = _render("cpu", "ome")
    _first(docs, "InferenceService")["spec"]["engine"]["minReplica"] = 1
    assert problems(docs, device) == ["InferenceService/smol: spec.engine: Additional properties are not allowed "
                                      "('minReplica' was unexpected)"]


@pytest.mark.parametrize("api_version, kind", sorted(CRDS))
def test_each_vendored_crd_is_the_pinned_upstream_file_and_has_the_rendered_version(api_version, kind):
    assert crd_text(api_version, kind).startswith(b"---\napiVersion: apiextensions.k8s.io/v1\n")  # digest checked
    spec = crd(api_version, kind)["spec"]
    assert (spec["group"], spec["names"]["kind"]) == (api_version.split("/")[0], kind)
    assert crd_schema(api_version, kind)["properties"]["spec"]["type"] == "object"


@pytest.mark.parametrize("target", ["k8s", "ome"])
def test_render_validate_prints_what_it_checked_or_exits_naming_the_failure(target, tmp_path, capsys, monkeypatch):
    assert main(["render", target, str(EXAMPLES["gpu"]), "--validate"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert problems(docs, "cuda") == [] and "&id" not in yaml.safe_dump_all(docs)
    from sglang_disagg.launch import validate_manifests

    monkeypatch.setattr(validate_manifests, "problems", lambda docs, device: ["Service/x: spec: broken"])
    assert main(["render", target, str(EXAMPLES["gpu"]), "--validate"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "fail validation:\n  Service/x: spec: broken" in out.err
