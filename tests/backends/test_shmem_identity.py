"""Issue 19: a shmem descriptor must name the registered memory and nothing else.

The CI failure ("range 0+2105344 exceeds the peer's memory object", every request of a
shmem stack for minutes) came from naming a memfd by its inode number alone: the
decoder's lookup found SGLang's /dev/shm/sglang_loads_* file, which had the same number on
another tmpfs, and told the prefill server to write there. It was refused only because
that file was smaller than one layer; here the colliding file is large enough, so code
that names memory by inode alone writes the KV into it, silently.
"""

from __future__ import annotations

import ctypes
import os
import random

import pytest
import torch

from inode_collision import memfd_descriptor, memfd_tensor_and_colliding_file
from sglang_disagg.ipc import shm
from sglang_disagg.backends import BackendConfig, create_backend

NBYTES = 1 << 20


@pytest.fixture
def collision():
    kv, fd, path = memfd_tensor_and_colliding_file(NBYTES)
    yield kv, fd, path
    os.close(fd)
    os.unlink(path)


def test_locate_names_the_memfd_not_a_dev_shm_file_with_the_same_inode(collision) -> None:
    kv, fd, path = collision
    assert os.fstat(fd).st_ino == os.fstat(memfd_descriptor(kv)).st_ino  # the collision is real
    b = shm.locate(kv.data_ptr(), NBYTES)
    assert os.readlink(b.path).startswith("/memfd:collision-kv-"), b
    st = os.stat(b.path)
    assert (st.st_dev, st.st_ino) == (b.dev, b.inode)
    assert (st.st_dev, st.st_ino) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino)


def test_a_mapping_refuses_another_object_with_the_same_inode(collision) -> None:
    kv, fd, path = collision
    b = shm.locate(kv.data_ptr(), NBYTES)
    impostor = shm.Backing(f"/proc/{os.getpid()}/fd/{fd}", b.offset, b.inode, b.dev, b.target)
    with pytest.raises(shm.SharedMemoryError, match="not the peer's memory"):
        shm.Mapping(impostor, NBYTES)


def test_kv_written_through_shmem_lands_in_the_registered_memfd(collision) -> None:
    kv, fd, path = collision
    rx = create_backend("shmem", BackendConfig())
    tx = create_backend("shmem", BackendConfig())
    try:
        _, desc = rx.register(kv.data_ptr(), NBYTES)
        src = shm.shared_zeros((NBYTES,), torch.uint8, name="collision-src")
        data = random.Random(19).randbytes(NBYTES)
        ctypes.memmove(src.data_ptr(), data, NBYTES)
        src_region, _ = tx.register(src.data_ptr(), NBYTES)
        peer = tx.connect(rx.address)
        rx.wait_peer(5.0)
        remote = peer.add_remote_region(desc)
        landed = rx.expect(19, 1, 10.0)
        tx.write(peer, [(src_region, 0, remote, 0, NBYTES)], 19).wait(10.0)
        landed.wait(10.0)
        other = os.pread(fd, NBYTES, 0)
        assert other == bytes(NBYTES), f"the KV was written into {path}, a file that merely shares its inode number"
        assert bytes(kv.numpy()) == data
    finally:
        tx.close()
        rx.close()
