"""Separate hosts for the tests: namespaces (harness/hosts/netns.py) and deployments
started in them with the public launcher (harness/hosts/deployment.py).

Needs root (namespaces, a tmpfs on /dev/shm, veth links). Where they cannot be made the
tests fail with the reason under CI=true and skip with it elsewhere. The session first
sweeps what a run killed outright left behind, and checks at its end that no keeper
(hence no namespace, link or process of these hosts) is left.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest

from e2e.conftest import COMMON_ARGS, OUTPUT_TOKENS, StackSpec, prompts_for, run_sequential, start_stack
from e2e.faultlib import long_prompt
from harness.hosts import netns
from harness.hosts.deployment import Deployment, Layout
from sglang_disagg.launch import Role
from sglang_disagg.launch.client import generate_ids
from sglang_disagg.launch.config import Ports

CLIENT = Path(__file__).with_name("client.py")
_runs = itertools.count()


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def hosts_possible():
    reason = netns.can_create()
    if reason:
        if in_ci():
            pytest.fail(f"multi-host tests need namespaces, and CI must run them: {reason}")
        pytest.skip(reason)
    left = netns.sweep()
    if left:
        print(f"swept {left} keeper process(es) an earlier run left", file=sys.stderr)
    yield
    stale = netns.keepers()
    netns.sweep(stale)
    assert not stale, f"keepers left after the multi-host tests (namespaces not cleaned up): {stale}"


@pytest.fixture
def network(hosts_possible, request):
    """Three hosts: prefill (10.77.0.1), decode (.2), router (.3); gone after the test, failed or not."""
    names = getattr(request, "param", Layout().names)
    net = netns.Network.create(f"t{next(_runs)}", names)
    yield net
    net.close()


LONG_TOKENS = {"long": (1500, 6), "medium": (400, 3), "slow": (700, 1), "rails": (1500, 6)}  # tokens, how many
LONG_OUTPUT = 4


def long_prompts() -> dict[str, list[int]]:
    """Prompts whose KV takes seconds on a capped link, by name ("long-0", ...), each sent by
    one test only (so no radix cache holds any of them)."""
    return {f"{kind}-{i}": long_prompt(n, 20 + 10 * k + i) for k, (kind, (n, count)) in enumerate(LONG_TOKENS.items())
            for i in range(count)}


@pytest.fixture(scope="session")
def colocated(tmp_path_factory):
    """Colocated greedy outputs (tiny-llama, the e2e tests' flags), one server for both sets:
    "short" (the e2e prompts, OUTPUT_TOKENS each) and "long" (long_prompts(), LONG_OUTPUT each)."""
    prompts, longs = prompts_for("tiny-llama"), long_prompts()
    stack = start_stack(tmp_path_factory.mktemp("hosts-ref"), StackSpec(role=Role.COLOCATED))
    try:
        return {"short": (prompts, run_sequential(stack.url, prompts)),
                "long": {k: (p, generate_ids(stack.url, p, LONG_OUTPUT)) for k, p in longs.items()}}
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def reference(colocated):
    """The e2e prompts and their colocated greedy outputs."""
    return colocated["short"]


def ask(dep: Deployment, prompts: list[list[int]], from_host: str | None = None,
        max_new_tokens: int = OUTPUT_TOKENS) -> dict:
    """Send `prompts` to the router from inside a host; the decoder's KV byte counter before and after."""
    job = dep.root / f"job-{next(_runs)}.json"
    metrics = f"http://{dep.net[dep.layout.decode].address}:{Ports(dep.port).decode_metrics}/metrics"
    job.write_text(json.dumps({"url": dep.url, "prompts": prompts, "max_new_tokens": max_new_tokens,
                               "metrics": metrics, "api_key": dep.keys.api}))
    r = dep.net[from_host or dep.layout.router].run([sys.executable, str(CLIENT), str(job)], timeout=300)
    assert r.returncode == 0, f"client failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def deployment(tmp_path: Path, net: netns.Network, layout: Layout = Layout(), **kw) -> Deployment:
    return Deployment.write(tmp_path / "deployment", net, layout, extra_args=COMMON_ARGS, **kw)
