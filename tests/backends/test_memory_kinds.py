"""Memory kinds in the backend contract: what each backend hands its library for host and
CUDA regions, and how each refuses device memory it cannot register.

No GPU here. Where a test checks what we pass to a library for a device region, the one
library call (NIXL's register_memory, Mooncake's register_memory, the shim's
shim_mr_reg) is replaced by an isolated recorder; everything else is real. The refusals
are real: this machine's UCX, Mooncake wheel and libfabric 1.17 have no CUDA, so a CUDA
registration must fail with UnsupportedMemory naming who refused and why, and the backend
must keep working for host memory afterwards.
"""

from __future__ import annotations

import ctypes
import types

import pytest
import torch

from sglang_disagg.ipc import shm
from sglang_disagg.backends import BackendConfig, create_backend
from sglang_disagg.backends import mooncake as mooncake_mod
from sglang_disagg.backends import nixl_memory
from sglang_disagg.backends.errors import BackendUnavailable, DescriptorError, TransferError, UnsupportedMemory
from sglang_disagg.backends.regions import HOST, MemoryRegion, PageWrite, RegionDescriptor, RemoteRegion, cuda


def _buffer(n: int = 1 << 16) -> tuple[ctypes.Array, int]:
    buf = ctypes.create_string_buffer(n)
    return buf, ctypes.addressof(buf)


def _round_trip(rx, tx, size: int = 1 << 16) -> None:
    """tx writes two pages into rx's host region; the bytes land."""
    dst = shm.shared_zeros((size,), torch.uint8)
    src = shm.shared_zeros((size,), torch.uint8)
    src.fill_(9)
    region, desc = rx.register(dst.data_ptr(), size)
    mine, _ = tx.register(src.data_ptr(), size)
    peer = tx.connect(rx.address, 5)
    remote = peer.add_remote_region(desc)
    done = rx.expect(77, 2, 10)
    tx.write_pages(peer, mine, [0, 1], 4096, remote, [3, 5], 4096, 4096, imm=77).wait(10)
    done.wait(10)
    got = dst.numpy()
    assert (got[3 * 4096:4 * 4096] == 9).all() and (got[5 * 4096:6 * 4096] == 9).all()
    assert got[:3 * 4096].sum() == 0
    rx.forget(77)


# ----- NIXL ---------------------------------------------------------------------------------
class _RecordingAgent:
    """Stands in for the NIXL agent's register_memory only; the rest are the calls the
    backend's poller and descriptor code make, answered as an idle agent would."""

    def __init__(self) -> None:
        self.registered: list[tuple[list, str]] = []
        self.deregistered: list[object] = []

    def register_memory(self, descs: list, mem_type: str) -> object:
        self.registered.append((descs, mem_type))
        return ("handle", len(self.registered))

    def deregister_memory(self, handle: object) -> None:
        self.deregistered.append(handle)

    def get_agent_metadata(self) -> bytes:
        return b"metadata"

    def get_new_notifs(self) -> dict:
        return {}


def test_nixl_registers_cuda_memory_as_vram_with_its_device() -> None:
    be = create_backend("nixl")
    real, fake = be._agent, _RecordingAgent()
    be._agent = fake
    try:
        addr = 0x7F0000001000  # never touched: the recorder stands in for the registration
        dev_region, dev_desc = be.register(addr, 1 << 20, cuda(1))
        host_region, host_desc = be.register(addr + (1 << 20), 4096, HOST)
        assert fake.registered == [([(addr, 1 << 20, 1, "")], "VRAM"), ([(addr + (1 << 20), 4096, 0, "")], "DRAM")]
        assert dev_region.memory == cuda(1) and host_region.memory == HOST
        dev_extra = RegionDescriptor.from_bytes(dev_desc).extra
        assert (dev_extra["mem"], dev_extra["dev"]) == ("VRAM", 1)
        host_extra = RegionDescriptor.from_bytes(host_desc).extra
        assert (host_extra["mem"], host_extra["dev"]) == ("DRAM", 0)
        be.deregister(dev_region)
        be.deregister(host_region)
        assert len(fake.deregistered) == 2
    finally:
        be._agent = real
        be.close()


