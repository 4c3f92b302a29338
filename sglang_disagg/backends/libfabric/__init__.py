"""Our libfabric backend: a C shim (shim.c, built by cffi at install) and its Python side.

Only libfabric's public API is used (rdma/fabric.h and its companions). The providers offered
are tcp (tcp;ofi_rxm), and verbs/efa where that hardware exists; libfabric's shm provider is
not offered (SHM_REFUSED says why).
"""

# Why provider "shm" is refused: by the backend, the launcher (--provider shm) and the listing
# (`python -m sglang_disagg.backends`). Kept here so that none of them imports the native shim.
SHM_WHY = ("a thread spinning in fi_cq_read/fi_writedata on a dead peer's spinlock inside libfabric 1.17's "
           "shm region cannot be bounded from outside using libfabric's public API; use the shmem backend on "
           "one host, libfabric provider tcp across hosts (or verbs/efa where that hardware exists)")
SHM_REFUSED = f"libfabric provider 'shm' is not offered: {SHM_WHY}"
