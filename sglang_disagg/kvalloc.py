"""Where a server's KV pool lives: the allocation policy behind ``hooks.kv_zeros``.

In messenger mode (the launcher put a MessengerConfig in ``SGLANG_DISAGG_MESSENGER``) the
pool must be memory that the server's messenger (TP rank 0) and same-host peers can map:
on CPU zeroed shared memory (a memfd, ``shm.py``; freed with its last mapping, so a killed
server leaves nothing behind), on CUDA cuMem allocations exportable as file descriptors
(``cumem.py``). Anything else - SGLang's own modes, other devices - gets ``torch.zeros``,
exactly what SGLang allocates without the patch.
"""

from __future__ import annotations

import os
from typing import Any


def kv_zeros(shape: Any, dtype: Any, device: Any) -> Any:
    import torch

    from sglang_disagg.messenger.config import ENV

    messenger = bool(os.environ.get(ENV))
    if messenger and str(device) == "cpu":
        from sglang_disagg.ipc.shm import shared_zeros

        return shared_zeros(tuple(shape), dtype)
    if messenger and str(device).startswith("cuda"):
        from sglang_disagg.ipc.cumem import exportable_zeros

        return exportable_zeros(tuple(shape), dtype, device)
    return torch.zeros(shape, dtype=dtype, device=device)
