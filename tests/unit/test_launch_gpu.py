"""The launcher's GPU profile (--device cuda): placement, flags, refusals and --dry-run.
Pure command-line building and the CLI in --dry-run; nothing here needs or claims a GPU."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time

import pytest

from sglang_disagg.launch import LaunchConfig, Mode, Role
from sglang_disagg.launch.__main__ import parse
from sglang_disagg.launch.commands import router_spec, server_spec
from sglang_disagg.launch.gpu import DEFAULT_SHARE, plan
from sglang_disagg.launch.preflight import PreflightError, check_cuda, cuda_problems
from sglang_disagg.launch.render import launcher_argv

CPU_ONLY_FLAGS = ("--max-total-tokens", "--sleep-on-idle", "--disable-cuda-graph", "torch_native")
CPU_ONLY_ENV = ("OMP_NUM_THREADS", "SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_DISAGG_SUBPROCESS_START",
                "SGLANG_USE_CPU_ENGINE", "MC_FORCE_TCP", "UCX_NET_DEVICES")


def _flag(argv, name):
    argv = list(argv)
    return argv[argv.index(name) + 1] if name in argv else None


def _gpus_of(argv) -> tuple[int, ...]:
    """The GPUs SGLang puts a server's ranks on: base + r * step for r < tp."""
    base, step, tp = int(_flag(argv, "--base-gpu-id")), int(_flag(argv, "--gpu-id-step") or 1), int(_flag(argv, "--tp"))
    return tuple(base + r * step for r in range(tp))


def _cuda(*args: str):
    cfg, _ = parse(["--role", "all", "--device", "cuda", *args])
    return cfg, server_spec(cfg, Role.PREFILL, "/m", builtin=True), server_spec(cfg, Role.DECODE, "/m", builtin=True)


