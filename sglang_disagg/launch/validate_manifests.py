"""Rendered manifests checked offline, before anyone applies them: each object against the
schema of its kind, pinned and named here, then the rules a schema cannot say.

Schemas:
- core kinds (Service, Deployment, DaemonSet, ...): Kubernetes ``K8S_VERSION``, the strict
  JSON schemas of the PyPI package kubernetes-validate (pinned in requirements/*.lock);
  strict: a field the API does not know is an error, as ``kubectl apply`` makes it.
- custom resources: the ``openAPIV3Schema`` of the vendored CRDs in ``CRDS`` (schemas/README.md
  names their source, tag and commit; the digests are checked on load). An object field the
  schema does not list is an error here too (the API server would drop it silently, which
  hides a typo), except under ``x-kubernetes-preserve-unknown-fields``. CEL rules
  (``x-kubernetes-validations``) are not evaluated.

Rules (``structural``), for every container a rendering holds (pod templates, OME runners):
- resources: requests and limits for ``cpu`` and ``memory``; ``nvidia.com/gpu`` for a
  prefill or decode server on ``--device cuda``;
- a serving launcher (prefill, decode or router; of a multi-node group only rank 0) has a
  port named ``http`` on the port its role serves (from its ``--port``), and readiness and
  liveness probes on it;
- the shared secret: never a value in the manifest; a messenger prefill or decode server, and
  any launcher bound beyond loopback (it derives its HTTP keys from the secret, keys.py), gets
  ``SGLANG_DISAGG_SECRET`` from a Secret (``secretKeyRef``) or ``SGLANG_DISAGG_SECRET_FILE``
  inside a mounted secret volume; no Secret object is rendered; no key flag (``--api-key``,
  ``--admin-api-key``, smg's key flags) on any command line.
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
from pathlib import Path
from typing import Any, Iterator

from sglang_disagg.backends.auth import SECRET_ENV, SECRET_FILE_ENV
from sglang_disagg.launch.config import Ports, Role
from sglang_disagg.launch.keys import is_loopback
from sglang_disagg.launch.pods import GPU, SERVING_PORT, serving_port

K8S_VERSION = "1.33"
SCHEMAS = Path(__file__).parent / "schemas"
# (apiVersion, kind) -> (vendored file, sha256 of the upstream YAML)
CRDS: dict[tuple[str, str], tuple[str, str]] = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): (
        "lws/leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz",
        "c5dcad8ed943e495490241f00b9a1b45d51203b6d484020db3636d5bf553568e"),
    ("ome.io/v1beta1", "InferenceService"): (
        "ome/ome.io_inferenceservices.yaml.gz", "ae8c9d8c7fdcbf91f60c9f916af98b0dd635e071ae810b1461a00ef2fd0d2c57"),
    ("ome.io/v1beta1", "ServingRuntime"): (
        "ome/ome.io_servingruntimes.yaml.gz", "245eaf43f876274b43eb4c71bea605accfe83edc7d22f665cc5b9a184a5f0b7d"),
    ("ome.io/v1beta1", "ClusterServingRuntime"): (
        "ome/ome.io_clusterservingruntimes.yaml.gz",
        "afe3cf260703f846e59cf7925ff167326ffa672f39b53266cb3dd8e109f4ce93"),
    ("ome.io/v1beta1", "BaseModel"): (
        "ome/ome.io_basemodels.yaml.gz", "d915325ef5930120d51fb406c4ec9306285168d77ba18a0747585bde2dd2789e"),
    ("ome.io/v1beta1", "ClusterBaseModel"): (
        "ome/ome.io_clusterbasemodels.yaml.gz", "b81bfef75d5e4ad5711b9da3a0f5a6d2895d7a5f6acbf748d36e05f9b603f4ec"),
}
SERVER_ROLES = (Role.PREFILL.value, Role.DECODE.value)
KEY_FLAGS = ("--api-key", "--admin-api-key", "--control-plane-api-keys", "--tenant-api-key")  # SGLang's, smg's


class SchemaError(RuntimeError):
    """A vendored schema is missing or not the pinned one."""


def crd_text(api_version: str, kind: str) -> bytes:
    """The vendored CRD's upstream YAML, checked against its pinned digest."""
    name, digest = CRDS[(api_version, kind)]
    data = gzip.decompress((SCHEMAS / name).read_bytes())
    if hashlib.sha256(data).hexdigest() != digest:
        raise SchemaError(f"{SCHEMAS / name}: not the vendored upstream file (sha256 differs from {digest})")
    return data


