"""HTTP keys (sglang_disagg/launch/keys.py): on wherever a port reaches beyond this machine, derived
from the deployment's secret, handed to SGLang through its --config file and to smg in-process,
never on a command line; the launcher's own requests present them. The live check (keys asked
of an outsider, none on any /proc/*/cmdline) is tests/hosts/http_keys.py."""

from __future__ import annotations

import copy
import dataclasses
import stat
from pathlib import Path

import pytest
import yaml

from sglang_disagg.backends.auth import SECRET_ENV, SECRET_FILE_ENV
from sglang_disagg.launch import client, keys, secret, smg_router
from sglang_disagg.launch.__main__ import main, parse
from sglang_disagg.launch.commands import router_spec, server_spec
from sglang_disagg.launch.config import LaunchConfig, Role
from sglang_disagg.launch.deploy import load
from sglang_disagg.launch.process import ManagedProcess
from sglang_disagg.launch.render import kubernetes
from sglang_disagg.launch.stack import Stack
from sglang_disagg.launch.validate_manifests import problems

SECRET = "0123456789abcdef" * 4
EXAMPLE = Path(__file__).parents[2] / "launch" / "deployment.example.toml"


@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    return str(path)


def _values(spec) -> str:
    return " ".join(spec.argv) + " " + " ".join(f"{k}={v}" for k, v in spec.env)


def test_two_keys_derived_one_way_from_the_secret_and_never_in_a_repr():
    k = keys.HttpKeys.derive(SECRET.encode())
    assert k == keys.HttpKeys.derive(SECRET.encode())  # every node derives the same ones
    assert k.api != k.admin and len(k.api) == len(k.admin) == 64
    assert SECRET not in (k.api, k.admin) and keys.HttpKeys.derive(b"another secret of 32 bytes!!!!!").api != k.api
    assert k.api not in repr(k) and k.admin not in repr(k)
    with pytest.raises(ValueError, match="must differ"):
        keys.HttpKeys(api=k.api, admin=k.api)
    with pytest.raises(ValueError, match="32 lowercase hex"):
        keys.HttpKeys(api="short", admin=k.admin)


@pytest.mark.parametrize("argv, needed", [
    (["--role", "all"], False),
    (["--role", "all", "--host", "localhost"], False),
    (["--role", "colocated", "--host", "127.0.0.2"], False),
    (["--role", "all", "--host", "0.0.0.0"], True),  # every interface
    (["--role", "colocated", "--host", "10.0.0.1"], True),
    (["--role", "router", "--decode-url", "http://127.0.0.1:30002"], False),
    (["--role", "router", "--decode-url", "http://10.0.0.2:30002"], True),  # it presents the key to them
])
def test_keys_are_on_wherever_a_port_reaches_beyond_this_machine(argv, needed):
    cfg, _ = parse(argv)
    assert keys.needed(cfg) is needed


def test_servers_read_their_keys_from_a_file_and_the_router_derives_them_in_process(tmp_path, secret_file):
    cfg, _ = parse(["--role", "all", "--host", "10.0.0.1", "--secret-file", secret_file])
    k = keys.load(cfg)
    for role in (Role.PREFILL, Role.DECODE):
        spec = server_spec(cfg, role, "/m", builtin=True, log_dir=tmp_path)
        assert spec.argv[1:5] == ("-m", "sglang.launch_server", "--config", str(tmp_path / f"{role.value}.keys.yaml"))
        assert k.api not in _values(spec) and k.admin not in _values(spec) and SECRET not in _values(spec)
    router = router_spec(cfg)
    assert router.argv[1:3] == ("-m", "sglang_disagg.launch.smg_router")
    assert dict(router.env)[SECRET_FILE_ENV] == secret_file and k.api not in _values(router)
    assert "--scope" not in router.argv or router.argv[router.argv.index("--scope") + 1] == "all"


