"""The ``render`` command: a deployment file (deploy.py) rendered by its orchestrator's module.

    python -m sglang_disagg.launch render k8s   FILE [--namespace NS] [--validate] > stack.yaml
    python -m sglang_disagg.launch render ome   FILE [--name NAME] [--validate]   > ome.yaml
    python -m sglang_disagg.launch render slurm FILE [--time 04:00:00] > stack.sbatch

Every process runs the same launcher with flags computed from the same LaunchConfig the
launcher builds for ``--config FILE --node NAME`` (``pods.launcher_argv`` is the inverse of
the launcher's parser, and the tests hold it to that), so ports, roles and backend settings
cannot drift between the launcher and the manifests.

Kubernetes: render_k8s.py; OME: render_ome.py; Slurm: render_slurm.py. This module parses the
command, dispatches, and writes the result (YAML for the manifests). ``--validate`` checks what
is rendered against the pinned schemas (validate_manifests.py).
"""

from __future__ import annotations

import argparse
import sys

from .deploy import load
from .pods import launcher_argv
from .render_k8s import kubernetes
from .render_slurm import slurm

# The renderers' entry points, imported from here by the launcher and the tests.
__all__ = ["kubernetes", "launcher_argv", "main", "slurm", "to_yaml"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.launch render")
    ap.add_argument("target", choices=["k8s", "ome", "slurm"])
    ap.add_argument("config")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--name", default="sglang-disagg", help="OME: the InferenceService's name")
    ap.add_argument("--time", default="04:00:00", help="Slurm time limit")
    ap.add_argument("--validate", action="store_true",
                    help="k8s/ome: check every object against its pinned schema and the structural rules "
                         "(validate_manifests.py) before printing; exit 1 naming what fails")
    args = ap.parse_args(argv)
    try:
        dep = load(args.config)
        if args.target == "slurm":
            sys.stdout.write(slurm(dep, args.time))
            return 0
        if args.target == "k8s":
            docs = kubernetes(dep, args.namespace)
        else:
            from .render_ome import ome

            docs = ome(dep, args.name, args.namespace)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.validate:
        from .validate_manifests import problems

        found = problems(docs, dep.device)
        if found:
            print("error: the rendered manifests fail validation:\n" + "\n".join(f"  {p}" for p in found),
                  file=sys.stderr)
            return 1
    sys.stdout.write(to_yaml(docs))
    return 0


def to_yaml(docs: list[dict]) -> str:
    """The documents as YAML, each written out in full (no &anchors where a rendering reuses
    a dict: a reader of the manifest should not have to follow them)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False)