@pytest.mark.parametrize("gpus", [1, 2, 4])
@pytest.mark.parametrize("ptp, dtp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_role_all_places_prefill_and_decode_on_disjoint_gpus_or_shares_them_with_memory_fractions(gpus, ptp, dtp):
    args = ("--gpus", str(gpus), "--prefill-tp", str(ptp), "--decode-tp", str(dtp))
    if max(ptp, dtp) > gpus:
        with pytest.raises(ValueError, match=rf"-tp {max(ptp, dtp)} needs {max(ptp, dtp)} GPUs and this machine has {gpus}"):
            _cuda(*args)
        return
    cfg, prefill, decode = _cuda(*args)
    p, d = _gpus_of(prefill.argv), _gpus_of(decode.argv)
    assert p == tuple(range(ptp))
    if ptp + dtp <= gpus:  # enough for both: the next ones, no GPU shared, SGLang's own memory fraction
        assert d == tuple(range(ptp, ptp + dtp)) and not set(p) & set(d)
        assert "--mem-fraction-static" not in prefill.argv + decode.argv
        assert cfg.gpu_plan().shared == ()
    else:  # too few: decode on the last ones, each server holding DEFAULT_SHARE of a shared GPU
        assert d == tuple(range(gpus - dtp, gpus)) and set(p) & set(d)
        fp, fd = float(_flag(prefill.argv, "--mem-fraction-static")), float(_flag(decode.argv, "--mem-fraction-static"))
        # decode starts after prefill and takes its fraction of what prefill left free
        assert fp == DEFAULT_SHARE and fd == pytest.approx(DEFAULT_SHARE / (1 - DEFAULT_SHARE), abs=1e-3)
        held = fp + fd * (1 - fp)  # of the GPU's memory, by both servers' weights and KV pools
        assert held == pytest.approx(2 * DEFAULT_SHARE, abs=1e-3) and held < 0.85
        assert cfg.gpu_plan().shared == tuple(sorted(set(p) & set(d)))
    for spec in (prefill, decode):
        argv, env = list(spec.argv), dict(spec.env)
        assert _flag(argv, "--device") == "cuda" and _flag(argv, "--dtype") == "bfloat16"
        assert _flag(argv, "--attention-backend") == "fa3" and env["SGLANG_USE_HND_KVCACHE"] == "1"
        assert "--skip-server-warmup" in argv  # messenger servers: see commands._messenger_server
        assert not [f for f in CPU_ONLY_FLAGS if f in argv] and not [k for k in CPU_ONLY_ENV if k in env]
        assert "CUDA_VISIBLE_DEVICES" not in env  # placement by --base-gpu-id: every server sees every GPU


def test_explicit_gpu_sets_are_validated():
    _, prefill, decode = _cuda("--gpus", "4", "--prefill-tp", "2", "--decode-tp", "2",
                               "--prefill-gpus", "0,1", "--decode-gpus", "2,3")
    assert (_gpus_of(prefill.argv), _gpus_of(decode.argv)) == ((0, 1), (2, 3))
    assert "--mem-fraction-static" not in prefill.argv + decode.argv
    _, prefill, decode = _cuda("--gpus", "4", "--prefill-tp", "2", "--decode-tp", "2",
                               "--prefill-gpus", "0,2", "--decode-gpus", "1,3")
    assert _flag(prefill.argv, "--gpu-id-step") == "2" and (_gpus_of(prefill.argv), _gpus_of(decode.argv)) == (
        (0, 2), (1, 3))
    _, prefill, decode = _cuda("--gpus", "3", "--prefill-tp", "2", "--decode-tp", "2",
                               "--prefill-gpus", "0,1", "--decode-gpus", "1,2")  # overlap: with fractions
    assert _flag(prefill.argv, "--mem-fraction-static") == "0.400" == f"{DEFAULT_SHARE:.3f}"
    _, prefill, decode = _cuda("--gpus", "1", "--shared-gpu-fraction", "0.3")
    assert (_flag(prefill.argv, "--mem-fraction-static"), _flag(decode.argv, "--mem-fraction-static")) == (
        "0.300", "0.429")
    _, prefill, decode = _cuda("--gpus", "4", "--decode-gpus", "0")  # prefill avoids decode's GPU
    assert (_gpus_of(prefill.argv), _gpus_of(decode.argv)) == ((1,), (0,))
    for args, message in (
            (("--gpus", "4", "--prefill-tp", "2", "--prefill-gpus", "0"), "names 1 GPU.* for TP 2"),
            (("--gpus", "2", "--decode-gpus", "2"), "GPU 2 does not exist: this machine has GPUs 0..1"),
            (("--gpus", "4", "--prefill-tp", "3", "--prefill-gpus", "0,1,3"), "evenly spaced"),
            (("--gpus", "4", "--prefill-tp", "2", "--prefill-gpus", "1,0"), "increasing"),
            (("--gpus", "2", "--shared-gpu-fraction", "0.6"), "must be in 0.05..0.45"),
            (("--gpus", "0",), "--gpus must be >= 1")):
        with pytest.raises(ValueError, match=message):
            _cuda(*args)
    with pytest.raises(SystemExit):  # argparse: not GPU ids
        parse(["--role", "all", "--device", "cuda", "--prefill-gpus", "a,b"])
    with pytest.raises(ValueError, match="applies to --device cuda, not cpu"):
        parse(["--role", "all", "--gpus", "2"])
    with pytest.raises(ValueError, match="no prefill server runs on this machine"):
        LaunchConfig(role=Role.DECODE, model="tiny-llama", device="cuda", gpus=2, prefill_gpus=(0,),
                     prefill_messengers=("10.0.0.1:30003",))


def test_single_server_roles_take_the_first_gpus_or_the_ones_named():
    cfg = LaunchConfig(role=Role.DECODE, model="tiny-llama", device="cuda", gpus=8, decode_tp=4, decode_gpus=(4, 5, 6, 7),
                       prefill_messengers=("10.0.0.1:30003",))
    assert _gpus_of(server_spec(cfg, Role.DECODE, "/m", builtin=True).argv) == (4, 5, 6, 7)
    cfg = LaunchConfig(role=Role.PREFILL, model="tiny-llama", device="cuda", gpus=8, prefill_tp=2)
    spec = server_spec(cfg, Role.PREFILL, "/m", builtin=True)
    assert _gpus_of(spec.argv) == (0, 1) and "--mem-fraction-static" not in spec.argv
    assert plan(8, None, None).prefill is None  # a router has no GPUs


@pytest.mark.parametrize("args, message", [
    (("--attention-backend", "triton"), r"--attention-backend triton cannot read the messenger's KV pool \(HND"),
    (("--attention-backend", "flashinfer"), r'kv_layout="HND" is not in this patch series yet'),
    (("--attention-backend", "flex_attention"), "does not read the HND KV layout; backends that can: fa3, trtllm_mha"),
    (("--decode-attention-backend", "triton"), "--decode-attention-backend triton cannot read"),  # passed through
    (("--prefill-attention-backend=flashinfer",), "--prefill-attention-backend flashinfer cannot read"),
    (("--enable-deterministic-inference", "--attention-backend", "trtllm_mha"), "deterministic-inference .* needs fa3"),
    (("--dtype", "float32"), "float32 with --attention-backend fa3: its kernels run bfloat16/float16 only"),
])
def test_backends_that_cannot_read_the_hnd_pool_are_refused_while_the_messenger_is_on(args, message):
    with pytest.raises(ValueError, match=message):
        _cuda("--gpus", "2", *args)


def test_backends_that_read_hnd_or_run_without_the_messenger_are_passed():
    for backend in ("trtllm_mha", "torch_native"):
        _, prefill, _ = _cuda("--gpus", "2", "--attention-backend", backend)
        assert _flag(prefill.argv, "--attention-backend") == backend
    _, prefill, _ = _cuda("--gpus", "2", "--attention-backend", "torch_native", "--dtype", "float32")
    assert _flag(prefill.argv, "--dtype") == "float32"
    cfg, prefill, decode = _cuda("--gpus", "2", "--mode", "upstream", "--attention-backend", "triton")
    assert _flag(prefill.argv, "--attention-backend") == "triton"
    cfg, prefill, decode = _cuda("--gpus", "2", "--mode", "upstream")
    for spec in (prefill, decode):  # upstream on CUDA: SGLang's own backend choice, warm-up, overlap, backup
        argv = list(spec.argv)
        assert "--attention-backend" not in argv and "--skip-server-warmup" not in argv
        assert "--disable-overlap-schedule" not in argv and "cpu_tensor" not in argv
        assert "SGLANG_USE_HND_KVCACHE" not in dict(spec.env)
    assert (_gpus_of(prefill.argv), _gpus_of(decode.argv)) == ((0,), (1,))
    colocated = LaunchConfig(role=Role.COLOCATED, model="tiny-llama", device="cuda", gpus=1, attention_backend="triton")
    argv = server_spec(colocated, Role.COLOCATED, "/m", builtin=True).argv
    assert _flag(argv, "--attention-backend") == "triton" and _gpus_of(argv) == (0,)


def test_dtype_is_the_models_own_on_cuda_and_deterministic_inference_is_passed_through():
    cfg, _ = parse(["--role", "all", "--device", "cuda", "--gpus", "2", "--model-path", "/models/qwen"])
    argv = server_spec(cfg, Role.PREFILL, "/models/qwen", builtin=False).argv
    assert "--dtype" not in argv  # SGLang's auto: a bf16 checkpoint runs bf16
    _, prefill, decode = _cuda("--gpus", "2", "--enable-deterministic-inference")
    assert "--enable-deterministic-inference" in prefill.argv and "--enable-deterministic-inference" in decode.argv
    _, prefill, _ = _cuda("--gpus", "2", "--dtype", "float16")
    assert _flag(prefill.argv, "--dtype") == "float16"
    cpu, _ = parse(["--role", "all"])
    argv = server_spec(cpu, Role.PREFILL, "/m", builtin=True).argv
    assert _flag(argv, "--dtype") == "float32" and _flag(argv, "--attention-backend") == "torch_native"
    assert "--base-gpu-id" not in argv and "--enable-deterministic-inference" not in argv


def test_gpu_flags_survive_a_rendered_deployment():
    cfg, _ = parse(["--role", "all", "--device", "cuda", "--gpus", "4", "--prefill-tp", "2", "--decode-tp", "2",
                    "--prefill-gpus", "0,1", "--decode-gpus", "2,3", "--attention-backend", "fa3",
                    "--shared-gpu-fraction", "0.3", "--enable-deterministic-inference"])
    again, _ = parse(launcher_argv(cfg))
    assert again == cfg


def test_cuda_problems_name_what_is_missing():
    assert cuda_problems("2.11.0+cu130", "13.0", True, ()) == []
    [only] = cuda_problems("2.11.0+cu130", "13.0", True, ("sgl_kernel",))
    assert "sgl_kernel package is not installed" in only
    assert "CPU-only build" in cuda_problems("2.11.0+cpu", None, False, ())[0]
    assert "torch.cuda.is_available() is False" in cuda_problems("2.11.0+cu130", "13.0", False, ())[0]
    assert cuda_problems(None, None, False, ("sgl_kernel",))[0] == "torch is not installed"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="the refusal of a machine without CUDA needs a machine without CUDA")