@functools.cache
def crd(api_version: str, kind: str) -> dict:
    """The vendored CustomResourceDefinition of `kind`, parsed."""
    import yaml

    return yaml.load(crd_text(api_version, kind), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    """The openAPIV3Schema of `kind` at `api_version`, closed to fields it does not list."""
    version = api_version.rsplit("/", 1)[1]
    for v in crd(api_version, kind)["spec"]["versions"]:
        if v["name"] == version:
            return _closed(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
    raise SchemaError(f"the vendored CRD of {kind} has no version {version}")


def _closed(schema: Any) -> Any:
    if isinstance(schema, dict):
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for v in schema.values():
            _closed(v)
    elif isinstance(schema, list):
        for v in schema:
            _closed(v)
    return schema


def _name(doc: dict) -> str:
    return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"


def schema_problems(doc: dict) -> list[str]:
    key = (doc.get("apiVersion", ""), doc.get("kind", ""))
    if key in CRDS:
        import jsonschema

        validator = jsonschema.Draft7Validator(crd_schema(*key))
        return [f"{_name(doc)}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_name(doc)}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message} "
                f"(Kubernetes {K8S_VERSION})"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{_name(doc)}: {e.message}"]
    return []


def _containers(node: Any, volumes: list, path: str) -> Iterator[tuple[str, dict, list]]:
    """(path, container, the volumes of its pod) for every container under `node`."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            yield from _containers(v, volumes, f"{path}[{i}]")
    if not isinstance(node, dict):
        return
    if any(k in node for k in ("containers", "initContainers", "runner")):
        volumes = node.get("volumes", volumes)
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for i, c in enumerate(value):
                yield f"{path}.{key}[{i}]", c, volumes
        elif key == "runner" and isinstance(value, dict):
            yield f"{path}.runner", value, volumes
        else:
            yield from _containers(value, volumes, f"{path}.{key}" if path else key)


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args[:-1] else None


def _container_problems(c: dict, volumes: list, device: str) -> list[str]:
    out = []
    res = c.get("resources") or {}
    for part in ("requests", "limits"):
        missing = [r for r in ("cpu", "memory") if r not in (res.get(part) or {})]
        if missing:
            out.append(f"resources.{part}: no {' or '.join(missing)}")
    args = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
    role = _flag(args, "--role") if "sglang_disagg.launch" in args else None
    if role in SERVER_ROLES and device == "cuda" and GPU not in (res.get("limits") or {}):
        out.append(f"resources.limits: no {GPU} for a {role} server on --device cuda")
    if role in SERVER_ROLES + (Role.ROUTER.value,) and _flag(args, "--node-rank") in (None, "0"):
        want = serving_port(Role(role), Ports(int(_flag(args, "--port") or 30000)))
        named = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
        if named.get(SERVING_PORT) != want:
            has = f"is {named[SERVING_PORT]}" if SERVING_PORT in named else "is missing"
            out.append(f"ports: the port named {SERVING_PORT!r} {has}; a {role} serves on {want}")
        for probe in ("readinessProbe", "livenessProbe"):
            action = (c.get(probe) or {}).get("httpGet") or (c.get(probe) or {}).get("tcpSocket") or {}
            if action.get("port") not in (SERVING_PORT, want):
                out.append(f"{probe}: {'missing' if not action else 'on port ' + str(action.get('port'))}, "
                           f"not on the serving port {want} ({SERVING_PORT})")
    env = {e.get("name"): e for e in c.get("env") or []}
    if "value" in env.get(SECRET_ENV, {}):
        out.append(f"env {SECRET_ENV}: the secret's value is in the manifest; take it from a Secret")
    messenger = role in SERVER_ROLES and _flag(args, "--mode") != "upstream"
    exposed = role in SERVER_ROLES + (Role.ROUTER.value,) and not is_loopback(_flag(args, "--host") or "127.0.0.1")
    if (messenger or exposed) and not _secret_from_secret(c, env, volumes):
        what = f"messenger {role} server" if messenger else f"{role} bound to {_flag(args, '--host')}"
        out.append(f"env: a {what} needs {SECRET_ENV} from a Secret (secretKeyRef) or {SECRET_FILE_ENV} in a "
                   f"mounted secret volume (its HTTP keys derive from it)")
    keyed = [a for a in args if a.split("=", 1)[0] in KEY_FLAGS]
    if keyed:
        out.append(f"args: {', '.join(keyed)}: a key on a command line is readable by anyone on the node; the "
                   f"launcher derives the keys from the secret")
    return out


def _secret_from_secret(c: dict, env: dict, volumes: list) -> bool:
    if ((env.get(SECRET_ENV) or {}).get("valueFrom") or {}).get("secretKeyRef"):
        return True
    path = (env.get(SECRET_FILE_ENV) or {}).get("value", "")
    secret_volumes = {v.get("name") for v in volumes if "secret" in v}
    return bool(path) and any(m.get("name") in secret_volumes
                              and path.startswith(m.get("mountPath", "").rstrip("/") + "/")
                              for m in c.get("volumeMounts") or [])


def structural_problems(doc: dict, device: str) -> list[str]:
    if doc.get("kind") == "Secret" and (doc.get("data") or doc.get("stringData")):
        return [f"{_name(doc)}: a rendered Secret would put the key in the manifest; create it with kubectl"]
    return [f"{_name(doc)}: {path}: {p}" for path, c, volumes in _containers(doc, [], "")
            for p in _container_problems(c, volumes, device)]


def problems(docs: list[dict], device: str) -> list[str]:
    """Everything wrong with a rendering (empty: every object passes)."""
    return [p for doc in docs for p in schema_problems(doc) + structural_problems(doc, device)]
