"""The pinned environments (requirements/*.lock) and how scripts/setup.sh picks one.

Each lock is installed with --no-deps, so it must be the whole resolution: exact pins,
one per package. The CUDA lock must hold SGLang 0.5.23's entire dependency list (read
from the installed SGLang's own metadata) at versions that satisfy it, with the CUDA
builds of NIXL and Mooncake; where the two locks share a package they pin the same
version, but for the differences cuda.lock's header explains. setup.sh installs
build.lock, the device's lock and nixl.lock: the device is DEVICE=cpu|cuda, else cuda
only when `nvidia-smi -L` lists a GPU. Offline: no registry is asked."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parents[2]
REQ = ROOT / "requirements"
SETUP = ROOT / "scripts" / "setup.sh"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")
# Shared packages whose pins may differ, each for a reason cuda.lock's header states.
CUDA_ONLY_VERSIONS = {"numpy", "cuda-bindings"}
# The platform both locks are resolved for (setup.sh's only target).
TARGET = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
          "python_version": "3.11", "python_full_version": "3.11.7", "extra": ""}


def pins(*names: str) -> dict[str, Version]:
    """The exact pins of the named lock files, merged (a package in two must agree)."""
    out: dict[str, Version] = {}
    for name in names:
        for n, line in enumerate((REQ / name).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            m = PIN.match(line)
            assert m, f"{name}:{n}: not an exact NAME==VERSION pin: {line!r}"
            pkg, version = canonicalize_name(m[1]), Version(m[2])
            assert out.get(pkg, version) == version, f"{name}:{n}: {pkg} pinned twice, differently"
            out[pkg] = version
    return out


def upstream_version() -> str:
    return re.search(r"^version=(\S+)$", (ROOT / "patches" / "UPSTREAM").read_text(), re.M)[1]


def setup_locks(device: str | None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DEVICE"}
    if device is not None:
        env["DEVICE"] = device
    return subprocess.run(["bash", str(cwd / "scripts" / "setup.sh"), "--print-locks"], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("lock", sorted(p.name for p in REQ.glob("*.lock")))
def test_every_lock_is_exact_pins_one_per_package(lock):
    found = pins(lock)
    lines = [l for l in (REQ / lock).read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert found and len(found) == len(lines)


def test_the_cuda_lock_has_sglang_its_cuda_kernels_and_the_cuda_builds():
    cuda = pins("cuda.lock", "nixl.lock")
    assert cuda["sglang"] == Version(upstream_version()) == Version("0.5.23")
    for pkg in ("sglang-kernel", "flashinfer-python", "flash-attn-4", "sgl-deep-gemm", "sgl-flash-mla"):
        assert pkg in cuda, f"{pkg} missing from the CUDA environment"
    assert cuda["nixl-cu13"] == cuda["nixl"]
    assert "mooncake-transfer-engine-cuda13" in cuda and "mooncake-transfer-engine-non-cuda" not in cuda
    # PyPI's torch for Linux x86_64 is the CUDA 13.0 build; its CUDA runtime comes as wheels.
    assert not cuda["torch"].local, "a local build tag (+cpu) would be a CPU-only torch"
    assert cuda["nvidia-cuda-runtime"].major == 13 and "nvidia-cudnn-cu13" in cuda


def test_the_cuda_lock_satisfies_sglangs_whole_dependency_list():
    """What `pip install sglang==0.5.23` would need on the target, all of it pinned compatibly."""
    if importlib.metadata.version("sglang") != upstream_version():
        pytest.skip("the installed SGLang is not the pinned release: its metadata would not apply")
    cuda = pins("cuda.lock", "nixl.lock")
    needed = [Requirement(r) for r in importlib.metadata.requires("sglang")]
    needed = [r for r in needed if r.marker is None or r.marker.evaluate(TARGET)]
    assert len(needed) > 60
    for r in needed:
        pkg = canonicalize_name(r.name)
        assert pkg in cuda, f"SGLang needs {r}; cuda.lock lacks it"
        assert r.specifier.contains(cuda[pkg], prereleases=True), f"SGLang needs {r}; cuda.lock pins {cuda[pkg]}"


def test_the_two_environments_agree_on_every_shared_package_but_the_explained_ones():
    cpu, cuda = pins("cpu.lock"), pins("cuda.lock")
    differ = {p for p in cpu.keys() & cuda.keys() if cpu[p] != cuda[p]}
    assert differ == CUDA_ONLY_VERSIONS, f"pins that differ: {sorted(differ)}"
    for pkg in ("sglang", "torch", "torchvision", "transformers", "tokenizers", "xgrammar", "smg"):
        assert cpu[pkg] == cuda[pkg]
    # one Mooncake release, two builds (both install the `mooncake` module)
    assert cpu["mooncake-transfer-engine-non-cuda"] == cuda["mooncake-transfer-engine-cuda13"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_setup_installs_the_shared_locks_around_the_devices_lock(device):
    done = setup_locks(device)
    assert done.returncode == 0, done.stderr
    locks = done.stdout.split()
    assert locks == ["requirements/build.lock", f"requirements/{device}.lock", "requirements/nixl.lock"]
    assert all((ROOT / p).is_file() for p in locks)


def test_setup_defaults_to_cuda_only_where_nvidia_smi_lists_a_gpu():
    smi = shutil.which("nvidia-smi")
    listed = smi and subprocess.run([smi, "-L"], capture_output=True, text=True).stdout
    gpu = bool(listed) and any(l.startswith("GPU ") for l in listed.splitlines())
    done = setup_locks(None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[1] == f"requirements/{'cuda' if gpu else 'cpu'}.lock"


def test_setup_refuses_an_unknown_device():
    done = setup_locks("rocm")
    assert done.returncode != 0 and not done.stdout
    assert "DEVICE=rocm: expected cpu or cuda" in done.stderr


@pytest.mark.parametrize("had, device", [("cpu", "cuda"), ("cuda", "cpu")])
def test_setup_refuses_to_switch_a_venv_to_the_other_device(tmp_path, had, device):
    """Checked before step 1, so this runs nothing but the check (a copy of the tree)."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copytree(REQ, tmp_path / "requirements")
    venv = tmp_path / ".venv"
    venv.mkdir()
    (venv / ".deps-stamp").write_text("0123456789abcdef\n")
    if had != "cpu":  # a CPU venv has no .device file (as made before CUDA existed)
        (venv / ".device").write_text(f"{had}\n")
    env = {**os.environ, "DEVICE": device}
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"holds the {had} environment, not {device}" in done.stderr
    assert "installing" not in done.stdout and sorted(p.name for p in venv.iterdir()) == sorted(
        [".deps-stamp"] + ([".device"] if had != "cpu" else []))