def test_the_real_probe_refuses_this_machine_naming_cuda_and_sgl_kernel(tmp_path, monkeypatch):
    cfg = LaunchConfig(role=Role.ALL, model="tiny-llama", device="cuda")
    with pytest.raises(PreflightError, match=r"torch.cuda.is_available\(\) is False") as e:
        check_cuda(cfg)
    assert "make setup DEVICE=cuda" in str(e.value) and "requirements/cuda.lock" in str(e.value)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sgl_kernel" else real(name, *a))
    with pytest.raises(PreflightError, match="the sgl_kernel package is not installed"):
        check_cuda(cfg)
    # The CLI refuses within seconds, before anything starts or is written.
    logs = tmp_path / "logs"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "sglang_disagg.launch", "--role", "all", "--device", "cuda",
                          "--log-dir", str(logs)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and time.monotonic() - t0 < 60, res.stderr
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("error: --device cuda cannot run here:") and "CUDA" in line
    assert not logs.exists()


def test_cli_dry_run_prints_each_process_and_starts_nothing(tmp_path):
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    res = subprocess.run([sys.executable, "-m", "sglang_disagg.launch", "--role", "all", "--device", "cuda",
                          "--gpus", "2", "--model-path", "tiny-llama", "--log-dir", str(logs), "--port", "31000",
                          "--dry-run"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "2 GPU(s) (--gpus)" in out and "nothing is started" in out and not logs.exists()
    commands = [shlex.split(ln) for ln in out.splitlines() if ln.startswith("  ") and "launch" in ln]
    # the router with its admin key set in-process (keys.Scope.ADMIN on loopback)
    assert [c[2] for c in commands] == ["sglang.launch_server", "sglang.launch_server", "sglang_disagg.launch.smg_router"]
    cfg, _ = parse(["--role", "all", "--device", "cuda", "--gpus", "2", "--model-path", "tiny-llama",
                    "--log-dir", str(logs), "--port", "31000"])
    cfg = dataclasses.replace(cfg, secret_file=str(logs / "secret"))  # --role all makes it there at start
    from sglang_disagg.launch.dryrun import _model_path

    want = [server_spec(cfg, r, _model_path(cfg), True, logs) for r in (Role.PREFILL, Role.DECODE)]
    assert commands == [list(w.argv) for w in want] + [list(router_spec(cfg).argv)]
    for w in want:  # and the environment the launcher sets, each variable on its line
        for k, v in w.env:
            assert f"  {k}={shlex.quote(v)}" in out.splitlines()
    assert "OMP_NUM_THREADS" not in out and "torch_native" not in out


def test_dry_run_without_gpus_plans_for_the_fewest_the_tp_sizes_need(capsys):
    from sglang_disagg.launch.__main__ import main

    if _has_cuda():
        pytest.skip("GPUs are visible here: the dry run counts them")
    # tiny-llama: 4 heads shard by 2 (the default model's 9 do not, and the dry run refuses that)
    assert main(["--role", "all", "--device", "cuda", "--model-path", "tiny-llama", "--prefill-tp", "2",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 GPU(s) assumed: none visible here" in out
    assert "# prefill: GPUs 0,1" in out and "# decode: GPU 2" in out
    assert main(["--role", "all", "--mode", "upstream", "--dry-run"]) == 0  # CPU too
    assert "--attention-backend torch_native" in capsys.readouterr().out


def test_stack_for_config_builds_gpu_servers_without_probing(tmp_path):
    from sglang_disagg.launch import Stack

    stack = Stack.for_config(LaunchConfig(role=Role.ALL, model="tiny-llama", device="cuda", gpus=1,
                                          log_dir=str(tmp_path), mode=Mode.MESSENGER))
    assert [_gpus_of(p.spec.argv) for p in stack.servers] == [(0,), (0,)]
    assert stack.cfg.gpu_plan().shared == (0,)  # so start() starts decode once prefill is healthy
