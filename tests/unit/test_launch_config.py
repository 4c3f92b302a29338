"""Launcher configuration and command lines (pure: no process is started)."""

from __future__ import annotations

import socket

import pytest

from sglang_disagg.launch import LaunchConfig, Mode, Role
from sglang_disagg.messenger.config import ENV as MESSENGER_ENV
from sglang_disagg.messenger.config import MessengerConfig
from sglang_disagg.launch.__main__ import parse
from sglang_disagg.launch.commands import launcher_registered_workers, router_spec, server_spec
from sglang_disagg.launch.render import launcher_argv
from sglang_disagg.launch.preflight import PreflightError, check_ports_free


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_upstream_all_role_ports_and_flags():
    cfg, smoke = parse(["--role", "all", "--mode", "upstream", "--port", "40000", "--transfer-backend", "nixl",
                        "--chunked-prefill-size", "64"])
    assert not smoke and cfg.mode is Mode.UPSTREAM and cfg.transfer_backend == "nixl"
    prefill = server_spec(cfg, Role.PREFILL, "/m", builtin=True)
    decode = server_spec(cfg, Role.DECODE, "/m", builtin=True)
    assert _flag(prefill.argv, "--port") == "40001" and _flag(decode.argv, "--port") == "40002"
    assert _flag(prefill.argv, "--disaggregation-bootstrap-port") == "40003"
    assert _flag(prefill.argv, "--disaggregation-transfer-backend") == "nixl"
    assert "--disable-overlap-schedule" in prefill.argv
    assert _flag(decode.argv, "--disaggregation-decode-retraction-backup") == "cpu_tensor"
    assert _flag(prefill.argv, "--dtype") == "float32"  # built-in models run float32
    # pass-through arguments reach every server
    assert _flag(prefill.argv, "--chunked-prefill-size") == "64" == _flag(decode.argv, "--chunked-prefill-size")
    router = router_spec(cfg)
    assert router.argv[router.argv.index("--prefill") + 1:][:2] == ("http://127.0.0.1:40001", "40003")
    assert _flag(router.argv, "--decode") == "http://127.0.0.1:40002"
    assert dict(prefill.env)["SGLANG_USE_CPU_ENGINE"] == "1"
    assert MESSENGER_ENV not in dict(prefill.env)


def test_messenger_is_the_default_mode():
    cfg, _ = parse(["--role", "all", "--port", "40000", "--chunked-prefill-size", "64"])
    assert cfg.mode is Mode.MESSENGER and cfg.transfer_backend == "shmem" and cfg.transfer_provider is None
    prefill = server_spec(cfg, Role.PREFILL, "/m", builtin=True)
    decode = server_spec(cfg, Role.DECODE, "/m", builtin=True)
    for spec, role in ((prefill, "prefill"), (decode, "decode")):
        env = dict(spec.env)
        assert env["SGLANG_USE_HND_KVCACHE"] == "1"
        assert _flag(spec.argv, "--page-size") == "16"
        # prefill's KV is taken when its forward returns; a decoder keeps SGLang's overlap loop
        assert ("--disable-overlap-schedule" in spec.argv) == (role == "prefill")
        assert "--disaggregation-mode" not in spec.argv  # SGLang's own PD path is not used
        mc = MessengerConfig.from_json(env[MESSENGER_ENV])
        assert mc.role.value == role and mc.backend == "shmem" and mc.provider is None
    assert MessengerConfig.from_json(dict(prefill.env)[MESSENGER_ENV]).port == 40003
    assert MessengerConfig.from_json(dict(decode.env)[MESSENGER_ENV]).prefill == ("127.0.0.1:40003",)
    router = router_spec(cfg)
    assert "--pd-disaggregation" not in router.argv
    assert launcher_registered_workers(cfg) == ["http://127.0.0.1:40002"]  # decoders only


