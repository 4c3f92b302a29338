"""Launcher configuration and command lines (pure: no process is started)."""

from __future__ import annotations

import socket

import pytest

from sglang_disagg.launch import LaunchConfig, Role, TransferBackend
from sglang_disagg.launch.__main__ import parse
from sglang_disagg.launch.commands import router_spec, server_spec
from sglang_disagg.launch.preflight import PreflightError, check_ports_free


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_all_role_ports_and_flags():
    cfg, smoke = parse(["--role", "all", "--port", "40000", "--transfer-backend", "nixl",
                        "--chunked-prefill-size", "64"])
    assert not smoke and cfg.backend is TransferBackend.NIXL
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


def test_tp2_binds_one_core_set_per_rank():
    cfg = LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_tp=2)
    env = dict(server_spec(cfg, Role.PREFILL, "/m", builtin=True).env)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in dict(server_spec(cfg, Role.DECODE, "/m", builtin=True).env)


def test_router_role_takes_remote_workers():
    cfg, _ = parse(["--role", "router", "--prefill-url", "http://10.0.0.1:30001@9000",
                    "--decode-url", "http://10.0.0.2:30002"])
    argv = router_spec(cfg).argv
    i = argv.index("--prefill")
    assert argv[i + 1:i + 3] == ("http://10.0.0.1:30001", "9000")


@pytest.mark.parametrize("kwargs, message", [
    ({"role": Role.ROUTER}, "needs at least one --prefill-url"),
    ({"role": Role.ALL, "backend": TransferBackend.FAKE}, "fake only works for --role decode"),
    ({"role": Role.ALL, "port": 80}, "must be in 1024"),
    ({"role": Role.ALL, "prefill_tp": 0}, "must be >= 1"),
    ({"role": Role.ALL, "prefill_tp": 64}, "exceeds the"),
])
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
