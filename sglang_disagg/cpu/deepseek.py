"""DeepSeek-shaped models (MLA, grouped top-k MoE routing) on CPU.

Attention. SGLang picks, per forward, how a DeepSeek attention layer computes
(``AttnForwardMethod``) through a handler registered per attention backend
(``models/deepseek_common/attention_backend_handler.py``). torch_native has none and falls
back to the Triton handler, which sends an extend without a cached prefix (every first
prefill) down the MHA path: K and V are expanded per head from the latent and handed to
``attn_mha`` with ``save_kv_cache=False``. torch_native's extend ignores the K and V it is
given and reads the pool, whose MLA buffers hold one latent head of ``kv_lora_rank +
qk_rope_head_dim`` per token: the first ``/generate`` kills the scheduler ("Expected size for
first two dimensions of batch2 tensor to be: [H, qk_head_dim] but got: [H, kv_lora_rank +
qk_rope_head_dim]").

The absorbed path (MLA: ``w_kc`` folded into the query, attention over the latent as one
KV head, ``w_vc`` applied after) is what torch_native already serves for decode, prefix
extends, draft extends and verify: ``attn_mqa`` stores the latent and reads it back as
K (latent + rope) and V (the latent's first ``kv_lora_rank`` dims). So torch_native takes
it for every forward, prefill included. It costs more per prefill token than MHA (attention
over ``kv_lora_rank + qk_rope_head_dim`` per head instead of ``qk_head_dim``; nothing at
this project's sizes) and gives one code path for every forward mode. Upstream has no MLA
on torch_native (open request sgl-project/sglang#15711).

Routing. SGLang's grouped top-k routing functions (``layers/moe/topk.py``:
``biased_grouped_topk_impl`` for V3's noaux_tc, ``grouped_topk_gpu`` for V2's softmax,
``_biased_grouped_topk_postprocess``) are ``torch.compile``d, and run compiled on a CPU
without an AMX build of sgl_kernel. Inductor's first compile made the first request of a
fresh machine take 24 s instead of 2.4 s (tiny-deepseek-v3, 2 cores; 2.3 s once its cache
under /tmp holds the kernels); on CPU they run eagerly instead: a handful of small ops
per MoE layer, no measurable cost per request at this project's sizes, and no compiler on
the serving path.
"""

from __future__ import annotations

from typing import Any


def forward_method(attn: Any, forward_batch: Any) -> Any:
    """The absorbed MLA method for every forward (SGLang's own choice between its variants:
    MLA, or the fused-rope CPU kernel where an AMX build of sgl_kernel is present)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import _dispatch_mla_subtype

    return _dispatch_mla_subtype(attn, forward_batch)


def eager_on_cpu(fn: Any, is_cpu: bool) -> Any:
    """`fn` itself (as written, without its torch.compile wrapper) on CPU; `fn` elsewhere."""
    return getattr(fn, "_torchdynamo_orig_callable", fn) if is_cpu else fn
