"""Every deployment file shipped under launch/ dry-runs on every node, with the checks a real
start makes that depend on the deployment (the model's heads against each TP size, the port
plan, the shared secret) and none about this machine for a node meant for another one; what
a real start refuses, the dry run refuses, naming why."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from sglang_disagg.backends.auth import SECRET_ENV
from sglang_disagg.launch import checks, sharding
from sglang_disagg.launch.__main__ import main
from sglang_disagg.launch.deploy import ROUTER, load
from sglang_disagg.launch.model_config import REAL_SHAPES, model_config
from sglang_disagg.models import BUILTIN_MODELS, ensure_model

LAUNCH = Path(__file__).parents[2] / "launch"
SHIPPED = sorted(LAUNCH.glob("*.toml"))  # a new file is covered without editing this test
SECRET = "s" * 40


def test_the_examples_are_among_the_files_covered():
    assert {"deployment.example.toml", "deployment.gpu.example.toml"} <= {p.name for p in SHIPPED}


def _dry_run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([*argv, "--dry-run"])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_node_of_every_shipped_file_dry_runs(path, capsys, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)  # as an operator sets it on each server's machine
    dep = load(path)
    for node in [g.name for g in dep.groups] + [ROUTER]:
        rc, out, err = _dry_run(capsys, "--config", str(path), "--node", node)
        assert rc == 0, f"{path.name} --node {node}: {err}"
        role = ROUTER if node == ROUTER else dep.group(node).role.value
        assert f"# dry run: --role {role}" in out and "nothing is started" in out
        if node != ROUTER:
            if model_config(dep.model) is None:  # a checkpoint directory on the nodes, not here
                assert f"# checked: model {dep.model}: not on this machine" in out
            else:
                assert f"# checked: model {Path(dep.model).name} (" in out
                assert f"-tp {dep.group(node).tp}" in out
            assert f"# checked: shared secret: {SECRET_ENV} (set here)" in out
        assert "# checked: this machine" in out  # its cores, or why they were not checked


def _example_with(tmp_path: Path, **prefill) -> Path:
    doc = (LAUNCH / "deployment.example.toml").read_text()
    path = tmp_path / "deployment.toml"
    for key, value in prefill.items():
        doc = doc.replace(f"\n{key} = 1 ", f"\n{key} = {value} ", 1)
    path.write_text(doc)
    return path


def test_the_old_example_tp_2_with_smollm2_is_refused_by_dry_run_and_render(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    path = _example_with(tmp_path, tp=2)
    assert tomllib.loads(path.read_text())["prefill"][0]["tp"] == 2
    why = ("prefill group 'prefill-0': tp 2 cannot shard smollm2-135m (9 attention heads / 3 KV heads, MLP "
           "intermediate size 1536): 9 attention heads do not divide by 2; TP sizes that work: 1, 3")
    for node in ("prefill-0", "decode-0", ROUTER):  # the file is refused, whichever node is asked for
        rc, out, err = _dry_run(capsys, "--config", str(path), "--node", node)
        assert (rc, out) == (2, "") and err.strip() == f"error: {path}: {why}"
    assert main(["render", "k8s", str(path)]) == 2 and why in capsys.readouterr().err


@pytest.mark.parametrize("argv, why", [
    (["--node", "prefill-0", "--tp", "2"], "--prefill-tp 2 cannot shard smollm2-135m"),  # a flag overriding the file
    (["--node", "decode-0", "--decode-tp", "4"], "9 attention heads do not divide by 4; TP sizes that work: 1, 3"),
])
def test_a_node_whose_flags_break_the_sharding_is_refused(argv, why, capsys, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    rc, out, err = _dry_run(capsys, "--config", str(LAUNCH / "deployment.example.toml"), *argv)
    assert rc == 2 and out == "" and why in err


@pytest.mark.parametrize("node", ["prefill-0", "decode-2", ROUTER])  # the router: its HTTP keys derive from it
def test_a_node_without_the_shared_secret_is_refused_as_at_start(node, capsys, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    rc, out, err = _dry_run(capsys, "--config", str(LAUNCH / "deployment.example.toml"), "--node", node)
    assert rc == 2 and out == ""
    assert "needs the deployment's shared secret: --secret-file PATH" in err and SECRET_ENV in err
    monkeypatch.setenv(SECRET_ENV, "short")
    rc, _, err = _dry_run(capsys, "--config", str(LAUNCH / "deployment.example.toml"), "--node", node)
    assert rc == 2 and "need at least 16" in err


def test_a_secret_file_on_another_machine_is_named_not_read(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = tmp_path / "d.toml"
    path.write_text((LAUNCH / "deployment.example.toml").read_text().replace(
        'image = "sglang-disagg:latest"', 'image = "sglang-disagg:latest"\nsecret_file = "/etc/sglang/secret"'))
    rc, out, _ = _dry_run(capsys, "--config", str(path), "--node", "decode-0")
    assert rc == 0 and "--secret-file /etc/sglang/secret (on its machine, not read here)" in out
    rc, _, err = _dry_run(capsys, "--config", str(path), "--node", "decode-0", "--host", "127.0.0.1")
    assert rc == 2 and "--secret-file: SGLANG_DISAGG_SECRET_FILE=/etc/sglang/secret: cannot read" in err


def test_two_groups_of_one_role_on_one_host_are_refused_naming_the_ports(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    path = tmp_path / "d.toml"
    path.write_text((LAUNCH / "deployment.example.toml").read_text().replace('"10.0.0.3"', '"10.0.0.2"'))
    rc, _, err = _dry_run(capsys, "--config", str(path), "--node", ROUTER)
    assert rc == 2 and "decode groups 'decode-0', 'decode-1' all run on host 10.0.0.2" in err
    assert "30002, 30005, 30009" in err and "give each its own host" in err


def test_cores_count_only_for_a_node_meant_for_this_machine(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setattr(sharding, "this_machines_cores", lambda: 2)
    path = _example_with(tmp_path, tp=3)  # 3 ranks: a 3-core machine elsewhere
    rc, out, err = _dry_run(capsys, "--config", str(path), "--node", "prefill-0")
    assert rc == 0, err
    assert "takes --prefill-tp 3" in out and "--host 10.0.0.1 is another machine" in out
    rc, _, err = _dry_run(capsys, "--config", str(path), "--node", "prefill-0", "--host", "127.0.0.1")
    assert rc == 2 and "3 ranks need 3 cores and this machine has 2" in err
    rc, _, err = _dry_run(capsys, "--role", "prefill", "--model-path", "/no/such/model", "--tp", "3")
    assert rc == 2 and "--prefill-tp 3 exceeds the 2 CPU cores of this machine" in err  # shape unknown here


def test_a_start_refuses_more_ranks_than_cores_before_writing_anything(tmp_path, monkeypatch):
    from sglang_disagg.launch import LaunchConfig, Role, Stack

    monkeypatch.setattr(sharding, "this_machines_cores", lambda: 2)
    logs = tmp_path / "logs"
    with pytest.raises(ValueError, match="--prefill-tp 4 exceeds the 2 CPU cores of this machine"):
        Stack.for_config(LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_tp=4, log_dir=str(logs)))
    assert not logs.exists()


@pytest.mark.parametrize("host, here", [("127.0.0.1", True), ("localhost", True), ("10.255.255.254", False),
                                        ("decode-7.example", False)])
def test_a_node_is_meant_for_this_machine_when_its_host_is_one_of_its_addresses(host, here):
    from sglang_disagg.launch import LaunchConfig, Role

    cfg = LaunchConfig(role=Role.PREFILL, model="tiny-llama", host=host)
    assert checks.meant_for_here(cfg) is here


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_a_builtins_shape_is_known_without_generating_it_and_equals_the_generated_one(name):
    from sglang_disagg.models.generate import _config  # what the generator writes to config.json

    assert sharding.Shape.from_config(model_config(name)) == sharding.Shape.from_config(_config(BUILTIN_MODELS[name]))


@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_a_real_models_pinned_shape_equals_its_converted_checkpoint(name, monkeypatch, tmp_path):
    import json

    converted = json.loads((ensure_model(name) / "config.json").read_text())  # make setup converted it
    assert sharding.Shape.from_config(REAL_SHAPES[name]) == sharding.Shape.from_config(converted)
    monkeypatch.setenv("SGLANG_DISAGG_CACHE", str(tmp_path))  # a machine that has not converted it
    assert model_config(name) == REAL_SHAPES[name]