def test_on_loopback_the_admin_key_only_and_smg_as_it_ships_without_a_secret(tmp_path, secret_file, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    cfg = dataclasses.replace(parse(["--role", "all"])[0], secret_file=secret_file)  # as with_secret leaves it
    spec = server_spec(cfg, Role.DECODE, "/m", builtin=True, log_dir=tmp_path)
    assert spec.argv[3:5] == ("--config", str(tmp_path / "decode.keys.yaml"))
    router = router_spec(cfg)
    assert router.argv[1:5] == ("-m", "sglang_disagg.launch.smg_router", "--scope", "admin")
    assert dict(router.env)[SECRET_FILE_ENV] == secret_file
    no_secret, _ = parse(["--role", "prefill", "--mode", "upstream"])  # loopback, no secret: nothing to derive
    assert keys.scope(no_secret) is keys.Scope.NONE
    assert "--config" not in server_spec(no_secret, Role.PREFILL, "/m", builtin=True, log_dir=tmp_path).argv
    router_only, _ = parse(["--role", "router", "--decode-url", "http://127.0.0.1:30002"])
    assert router_spec(router_only).argv[2] == "smg.launch_router"


@pytest.mark.parametrize("argv, environ, scope", [
    (["--role", "all"], {}, keys.Scope.ADMIN),  # makes its secret at start
    (["--role", "all", "--mode", "upstream"], {}, keys.Scope.ADMIN),
    (["--role", "colocated"], {}, keys.Scope.ADMIN),
    (["--role", "all", "--host", "0.0.0.0"], {}, keys.Scope.ALL),
    (["--role", "colocated", "--host", "10.0.0.1"], {}, keys.Scope.ALL),
    (["--role", "prefill", "--mode", "upstream"], {}, keys.Scope.NONE),  # loopback, no secret
    (["--role", "prefill", "--mode", "upstream"], {SECRET_ENV: SECRET}, keys.Scope.ADMIN),
    (["--role", "decode", "--prefill-messenger", "127.0.0.1:30003"], {SECRET_FILE_ENV: "/s"}, keys.Scope.ADMIN),
    (["--role", "router", "--decode-url", "http://127.0.0.1:30002"], {}, keys.Scope.NONE),
    (["--role", "router", "--decode-url", "http://127.0.0.1:30002"], {SECRET_ENV: SECRET}, keys.Scope.ADMIN),
    (["--role", "router", "--decode-url", "http://10.0.0.2:30002"], {}, keys.Scope.ALL),
])
def test_the_scope_follows_where_ports_are_bound_and_whether_a_secret_is_held(argv, environ, scope):
    cfg, _ = parse(argv)
    assert keys.scope(cfg, environ) is scope
    assert (scope.api, scope.admin) == {keys.Scope.NONE: (False, False), keys.Scope.ADMIN: (False, True),
                                        keys.Scope.ALL: (True, True)}[scope]


def test_sglang_takes_both_keys_from_the_file_the_launcher_writes(tmp_path, secret_file):
    from sglang.srt.server_args import prepare_server_args

    from sglang_disagg.models import resolve_model_path

    k = keys.HttpKeys.derive(SECRET.encode())
    keys.write(k, tmp_path, ["decode"])
    for name in ("api-key", "admin-key", "decode.keys.yaml"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    assert (tmp_path / "api-key").read_text().strip() == k.api
    assert yaml.safe_load((tmp_path / "decode.keys.yaml").read_text()) == {"api-key": k.api, "admin-api-key": k.admin}
    args = prepare_server_args(["--config", str(keys.server_config(tmp_path, "decode")), "--model-path",
                                str(resolve_model_path("tiny-llama")), "--device", "cpu"])
    assert (args.api_key, args.admin_api_key) == (k.api, k.admin)


def test_on_loopback_sglang_takes_the_admin_key_only_and_the_node_writes_no_api_key(tmp_path):
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    from sglang_disagg.models import resolve_model_path

    k = keys.HttpKeys.derive(SECRET.encode())
    written = keys.write(k, tmp_path, ["decode"], keys.Scope.ADMIN)
    assert sorted(p.name for p in written) == ["admin-key", "decode.keys.yaml"]
    assert not (tmp_path / "api-key").exists()  # serving takes none: no file to mislead a client
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in written)
    assert (tmp_path / "admin-key").read_text() == k.admin + "\n"
    assert yaml.safe_load((tmp_path / "decode.keys.yaml").read_text()) == {"admin-api-key": k.admin}
    args = prepare_server_args(["--config", str(keys.server_config(tmp_path, "decode")), "--model-path",
                                str(resolve_model_path("tiny-llama")), "--device", "cpu"])
    assert (args.api_key, args.admin_api_key) == (None, k.admin)

    def allowed(path: str, level: AuthLevel, key: str | None, api_key: str | None = None) -> bool:
        return decide_request_auth(method="POST", path=path, authorization_header=key and f"Bearer {key}",
                                   api_key=api_key, admin_api_key=k.admin, auth_level=level).allowed

    # SGLang's own decision with these settings: serving open, admin endpoints the admin key only.
    assert allowed("/generate", AuthLevel.NORMAL, None)
    assert not allowed("/flush_cache", AuthLevel.ADMIN_OPTIONAL, None)
    assert not allowed("/flush_cache", AuthLevel.ADMIN_OPTIONAL, "f" * 64)  # a wrong key
    assert allowed("/flush_cache", AuthLevel.ADMIN_OPTIONAL, k.admin)
    # Beyond loopback (Scope.ALL, both keys): serving refused without the API key.
    for path in ("/generate", "/v1/chat/completions"):
        assert not allowed(path, AuthLevel.NORMAL, None, api_key=k.api)
        assert not allowed(path, AuthLevel.NORMAL, "f" * 64, api_key=k.api)
        assert allowed(path, AuthLevel.NORMAL, k.api, api_key=k.api)
    assert not allowed("/flush_cache", AuthLevel.ADMIN_OPTIONAL, k.api, api_key=k.api)


def test_the_patched_redaction_hides_both_keys_in_arguments_and_command_lines():
    """The helpers of the patch server_info-redact-the-API-keys (/get_server_info answers an
    API-key holder with the resolved args and the launch command, which held the admin key).
    The live answer is checked against a keyed deployment in tests/hosts/http_keys.py."""
    from sglang.srt.sampling.watermarking.core import redact_watermark_command_line, redact_watermark_secrets

    shown = redact_watermark_secrets({"api_key": "A" * 32, "admin_api_key": "B" * 32, "port": 30002})
    assert shown == {"api_key": "<redacted>", "admin_api_key": "<redacted>", "port": 30002}
    line = redact_watermark_command_line(["--api-key", "A" * 32, "--admin-api-key=" + "B" * 32, "--port", "30002"])
    assert line == "--api-key <redacted> --admin-api-key=<redacted> --port 30002"


def test_the_router_gets_its_keys_in_process_and_refuses_them_as_arguments(monkeypatch, secret_file, capsys):
    import smg.launch_router

    started = []
    monkeypatch.setattr(smg.launch_router, "launch_router", started.append)
    monkeypatch.setenv(SECRET_FILE_ENV, secret_file)
    assert smg_router.main(["--host", "10.0.0.9", "--port", "30000", "--worker-urls", "http://10.0.0.2:30002"]) == 0
    k = keys.HttpKeys.derive(SECRET.encode())
    [args] = started
    assert args.api_key == k.api and args.worker_urls == ["http://10.0.0.2:30002"]
    assert args.control_plane_api_keys == [(keys.ROUTER_ADMIN_ID, keys.ROUTER_ADMIN_ID, k.admin, "admin")]
    assert smg_router.main(["--scope", "admin", "--port", "30001"]) == 0  # loopback: control plane only
    assert started[-1].api_key is None and started[-1].control_plane_api_keys == [
        (keys.ROUTER_ADMIN_ID, keys.ROUTER_ADMIN_ID, k.admin, "admin")]
    assert smg_router.main(["--scope", "none", "--port", "30001"]) == 2
    assert smg_router.main(["--scope", "some", "--port", "30001"]) == 2
    assert smg_router.main(["--api-key", "x" * 32]) == 2 and "not arguments" in capsys.readouterr().err
    monkeypatch.delenv(SECRET_FILE_ENV)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert smg_router.main(["--port", "30000"]) == 2
    assert f"give --secret-file PATH or set {SECRET_ENV}" in capsys.readouterr().err and len(started) == 2


def test_a_node_reachable_from_elsewhere_needs_the_secret_and_one_machine_makes_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    router, _ = parse(["--role", "router", "--host", "10.0.0.9", "--decode-url", "http://10.0.0.2:30002"])
    with pytest.raises(ValueError, match=r"--role router on 10\.0\.0\.9 \(its HTTP keys derive from it\) needs the "
                                         r"deployment's shared secret"):
        secret.check(router)
    colocated, _ = parse(["--role", "colocated", "--host", "0.0.0.0"])
    made = secret.with_secret(colocated, tmp_path)  # every process here: a fresh secret, as --role all makes
    assert made.secret_file == str(tmp_path / "secret") and keys.load(made) is not None
    loopback, _ = parse(["--role", "colocated"])  # on loopback too: its admin key derives from it
    (tmp_path / "x").mkdir(mode=0o700)  # the stack's log dir
    made = secret.with_secret(loopback, tmp_path / "x")
    assert made.secret_file == str(tmp_path / "x" / "secret") and keys.scope(made) is keys.Scope.ADMIN
    assert keys.load(made) == keys.HttpKeys.derive((tmp_path / "x" / "secret").read_text().strip().encode())
    upstream_prefill, _ = parse(["--role", "prefill", "--mode", "upstream"])
    assert secret.with_secret(upstream_prefill, tmp_path / "y") == upstream_prefill
    assert keys.load(upstream_prefill) is None and not (tmp_path / "y").exists()


def test_a_key_on_the_servers_command_line_is_refused():
    with pytest.raises(ValueError, match="--admin-api-key: a key on a command line is readable by any user"):
        parse(["--role", "all", "--admin-api-key=abc"])


def test_a_router_stack_writes_the_key_files_and_its_requests_present_the_keys(tmp_path, secret_file):
    cfg = LaunchConfig(role=Role.ROUTER, model="tiny-llama", host="10.0.0.9", decode_urls=("http://10.0.0.2:30002",),
                       secret_file=secret_file, log_dir=str(tmp_path / "logs"))
    stack = Stack.for_config(cfg)
    k = keys.HttpKeys.derive(SECRET.encode())
    assert stack.keys == k and (tmp_path / "logs" / "api-key").read_text().strip() == k.api
    assert (tmp_path / "logs" / "admin-key").read_text().strip() == k.admin
    assert stack.client_kw == {"api_key": k.api, "tls": None}
    assert client.headers(k.api)["Authorization"] == f"Bearer {k.api}"
    assert stack.scope is keys.Scope.ALL and stack.admin_kw == {"api_key": k.admin, "tls": None}
    open_stack = dataclasses.replace(cfg, host="127.0.0.1", decode_urls=("http://127.0.0.1:30002",),
                                     log_dir=str(tmp_path / "open"))
    loopback = Stack.for_config(open_stack)  # holds the secret: the admin key only
    assert loopback.client_kw["api_key"] == ""  # a caller's SGLANG_DISAGG_API_KEY not sent
    assert loopback.scope is keys.Scope.ADMIN and loopback.admin_key == k.admin
    assert sorted(p.name for p in (tmp_path / "open").iterdir()) == ["admin-key"]
    loopback.stop()
    assert list((tmp_path / "open").iterdir()) == []


def test_the_start_up_text_says_what_another_user_of_the_machine_can_do(tmp_path, secret_file):
    from sglang_disagg.launch.__main__ import keys_lines

    cfg = LaunchConfig(role=Role.ROUTER, model="tiny-llama", decode_urls=("http://127.0.0.1:30002",),
                       secret_file=secret_file, log_dir=str(tmp_path / "logs"))
    [line] = keys_lines(Stack.for_config(cfg))
    assert "other users of this machine can send requests" in line and "reachable from this machine only" not in line
    assert f"take the admin key in {tmp_path / 'logs' / 'admin-key'}" in line
    [line] = keys_lines(Stack.for_config(dataclasses.replace(cfg, secret_file=None, log_dir=str(tmp_path / "n"))))
    assert "every user of this machine can send requests and use the admin endpoints" in line


def test_clients_read_the_key_from_the_environment_unless_given_one(monkeypatch):
    monkeypatch.setenv(keys.API_KEY_ENV, "k" * 64)
    assert client.headers()["Authorization"] == "Bearer " + "k" * 64
    assert "Authorization" not in client.headers("")  # a keyless stack's own requests


def test_the_key_command_prints_one_derived_key(secret_file, capsys):
    assert main(["key", "admin", "--secret-file", secret_file]) == 0
    assert capsys.readouterr().out.strip() == keys.HttpKeys.derive(SECRET.encode()).admin


def test_tls_on_the_routers_front_door(tmp_path):
    cfg, _ = parse(["--role", "all", "--tls-cert-path", "/etc/tls.crt", "--tls-key-path", "/etc/tls.key"])
    argv = list(router_spec(cfg).argv)
    assert argv[argv.index("--tls-cert-path") + 1] == "/etc/tls.crt" and "--tls-key-path" in argv
    assert ManagedProcess(router_spec(cfg), tmp_path).url.startswith("https://")
    with pytest.raises(ValueError, match="come together"):
        parse(["--role", "all", "--tls-cert-path", "/etc/tls.crt"])
    with pytest.raises(ValueError, match="TLS is the router's"):
        parse(["--role", "decode", "--prefill-messenger", "h:1", "--tls-cert-path", "a", "--tls-key-path", "b"])


def test_every_rendered_node_takes_the_secret_from_a_secret_and_no_key_on_its_command_line():
    docs = kubernetes(load(EXAMPLE), "serving")
    assert problems(docs, "cpu") == []
    router = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    no_secret = copy.deepcopy(docs)
    target = next(d for d in no_secret if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    target["env"] = [e for e in router["env"] if e["name"] != SECRET_ENV]
    assert any("a router bound to $(POD_IP) needs SGLANG_DISAGG_SECRET from a Secret" in p
               for p in problems(no_secret, "cpu"))
    target["args"] = router["args"] + ["--api-key", "x" * 32]
    assert any("--api-key: a key on a command line" in p for p in problems(no_secret, "cpu"))


def test_a_router_serving_https_in_kubernetes_takes_its_certificate_from_a_tls_secret(tmp_path):
    from sglang_disagg.launch import pods
    from sglang_disagg.launch.render_ome import ome

    path = tmp_path / "d.toml"
    path.write_text(EXAMPLE.read_text().replace("[router]\n", '[router]\ntls_cert_path = "/etc/r/tls.crt"\n'
                                                              'tls_key_path = "/etc/r/tls.key"\n'))
    docs = kubernetes(load(path), "serving")
    assert problems(docs, "cpu") == []
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    router = pod["containers"][0]
    cfg, _ = parse([a.replace("$(POD_IP)", "10.9.9.9") for a in router["args"][2:]])
    assert (cfg.tls_cert_path, cfg.tls_key_path) == (f"{pods.TLS_DIR}/tls.crt", f"{pods.TLS_DIR}/tls.key")
    assert pod["volumes"] == [{"name": "tls", "secret": {"secretName": "sglang-disagg-tls"}}]
    assert router["volumeMounts"] == [{"name": "tls", "mountPath": pods.TLS_DIR, "readOnly": True}]
    assert router["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    with pytest.raises(ValueError, match="render ome: \\[router\\] tls_cert_path"):
        ome(load(path))
