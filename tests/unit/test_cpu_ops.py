"""The native torch stand-ins for sgl_kernel's CPU ops, against their definitions."""

from __future__ import annotations

import pytest
import torch

from sglang_disagg.cpu import ops as cpu_ops


def test_assign_req_to_token_pool():
    req_to_token = torch.zeros((4, 16), dtype=torch.int32)
    reqs = torch.tensor([2, 0])
    start, end = torch.tensor([3, 0]), torch.tensor([6, 2])
    locs = torch.tensor([10, 11, 12, 20, 21], dtype=torch.int64)
    cpu_ops.assign_req_to_token_pool_cpu(reqs, req_to_token, start, end, locs, 16)
    assert req_to_token[2, 3:6].tolist() == [10, 11, 12]
    assert req_to_token[0, 0:2].tolist() == [20, 21]
    assert int(req_to_token.sum()) == 10 + 11 + 12 + 20 + 21


def test_copy_all_layer_kv_cache():
    layers = [torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + 100 * i for i in range(3)]
    before = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers])
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers])
    cpu_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([5, 6]), torch.tensor([1, 2]))
    for t, b in zip(layers, before):
        assert torch.equal(t[5], b[1]) and torch.equal(t[6], b[2]) and torch.equal(t[:5], b[:5])


def test_unavailable_op_fails_when_called_not_when_imported():
    from sglang_disagg.cpu.ops import rotate_input_ids_cpu  # import must work (SGLang imports it at load)

    with pytest.raises(NotImplementedError, match="rotate_input_ids_cpu"):
        rotate_input_ids_cpu()
    with pytest.raises(AttributeError):
        cpu_ops.not_an_op  # noqa: B018