def test_the_failing_link_recheck_reaches_the_decoder_and_survives_a_rendered_deployment():
    cfg, _ = parse(["--role", "all", "--port", "40000", "--link-recheck", "4"])
    decode = server_spec(cfg, Role.DECODE, "/m", builtin=True)
    assert MessengerConfig.from_json(dict(decode.env)[MESSENGER_ENV]).recheck_s == 4.0
    assert parse(launcher_argv(cfg))[0] == cfg
    default, _ = parse(["--role", "all", "--port", "40000"])
    assert "--link-recheck" not in launcher_argv(default)


def test_messenger_backends_come_from_the_registry():
    cfg, _ = parse(["--role", "all", "--backend", "nixl"])
    assert cfg.transfer_backend == "nixl" and cfg.transfer_provider is None
    with pytest.raises(ValueError, match="transfer backends are"):
        LaunchConfig(role=Role.ALL, model="tiny-llama", backend="carrier-pigeon")
    with pytest.raises(ValueError, match="--provider is a libfabric setting"):
        LaunchConfig(role=Role.ALL, model="tiny-llama", backend="nixl", provider="tcp")
    cross = LaunchConfig(role=Role.DECODE, model="tiny-llama", prefill_messengers=("10.0.0.1:30003",))
    assert (cross.transfer_backend, cross.transfer_provider) == ("libfabric", "tcp")  # across machines


def test_the_default_backend_is_shmem_on_one_host_and_libfabric_tcp_across_hosts_and_on_cuda():
    one_host = LaunchConfig(role=Role.ALL, model="tiny-llama")
    assert (one_host.transfer_backend, one_host.transfer_provider) == ("shmem", None)
    assert one_host.describe_transfer() == "mode messenger, backend shmem"  # --smoke's "carried by"
    for role, kw in ((Role.PREFILL, {}), (Role.DECODE, {"prefill_messengers": ("10.0.0.1:30003",)})):
        cfg = LaunchConfig(role=role, model="tiny-llama", **kw)
        assert (cfg.transfer_backend, cfg.transfer_provider) == ("libfabric", "tcp"), role
    # --provider alone means libfabric, on one host too
    tcp = LaunchConfig(role=Role.ALL, model="tiny-llama", provider="tcp")
    assert (tcp.transfer_backend, tcp.transfer_provider) == ("libfabric", "tcp")
    # on CUDA the default stays libfabric (until the device check has run on a GPU); its shm is gone: tcp
    cuda = LaunchConfig(role=Role.ALL, model="tiny-llama", device="cuda", gpus=2)
    assert (cuda.transfer_backend, cuda.transfer_provider) == ("libfabric", "tcp")


@pytest.mark.parametrize("argv", [["--role", "all", "--provider", "shm"],
                                  ["--role", "all", "--backend", "libfabric", "--provider", "shm"],
                                  ["--role", "prefill", "--provider", "shm"]])
def test_provider_shm_is_refused_saying_why(argv):
    from sglang_disagg.backends.libfabric import SHM_REFUSED

    with pytest.raises(ValueError) as e:
        parse(argv)
    assert str(e.value) == f"--provider shm: {SHM_REFUSED}"
    assert "cannot be bounded from outside using libfabric's public API" in str(e.value)
    assert "use the shmem backend on one host, libfabric provider tcp across hosts" in str(e.value)


