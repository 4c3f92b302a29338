"""Speculative decoding on SGLang's torch_native attention backend (the CPU one).

SGLang's EAGLE/STANDALONE workers need a draft-extend attention backend and, from the
target's, a TARGET_VERIFY forward; torch_native had neither. With one draft step and
top-k 1 (``--speculative-num-steps 1 --speculative-eagle-topk 1``, two draft tokens) no
multi-step draft-decode backend is needed (SGLang skips it for one step), the draft
tree is a chain, and so verification is an ordinary causal extend of the draft tokens
after the verified prefix: only its lengths are missing, and they are given here. A
wider tree would need the tree mask torch_native cannot apply: refused at start-up.

Reached through ``hooks`` from two patches (draft_utils: the backend map entry;
torch_native_backend: the verify lengths, also read by ``attention.page_tables``).
The index kernels the workers call are in ``spec_ops``.
"""

from __future__ import annotations

from typing import Any


class _Lengths:
    """A ForwardBatch seen with the extend lengths a chain verify implies."""

    def __init__(self, batch: Any, prefix: Any, extend: Any, total: Any) -> None:
        self._batch = batch
        self.extend_prefix_lens, self.extend_seq_lens, self.seq_lens = prefix, extend, total

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)


def draft_extend_backend(draft_model_runner: Any) -> tuple[str, Any]:
    """The (stamp, backend) DraftBackendFactory expects, for torch_native."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.runtime_context import get_spec

    topk = get_spec().speculative_eagle_topk
    if topk != 1:
        raise ValueError(f"speculative decoding on the torch_native attention backend needs "
                         f"--speculative-eagle-topk 1 (its verify is a causal extend; a tree of "
                         f"top-k {topk} needs a tree mask torch_native does not apply)")
    return "torch_native", TorchNativeAttnBackend(draft_model_runner)


def extend_view(forward_batch: Any) -> Any:
    """The batch torch_native's extend should read: a TARGET_VERIFY forward carries no
    extend lengths (its draft tokens follow seq_lens tokens of verified prefix), so they
    are derived, seq_lens then counting the draft tokens too (their pages are read like
    the prefix's); any other forward is returned as is."""
    if forward_batch.extend_prefix_lens is not None or not forward_batch.forward_mode.is_target_verify():
        return forward_batch
    import torch

    prefix = forward_batch.seq_lens
    per_request = forward_batch.input_ids.shape[0] // prefix.shape[0]
    view = _Lengths(forward_batch, prefix, torch.full_like(prefix, per_request), prefix + per_request)
    view.seq_lens_cpu = None if forward_batch.seq_lens_cpu is None else forward_batch.seq_lens_cpu + per_request
    return view
