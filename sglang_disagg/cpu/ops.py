"""Native torch versions of the sgl_kernel CPU ops SGLang calls on CPU.

The ``sgl_kernel`` wheel on PyPI is a CUDA build: on a CPU-only machine it is
either absent or fails to import without libcuda. SGLang's CPU engine needs two
of its ops on the request path; the patch ``cpu: run without sgl_kernel``
makes SGLang fall back to these when ``sgl_kernel`` cannot provide them.
They are plain index arithmetic: small and obviously correct beats fast here.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req, start:end] = out_cache_loc[consecutive slice], per request."""
    del pool_len  # the CUDA kernel needs the row stride; torch indexing does not
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    cursor = 0
    for req, start, end in zip(req_pool_indices.tolist(), starts, ends):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[cursor : cursor + n].to(req_to_token.dtype)
        cursor += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy rows src_loc -> tgt_loc in every KV buffer, given raw pointers and row strides.

    The buffers are only known by address here (that is the op's contract), so
    rows are moved with ctypes.memmove; the order of (tgt, src) pairs is kept,
    matching the kernel's semantics for overlapping moves.
    """
    import ctypes

    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def __getattr__(name: str):
    """Speculative decoding's index ops come from spec_ops. Any other sgl_kernel CPU
    op is imported at module load but only called when its feature is used: hand
    back a function that fails then, naming what is missing."""
    if not name.endswith("_cpu") or name.startswith("__"):
        raise AttributeError(name)
    from sglang_disagg.cpu.spec_ops import OPS

    if name in OPS:
        return OPS[name]

    def unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available on this CPU-only install; "
            "speculative decoding on CPU needs SGLang's CPU build of sgl_kernel"
        )

    unavailable.__name__ = name
    return unavailable
