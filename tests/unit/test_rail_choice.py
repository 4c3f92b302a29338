"""`--rails auto|NAME[,NAME...]` (sglang_disagg/rails/choose.py): this machine's interfaces into
the rails a server's backend opens, a name that does not exist refused with the interface list,
and `rails = [...]` per group in a deployment file carried into the launcher flags and every
rendering."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import pytest
import yaml

from sglang_disagg.launch.__main__ import parse
from sglang_disagg.launch.commands import messenger_config
from sglang_disagg.launch.config import Role
from sglang_disagg.launch.deploy import DeploymentError, parse as parse_doc
from sglang_disagg.launch.render import kubernetes, slurm
from sglang_disagg.rails import choose


def test_a_named_interface_resolves_to_its_address_and_prefix():
    assert choose.resolve(["lo"]) == ("127.0.0.1/8",)
    assert choose.resolve([]) == ()


def test_a_rail_that_does_not_exist_is_refused_with_the_interface_list():
    with pytest.raises(ValueError, match=r"no interface 'nosuch0' on this host; interfaces: .*lo \(up: 127\.0\.0\.1/8\)"):
        choose.resolve(["nosuch0"])
    # through the launcher: the server is not started, the message says why
    r = subprocess.run([sys.executable, "-m", "sglang_disagg.launch", "--role", "prefill", "--backend", "libfabric",
                        "--rails", "lo,nosuch0", "--dry-run"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, SGLANG_DISAGG_SECRET="ab" * 32))
    assert r.returncode != 0 and "no interface 'nosuch0'" in r.stderr + r.stdout, r.stderr[-2000:]


def test_auto_takes_every_usable_interface_but_loopback():
    chosen = choose.resolve(["auto"])
    assert chosen and all(not ipaddress.IPv4Interface(c).ip.is_loopback for c in chosen)


@pytest.mark.parametrize("flag,reason", [("auto,eth0", "auto stands alone"), ("eth0,eth0", "named twice"),
                                         ("a b", "not an interface name"), ("", "not an interface name")])
def test_bad_flags_are_refused(flag, reason):
    with pytest.raises(ValueError, match=reason):
        choose.parse_flag(flag)


def test_the_launcher_hands_resolved_rails_to_the_messenger_and_refuses_them_where_unused():
    cfg, _ = parse(["--role", "prefill", "--backend", "libfabric", "--rails", "lo"])
    assert messenger_config(cfg, Role.PREFILL).rails == ("127.0.0.1/8",)
    cfg, _ = parse(["--role", "prefill", "--backend", "libfabric"])
    assert messenger_config(cfg, Role.PREFILL).rails == ()  # the default: one endpoint on --host
    with pytest.raises(ValueError, match="backend mooncake takes no interface list"):
        parse(["--role", "prefill", "--backend", "mooncake", "--rails", "eth0"])


DOC = """
[deployment]
model = "tiny-llama"
backend = "libfabric"
provider = "tcp"
[[prefill]]
name = "p"
host = "10.0.0.1"
rails = ["eth0", "rail1"]
[[decode]]
name = "d"
host = "10.0.0.2"
rails = ["auto"]
[router]
host = "10.0.0.3"
"""


def _strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return [str(node)]


def test_rails_per_group_in_a_deployment_file_reach_the_launcher_and_the_renderings():
    import tomllib

    dep = parse_doc(tomllib.loads(DOC))
    assert dep.launch_config("p").rails == ("eth0", "rail1") and dep.launch_config("d").rails == ("auto",)
    docs = list(yaml.safe_load_all(yaml.safe_dump_all(kubernetes(dep, "serving"), sort_keys=False)))
    args = {d["metadata"]["name"]: " ".join(_strings(d)) for d in docs if d["kind"] in ("LeaderWorkerSet", "Deployment")}
    assert "--rails eth0,rail1" in args["p"] and "--rails auto" in args["d"] and "--rails" not in args["router"]
    assert "--rails eth0,rail1" in slurm(dep) and "--rails auto" in slurm(dep)
    with pytest.raises(DeploymentError, match=r"prefill\[0\]\.rails: --rails: auto stands alone"):
        parse_doc(tomllib.loads(DOC.replace('["eth0", "rail1"]', '["auto", "eth0"]')))


def test_a_rail_that_is_down_or_has_no_address_is_refused_and_auto_skips_it(monkeypatch):
    """The interface table is faked here (the logic in isolation): a rail that never comes up is
    refused at start with the reason, never waited for."""
    found = {"eth0": (True, ["10.77.0.1/24"]), "rail1": (False, ["10.77.1.1/24"]), "rail2": (True, []),
             "rail3": (True, ["10.77.3.1/24"]), "lo": (True, ["127.0.0.1/8"])}
    monkeypatch.setattr(choose, "_interfaces", lambda: found)
    with pytest.raises(ValueError, match="interface 'rail1' is down; interfaces: .*rail1 \\(down"):
        choose.resolve(["eth0", "rail1"])
    with pytest.raises(ValueError, match="interface 'rail2' is without an IPv4 address"):
        choose.resolve(["rail2"])
    assert choose.resolve(["auto"], sysfs="/nonexistent") == ("10.77.0.1/24", "10.77.3.1/24")
    assert choose.interface_names(["10.77.3.1/24", "10.9.9.9/24"]) == ["rail3", ""]