def _remote(mem: str, dev: int, base: int = 0x10000) -> RemoteRegion:
    extra = {"agent": "a", "md": "", "mem": mem, "dev": dev}
    d = RegionDescriptor(1, "nixl", "ucx", "peer", 1, 1 << 20, base, 0, extra)
    return RemoteRegion("peer", d)


def test_nixl_transfer_lists_carry_each_sides_memory_type_and_device() -> None:
    src = MemoryRegion(4, 0x5000, 1 << 20, "me", cuda(1))
    writes = [PageWrite(src, 0, _remote("VRAM", 3), 4096, 512), PageWrite(src, 8192, _remote("VRAM", 3), 0, 512)]
    local, local_mem, remote, remote_mem = nixl_memory.transfer_lists(writes, {4: 0x5000})
    assert (local_mem, remote_mem) == ("VRAM", "VRAM")
    assert local == [(0x5000, 512, 1), (0x5000 + 8192, 512, 1)]
    assert remote == [(0x10000 + 4096, 512, 3), (0x10000, 512, 3)]
    host = MemoryRegion(5, 0x9000, 4096, "me", HOST)
    local, local_mem, remote, remote_mem = nixl_memory.transfer_lists(
        [PageWrite(host, 0, _remote("VRAM", 0), 0, 64)], {5: 0x9000})
    assert (local_mem, local[0][2], remote_mem, remote[0][2]) == ("DRAM", 0, "VRAM", 0)


def test_nixl_refuses_a_batch_mixing_memory_types_and_malformed_memory_fields() -> None:
    dev, host = MemoryRegion(4, 0x5000, 4096, "me", cuda(0)), MemoryRegion(5, 0x9000, 4096, "me", HOST)
    with pytest.raises(DescriptorError, match="mixes DRAM and VRAM source"):
        nixl_memory.transfer_lists([PageWrite(dev, 0, _remote("DRAM", 0), 0, 8),
                                    PageWrite(host, 0, _remote("DRAM", 0), 8, 8)], {4: 0x5000, 5: 0x9000})
    with pytest.raises(DescriptorError, match="mixes DRAM and VRAM destination"):
        nixl_memory.transfer_lists([PageWrite(host, 0, _remote("DRAM", 0), 0, 8),
                                    PageWrite(host, 8, _remote("VRAM", 2), 0, 8)], {5: 0x9000})
    for mem, d in (("HBM", 0), ("VRAM", -1), ("DRAM", 2), ("VRAM", True), (None, 0)):
        with pytest.raises(DescriptorError, match="NIXL descriptor names memory"):
            nixl_memory.remote_segment({"mem": mem, "dev": d})


def test_nixl_here_refuses_vram_for_memory_ucx_sees_as_host() -> None:
    """Real NIXL/UCX: a host address registered as CUDA memory is refused (this UCX sees it as
    host memory) as UnsupportedMemory naming VRAM. NIXL 1.5.1 then keeps an empty VRAM section
    in the agent's metadata that peers cannot load, so the backend says so from then on
    instead of failing on the peer's side with NIXL_ERR_NOT_FOUND."""
    be = create_backend("nixl")
    buf, addr = _buffer()
    try:
        with pytest.raises(UnsupportedMemory, match=r"VRAM, device 0\) for cuda:0 memory: NIXL_ERR_BACKEND"):
            be.register(addr, len(buf), cuda(0))
        with pytest.raises(TransferError, match="unusable after a refused VRAM registration"):
            be.register(addr, len(buf))
        with create_backend("nixl") as tx:
            with pytest.raises(TransferError, match="refused the connection: NIXL backend unusable"):
                tx.connect(be.address, 5)
    finally:
        be.close()


