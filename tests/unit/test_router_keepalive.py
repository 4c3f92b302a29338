"""The router's SSE keep-alives: off by default (a plain SGLang server sends none, and
SGLang's own benchmark client fails on them), set by a flag or the deployment file, and
carried into what the launcher starts and renders."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_disagg.launch.__main__ import parse
from sglang_disagg.launch.commands import router_spec
from sglang_disagg.launch.deploy import DeploymentError, load, parse as parse_doc
from sglang_disagg.launch.render import kubernetes

EXAMPLE = Path(__file__).resolve().parents[2] / "launch" / "deployment.example.toml"


def keepalive_arg(argv) -> str:
    argv = list(argv)
    return argv[argv.index("--sse-keepalive-secs") + 1]


@pytest.mark.parametrize("argv", [["--role", "all"], ["--role", "all", "--mode", "upstream"],
                                  ["--role", "router", "--decode-url", "http://127.0.0.1:30002"]])
def test_the_router_sends_no_keepalives_unless_asked(argv):
    cfg, _ = parse(argv)
    assert cfg.sse_keepalive_s == 0
    assert keepalive_arg(router_spec(cfg).argv) == "0"


def test_the_flag_sets_the_period():
    cfg, _ = parse(["--role", "all", "--sse-keepalive-secs", "50"])
    assert keepalive_arg(router_spec(cfg).argv) == "50"
    with pytest.raises(ValueError, match="--sse-keepalive-secs -1"):
        parse(["--role", "all", "--sse-keepalive-secs", "-1"])


def test_the_deployment_file_sets_it_for_the_router_node(tmp_path):
    assert load(EXAMPLE).launch_config("router").sse_keepalive_s == 0
    text = EXAMPLE.read_text().replace("sse_keepalive_secs = 0", "sse_keepalive_secs = 45")
    path = tmp_path / "d.toml"
    path.write_text(text)
    dep = load(path)
    assert keepalive_arg(router_spec(dep.launch_config("router")).argv) == "45"
    router = next(d for d in kubernetes(dep) if d["kind"] == "Deployment")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert float(keepalive_arg(args)) == 45  # the launcher in the pod gets it too


def test_a_bad_value_names_the_field():
    doc = {"deployment": {"model": "tiny-llama"}, "prefill": [{"name": "p", "host": "10.0.0.1"}],
           "decode": [{"name": "d", "host": "10.0.0.2"}], "router": {"sse_keepalive_secs": "often"}}
    with pytest.raises(DeploymentError, match="router.sse_keepalive_secs: expected int or float"):
        parse_doc(doc)