def test_each_server_gets_threads_for_its_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    cfg = LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_tp=2)
    prefill = dict(server_spec(cfg, Role.PREFILL, "/m", builtin=True).env)
    decode = dict(server_spec(cfg, Role.DECODE, "/m", builtin=True).env)
    assert prefill["OMP_NUM_THREADS"] == "2" and prefill["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert decode["OMP_NUM_THREADS"] == "4"
    colocated = LaunchConfig(role=Role.COLOCATED, model="tiny-llama")
    assert dict(server_spec(colocated, Role.COLOCATED, "/m", builtin=True).env)["OMP_NUM_THREADS"] == "8"


def test_pin_cores_pins_each_server_of_role_all_to_its_half(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    cfg, _ = parse(["--role", "all", "--pin-cores"])
    assert server_spec(cfg, Role.PREFILL, "/m", builtin=True).cpus == (0, 1, 2, 3)
    assert server_spec(cfg, Role.DECODE, "/m", builtin=True).cpus == (4, 5, 6, 7)
    assert router_spec(cfg).cpus == (0, 1, 2, 3)  # decode cores run decoding only
    unpinned, _ = parse(["--role", "all"])
    assert server_spec(unpinned, Role.PREFILL, "/m", builtin=True).cpus == ()
    assert router_spec(unpinned).cpus == ()


def test_a_messenger_stack_adds_its_decoder_to_its_router_itself():
    cfg, _ = parse(["--role", "all", "--port", "30000"])
    assert launcher_registered_workers(cfg) == ["http://127.0.0.1:30002"]
    assert "--worker-urls" not in router_spec(cfg).argv  # the router starts with no worker
    remote, _ = parse(["--role", "router", "--decode-url", "http://10.0.0.2:30002"])
    assert launcher_registered_workers(remote) == []
    argv = list(router_spec(remote).argv)
    assert argv[argv.index("--worker-urls") + 1] == "http://10.0.0.2:30002"


def test_servers_answer_health_probes_without_the_scheduler_and_by_model_name():
    cfg, _ = parse(["--role", "all", "--mode", "upstream", "--model-path", "tiny-llama"])
    for role in (Role.PREFILL, Role.DECODE):
        spec = server_spec(cfg, role, "/cache/tiny-llama-123", builtin=True)
        assert dict(spec.env)["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
        argv = list(spec.argv)
        assert argv[argv.index("--served-model-name") + 1] == "tiny-llama"
    # The router (smg) routes OpenAI requests by this name: a directory is served by its own name,
    # unless --served-model-name says otherwise.
    cfg, _ = parse(["--role", "colocated", "--model-path", "/models/my-model/"])
    argv = list(server_spec(cfg, Role.COLOCATED, "/models/my-model", builtin=False).argv)
    assert argv[argv.index("--served-model-name") + 1] == "my-model" == cfg.served_model_name
    cfg, _ = parse(["--role", "colocated", "--model-path", "/models/x", "--served-model-name", "alias"])
    assert cfg.served_model_name == "alias"
    argv = list(server_spec(cfg, Role.COLOCATED, "/models/x", builtin=False).argv)
    assert argv[len(argv) - 1 - argv[::-1].index("--served-model-name") + 1] == "alias"  # the last one wins


def test_tp2_binds_one_core_set_per_rank():
    cfg = LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_tp=2)
    env = dict(server_spec(cfg, Role.PREFILL, "/m", builtin=True).env)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in dict(server_spec(cfg, Role.DECODE, "/m", builtin=True).env)


def test_router_role_takes_remote_workers():
    cfg, _ = parse(["--role", "router", "--mode", "upstream", "--prefill-url", "http://10.0.0.1:30001@9000",
                    "--decode-url", "http://10.0.0.2:30002"])
    argv = router_spec(cfg).argv
    i = argv.index("--prefill")
    assert argv[i + 1:i + 3] == ("http://10.0.0.1:30001", "9000")


@pytest.mark.parametrize("kwargs, message", [
    ({"role": Role.ROUTER, "mode": Mode.UPSTREAM}, "needs at least one --prefill-url"),
    ({"role": Role.ROUTER}, "needs at least one --decode-url"),
    ({"role": Role.DECODE}, "needs at least one --prefill-messenger"),
    ({"role": Role.ALL, "mode": Mode.UPSTREAM, "backend": "fake"}, "fake only works for --role decode"),
    ({"role": Role.ALL, "mode": Mode.UPSTREAM, "backend": "libfabric"}, "upstream mode takes"),
    ({"role": Role.ALL, "port": 80}, "must be in 1024"),
    ({"role": Role.ALL, "prefill_tp": 0}, "must be >= 1"),
])  # a TP size beyond this machine's cores: refused at start (checks.check_cores), test_deployment_files.py
def test_invalid_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(model="tiny-llama", **kwargs)


def test_port_in_use_is_reported_before_starting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1] - 2  # the decode server's port is front + 2
        if port < 1024:
            pytest.skip("ephemeral port too low for this layout")
        cfg = LaunchConfig(role=Role.ALL, model="tiny-llama", port=port)
        with pytest.raises(PreflightError, match=rf"{port + 2} \(decode server\)"):
            check_ports_free(cfg)


def test_servers_started_one_by_one_need_the_deployments_secret(tmp_path, monkeypatch):
    from sglang_disagg.backends import auth
    from sglang_disagg.launch import Stack

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="shared secret"):
        Stack.for_config(LaunchConfig(role=Role.PREFILL, model="tiny-llama", log_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="--secret-file.*cannot read"):
        Stack.for_config(LaunchConfig(role=Role.DECODE, model="tiny-llama", log_dir=str(tmp_path),
                                      prefill_messengers=("127.0.0.1:30003",), secret_file=str(tmp_path / "none")))
    stack = Stack.for_config(LaunchConfig(role=Role.ALL, model="tiny-llama", log_dir=str(tmp_path / "all")))
    secret = tmp_path / "all" / "secret"  # --role all makes its own, private, and hands it to both servers
    assert secret.stat().st_mode & 0o077 == 0 and auth.load_secret({auth.SECRET_FILE_ENV: str(secret)})
    assert all(dict(p.spec.env)[auth.SECRET_FILE_ENV] == str(secret) for p in stack.servers)


def test_a_port_plan_inside_the_ephemeral_range_is_warned_about():
    from sglang_disagg.launch.preflight import ephemeral_overlap, ephemeral_range

    lo, hi = ephemeral_range()
    inside = LaunchConfig(role=Role.ALL, model="tiny-llama", port=lo + 232)
    warning = ephemeral_overlap(inside)
    assert f"ports {lo + 232}-{lo + 241} lie in the kernel's ephemeral port range {lo}-{hi}" in warning
    assert f"a --port below {lo - 10}" in warning
    assert ephemeral_overlap(LaunchConfig(role=Role.ALL, model="tiny-llama", port=lo - 20)) == ""


def test_a_bind_failure_names_the_port_its_purpose_and_the_way_out():
    import socket

    from sglang_disagg.launch.preflight import bind_failure, ephemeral_range

    lo, _ = ephemeral_range()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]  # an ephemeral port, as another process's connection takes
        log = "Traceback ...\nOSError: [Errno 98] Address already in use\n"
        line = bind_failure(log, (("decode server", port - 1 if port > lo else port + 1), ("decode metrics", port)),
                            "127.0.0.1")
    assert line.startswith(f"could not bind port {port} (decode metrics) on 127.0.0.1: another process took it")
    assert f"pick a --port below {lo - 10}" in line and "\n" not in line
    assert bind_failure("ValueError: something else", (("x", port),), "127.0.0.1") == ""


def test_a_launcher_confined_to_some_cores_sizes_its_servers_to_them(monkeypatch):
    """taskset, a container's cpuset or a Slurm step's binding: the launcher's affinity, not the
    machine's CPU count (2 OpenMP threads on one core froze a decoder for seconds under load)."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {5})
    colocated = LaunchConfig(role=Role.COLOCATED, model="tiny-llama")
    assert dict(server_spec(colocated, Role.COLOCATED, "/m", builtin=True).env)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {2, 3, 6, 7})
    cfg, _ = parse(["--role", "all", "--pin-cores"])
    assert server_spec(cfg, Role.PREFILL, "/m", builtin=True).cpus == (2, 3)
    assert server_spec(cfg, Role.DECODE, "/m", builtin=True).cpus == (6, 7)