def test_nixl_host_regions_say_dram_and_move() -> None:
    with create_backend("nixl") as rx, create_backend("nixl") as tx:
        buf, addr = _buffer()
        _, desc = rx.register(addr, len(buf))
        extra = RegionDescriptor.from_bytes(desc).extra
        assert (extra["mem"], extra["dev"]) == ("DRAM", 0)
        _round_trip(rx, tx)


# ----- Mooncake -----------------------------------------------------------------------------
def test_mooncake_installed_non_cuda_wheel_refuses_cuda_memory() -> None:
    be = create_backend("mooncake")
    buf, addr = _buffer()
    try:
        with pytest.raises(UnsupportedMemory) as e:
            be.register(addr, len(buf), cuda(0))
        msg = str(e.value)
        assert "mooncake-transfer-engine-non-cuda" in msg and "has no CUDA support" in msg
        assert "mooncake-transfer-engine-cuda13" in msg
        region, _ = be.register(addr, len(buf))  # the real engine, host memory
        be.deregister(region)
    finally:
        be.close()


class _RecordingEngine:
    def __init__(self) -> None:
        self.registered: list[tuple] = []

    def register_memory(self, *args: object) -> int:
        self.registered.append(args)
        return 0

    def unregister_memory(self, addr: int) -> int:
        return 0

    def get_notifies(self) -> list:
        return []


def test_mooncake_with_a_cuda_wheel_passes_location_cuda_n(monkeypatch) -> None:
    monkeypatch.setattr(mooncake_mod, "installed_wheels", lambda: (("mooncake-transfer-engine-cuda13",), ()))
    be = create_backend("mooncake")
    real, fake = be._te, _RecordingEngine()
    be._te = fake
    try:
        dev, _ = be.register(0x7F0000001000, 1 << 20, cuda(1))
        host, _ = be.register(0x7F0000200000, 4096)
        assert fake.registered == [(0x7F0000001000, 1 << 20, "cuda:1"), (0x7F0000200000, 4096)]
        be.deregister(dev)
        be.deregister(host)
    finally:
        be._te = real
        be.close()


def test_mooncake_refuses_cuda_when_cuda_and_non_cuda_wheels_are_both_installed(monkeypatch) -> None:
    monkeypatch.setattr(mooncake_mod, "installed_wheels",
                        lambda: (("mooncake-transfer-engine",), ("mooncake-transfer-engine-non-cuda",)))
    with pytest.raises(UnsupportedMemory, match="mixes CUDA and non-CUDA wheels"):
        mooncake_mod.cuda_location(cuda(0))


# ----- shmem --------------------------------------------------------------------------------
def test_shmem_refuses_cuda_memory_and_says_what_to_use() -> None:
    with create_backend("shmem") as be:
        buf = shm.shared_zeros((4096,), torch.uint8)
        with pytest.raises(UnsupportedMemory, match="cudaipc.*nixl"):
            be.register(buf.data_ptr(), 4096, cuda(0))
        region, _ = be.register(buf.data_ptr(), 4096)
        assert region.memory == HOST


# ----- libfabric ----------------------------------------------------------------------------
@pytest.mark.parametrize("provider,name,why", [("tcp", "tcp;ofi_rxm", r"fi_getinfo\(FI_HMEM\)")])
def test_libfabric_refuses_cuda_when_the_registration_fails_and_keeps_serving_host(provider, name, why) -> None:
    """Real libfabric 1.17 without CUDA: tcp;ofi_rxm does not offer FI_HMEM. UnsupportedMemory
    naming the provider and libfabric's error, and the host-only endpoint serves on unchanged."""
    cfg = BackendConfig(provider=provider)
    be = create_backend("libfabric", cfg)
    buf, addr = _buffer()
    try:
        before = be.address, be._ep
        with pytest.raises(UnsupportedMemory, match=f"provider {name} cannot register cuda:0 memory: .*{why}"):
            be.register(addr, len(buf), cuda(0))
        assert (be.address, be._ep) == before and be.fi_info["hmem"] == 0
        assert be.stats()["regions"] == 0
        with create_backend("libfabric", cfg) as tx:
            _round_trip(be, tx)
    finally:
        be.close()


def test_libfabric_hmem_option_is_checked_and_tcp_refuses_it_at_open() -> None:
    with pytest.raises(BackendUnavailable, match=r"tcp;ofi_rxm unusable with FI_HMEM: fi_getinfo\(FI_HMEM\)"):
        create_backend("libfabric", BackendConfig(provider="tcp", options={"hmem": True}))
    with pytest.raises(TransferError, match="hmem must be a bool"):
        create_backend("libfabric", BackendConfig(provider="tcp", options={"hmem": "yes"}))


def test_libfabric_first_device_registration_must_come_before_other_regions() -> None:
    with create_backend("libfabric", BackendConfig(provider="tcp")) as be:
        buf, addr = _buffer()
        be.register(addr, 4096)
        with pytest.raises(UnsupportedMemory, match="before any other region or peer"):
            be.register(addr + 4096, 4096, cuda(0))


def test_libfabric_shim_is_given_fi_hmem_cuda_and_the_device(monkeypatch) -> None:
    """What register() hands shim_mr_reg: iface FI_HMEM_CUDA (1) and the ordinal for CUDA,
    FI_HMEM_SYSTEM (0) for host. The shim call is recorded, not made."""
    from sglang_disagg.backends.libfabric import native

    calls = []

    def shim_mr_reg(ep, buf, length, iface, device, handle, key, base, err, errlen):
        calls.append((int(native.ffi.cast("uintptr_t", buf)), length, iface, device))
        handle[0], key[0], base[0] = 5, 6, 7
        return 0

    monkeypatch.setattr(native, "lib", types.SimpleNamespace(shim_mr_reg=shim_mr_reg))
    assert native.register_on(None, 0x7000, 4096, cuda(3)).key == 6
    native.register_on(None, 0x9000, 64, HOST)
    assert calls == [(0x7000, 4096, native.FI_HMEM_CUDA, 3), (0x9000, 64, native.FI_HMEM_SYSTEM, 0)]
    assert (native.FI_HMEM_SYSTEM, native.FI_HMEM_CUDA) == (0, 1)  # enum fi_hmem_iface


# ----- the messenger's KV pool ---------------------------------------------------------------
class _RecordingBackend:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def register(self, addr: int, length: int, memory=HOST):
        self.calls.append((addr, length, memory))
        return MemoryRegion(len(self.calls), addr, length, "me", memory), b"{}"


def test_kv_pool_registers_with_the_memory_of_its_tensors() -> None:
    from sglang_disagg.messenger.kvpool import KVPoolView, LayoutError, memory_of
    from sglang_disagg.messenger.planner import KVGeometry

    cpu = torch.zeros(4, 16)
    assert memory_of(cpu) == HOST
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 2), get_device=lambda: 2, data_ptr=lambda: 0x7000,
                                   numel=lambda: 64, element_size=lambda: 2)
    assert memory_of(on_gpu) == cuda(2)
    with pytest.raises(LayoutError, match="meta"):
        memory_of(torch.zeros(2, device="meta"))

    geometry = KVGeometry(num_layers=1, kv_heads=1, head_dim=16, v_head_dim=16, page_size=1, dtype_bytes=4)
    be = _RecordingBackend()
    regions, _ = KVPoolView(geometry, (cpu, cpu.clone()), "float32").register(be)
    assert [c[2] for c in be.calls] == [HOST, HOST] and be.calls[0][1] == 4 * 16 * 4
    assert all(r.memory == HOST for r in regions)
    be = _RecordingBackend()
    KVPoolView(geometry, (on_gpu,), "bfloat16").register(be)
    assert be.calls == [(0x7000, 128, cuda(2))]
    # with a real backend too: the view's host tensors register as host memory
    with create_backend("libfabric", BackendConfig(provider="tcp")) as real:
        regions, _ = KVPoolView(geometry, (cpu, cpu.clone()), "float32").register(real)
        assert [r.memory for r in regions] == [HOST, HOST]
