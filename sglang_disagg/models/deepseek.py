"""DeepSeek-shaped models: Multi-head Latent Attention, MoE with grouped top-k routing, NEXTN.

``tiny-deepseek-v3`` (specs.py) and the checkpoints the tests write for other DeepSeek
config shapes (a DeepSeek-V2 without q LoRA, a V3 without NEXTN) come from here: weights
named exactly as SGLang's DeepSeek loader reads a Hugging Face checkpoint
(``models/deepseek_v2.py``, ``deepseek_common/deepseek_weight_loader.py``,
``deepseek_nextn.py``), a ``config.json`` with the fields transformers' DeepSeek configs
lack (``topk_method``, ``scoring_func``, ``moe_layer_freq``) and a YaRN ``rope_scaling`` of
factor 1 (plain rotary embedding: SGLang's CPU rotary embedding accepts DeepSeek's YaRN
only).

Per layer (``model.layers.{i}.``): ``self_attn.q_a_proj``, ``q_a_layernorm``, ``q_b_proj``
(or ``q_proj`` without q LoRA), ``kv_a_proj_with_mqa`` (the latent and the rope part, one
head), ``kv_a_layernorm``, ``kv_b_proj`` (per head: nope part of K, then V), ``o_proj``;
layers below ``first_k_dense_replace`` a dense ``mlp.{gate,up,down}_proj``, the others
``mlp.gate`` (+ ``e_score_correction_bias`` for V3's noaux_tc routing),
``mlp.experts.{e}.*`` and ``mlp.shared_experts.*``. The NEXTN (MTP) layer is
``model.layers.{num_layers}``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and
an MoE decoder layer; its embedding and head are the target's (SGLang shares them).

``forward`` is a float64 pure-torch reference of the same model (interleaved rotary, as
SGLang and transformers read ``rope_interleave``), used to train the NEXTN layer and, by
the tests, to check SGLang's tokens against an independent implementation.

The NEXTN layer predicts the target's token after next from the next token's embedding and
the target's last hidden state: ``eh_proj([enorm(embed(t[i+1])); hnorm(h[i])])``, one MoE
decoder layer, ``shared_head.norm``, the target's ``lm_head``. A random one accepts almost
nothing and would hide a corrupted draft state (``models.eagle`` says the same of EAGLE
heads). Here it is the target's last layer with every weight scaled by (1 + 0.05 N(0, 1))
(its KV differs from the target's) and ``eh_proj`` passing the token's embedding: at draft
position i it computes the target's last layer over tokens t[1..i+1], where the target's
saw t[0..i+1] plus what the layers below added. For that to be followed, a model with a
NEXTN layer has those layers write to the residual stream at gain ``_EARLY`` = 0.1 (their
``o_proj`` and ``down_proj``), and every model here has unit-RMS embeddings (so
``enorm(embed) == embed``). Its agreement (``agreement``: the NEXTN layer's greedy token
against the target's next one, every position of greedy continuations of unseen random
prompts) is about 0.48 (the unit test holds it above 0.4); with the hidden state withheld
it is the same: the hidden-state half of ``eh_proj`` is zero. Measured trade-off (seed 99,
1504 positions): gain 0.3 -> 0.18, 0.1 -> 0.48, 0.05 -> 0.61; without the layers below
and the perturbation 0.81 (the draft's context lacks the first token).
Training as ``models.eagle`` does was tried and is not used: Adam on the target's greedy
continuations (the whole layer, its ``eh_proj`` or the hidden-state half alone, regressing
the next hidden state, with or without cross-entropy) or a ridge fit of ``eh_proj`` to the
last layer's input reached 0.52-0.75 on its training prompts and never more than the
untrained layer (+0.01 at best) on unseen ones (one layer cannot learn a three-layer random target from
the data a generator affords in seconds). So the weights are seeded draws like every other
built-in: byte-identical on every node, generated in about a second.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from sglang_disagg.models.specs import Architecture, ModelSpec, checkpoint_tail

_LOGIT_SCALE = 4.0  # as models.generate: std of the lm_head output for unit-RMS hidden states
_EPS = 1e-6
_PROMPT_LEN, _NEW = 8, 40  # agreement data: greedy continuations of random prompts
_EARLY = 0.1  # with a NEXTN layer: the gain of the layers below the last (module doc)
_PERTURB = 0.05  # the NEXTN layer: the target's last layer, each weight scaled by 1 + this N(0, 1)

Tensor = Callable[[str, tuple, float], np.ndarray]  # generate._tensor bound to the spec


def is_deepseek(spec: ModelSpec) -> bool:
    return spec.mla is not None


def _moe_layer(spec: ModelSpec, i: int) -> bool:
    return i >= spec.mla.first_k_dense_replace or i == spec.num_layers  # the NEXTN layer is MoE


def _layer_weights(spec: ModelSpec, i: int, tensor: Tensor) -> dict[str, np.ndarray]:
    m, h, H = spec.mla, spec.hidden_size, spec.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    ones = lambda n: np.ones((n,), dtype=np.float32)  # noqa: E731
    shapes = {"self_attn.kv_a_proj_with_mqa": (m.kv_lora_rank + m.qk_rope_head_dim, h),
              "self_attn.kv_b_proj": (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
              "self_attn.o_proj": (h, H * m.v_head_dim)}
    if m.q_lora_rank is None:
        shapes["self_attn.q_proj"] = (H * qk, h)
    else:
        shapes["self_attn.q_a_proj"] = (m.q_lora_rank, h)
        shapes["self_attn.q_b_proj"] = (H * qk, m.q_lora_rank)
    norms = {"input_layernorm": h, "post_attention_layernorm": h, "self_attn.kv_a_layernorm": m.kv_lora_rank}
    if m.q_lora_rank is not None:
        norms["self_attn.q_a_layernorm"] = m.q_lora_rank
    if _moe_layer(spec, i):
        shapes["mlp.gate"] = (m.n_routed_experts, h)
        mlps = [f"mlp.experts.{e}" for e in range(m.n_routed_experts)]
        inter = {f"mlp.experts.{e}": m.moe_intermediate_size for e in range(m.n_routed_experts)}
        if m.n_shared_experts:
            mlps.append("mlp.shared_experts")
            inter["mlp.shared_experts"] = m.moe_intermediate_size * m.n_shared_experts
    else:
        mlps, inter = ["mlp"], {"mlp": spec.intermediate_size}
    for mlp in mlps:
        n = inter[mlp]
        shapes |= {f"{mlp}.gate_proj": (n, h), f"{mlp}.up_proj": (n, h), f"{mlp}.down_proj": (h, n)}
    p = f"model.layers.{i}."
    # With a NEXTN layer, layers below the last write to the residual stream at _EARLY gain.
    early = spec.mla.nextn and i < spec.num_layers - 1
    gain = lambda sub: _EARLY if early and sub.endswith(("o_proj", "down_proj")) else 1.0  # noqa: E731
    w = {f"{p}{sub}.weight": tensor(f"{p}{sub}", shape, gain(sub) / shape[1] ** 0.5) for sub, shape in shapes.items()}
    w |= {f"{p}{sub}.weight": ones(n) for sub, n in norms.items()}
    if _moe_layer(spec, i) and spec.architecture is Architecture.DEEPSEEK_V3:
        w[f"{p}mlp.gate.e_score_correction_bias"] = tensor(f"{p}mlp.gate.e_score_correction_bias",
                                                           (m.n_routed_experts,), 0.1)
    return w


def target_weights(spec: ModelSpec, tensor: Tensor) -> dict[str, np.ndarray]:
    """The target model's weights (no NEXTN layer), as generate._tensor draws them."""
    h = spec.hidden_size
    embed = tensor("embed", (spec.vocab_size, h), 1.0).astype(np.float64)
    embed = embed / np.sqrt((embed**2).mean(-1, keepdims=True))  # unit RMS: enorm(embed) = embed
    w = {"model.embed_tokens.weight": embed.astype(np.float32),
         "model.norm.weight": np.ones((h,), dtype=np.float32),
         "lm_head.weight": tensor("lm_head", (spec.vocab_size, h), _LOGIT_SCALE / h**0.5)}
    for i in range(spec.num_layers):
        w |= _layer_weights(spec, i, tensor)
    return w


def weights(spec: ModelSpec, tensor: Tensor) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint: the target's, then the NEXTN layer's (trained)."""
    w = target_weights(spec, tensor)
    if spec.mla.nextn:
        w |= nextn_weights(spec, w, tensor)
    return w


def config(spec: ModelSpec) -> dict:
    m, v3 = spec.mla, spec.architecture is Architecture.DEEPSEEK_V3
    cfg = {
        "architectures": [spec.architecture.value],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": m.moe_intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "n_routed_experts": m.n_routed_experts,
        "num_experts_per_tok": m.num_experts_per_tok,
        "n_shared_experts": m.n_shared_experts,
        "n_group": m.n_group,
        "topk_group": m.topk_group,
        "first_k_dense_replace": m.first_k_dense_replace,
        "moe_layer_freq": 1,
        "routed_scaling_factor": m.routed_scaling_factor,
        # V3: sigmoid scores, a group's score the sum of its top two (score + correction
        # bias), renormalized; V2(-Lite): softmax scores, plain top-k, not renormalized.
        "topk_method": "noaux_tc" if v3 else "greedy",
        "scoring_func": "sigmoid" if v3 else "softmax",
        "norm_topk_prob": v3,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": _EPS,
        "rope_theta": 10000.0,
        # Factor 1: the plain rotary embedding, in the form SGLang's CPU rotary accepts.
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 1.0,
                         "original_max_position_embeddings": spec.max_position_embeddings,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        **checkpoint_tail(spec),
    }
    if v3:
        cfg["num_nextn_predict_layers"] = m.nextn
    return cfg


# --- The float64 reference ------------------------------------------------------------


def _rms(x, w):
    return x * (x.pow(2).mean(-1, keepdim=True) + _EPS).rsqrt() * w


def _rope(x, pos, theta=10000.0):
    """Interleaved (GPT-J) rotary embedding over the last dim of x [B, T, ..., d]."""
    import torch

    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    ang = pos.to(x.dtype)[:, None] * inv[None, :]  # [T, d/2]
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (d // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


def _attention(w, p, x, spec, pos):
    import torch

    m, H = spec.mla, spec.num_heads
    B, T, _ = x.shape
    nope, rope = m.qk_nope_head_dim, m.qk_rope_head_dim
    if m.q_lora_rank is None:
        q = x @ w[f"{p}self_attn.q_proj.weight"].T
    else:
        q = _rms(x @ w[f"{p}self_attn.q_a_proj.weight"].T, w[f"{p}self_attn.q_a_layernorm.weight"])
        q = q @ w[f"{p}self_attn.q_b_proj.weight"].T
    q = q.view(B, T, H, nope + rope)
    kv_a = x @ w[f"{p}self_attn.kv_a_proj_with_mqa.weight"].T
    latent = _rms(kv_a[..., :m.kv_lora_rank], w[f"{p}self_attn.kv_a_layernorm.weight"])
    k_pe = _rope(kv_a[..., m.kv_lora_rank:], pos)  # [B, T, rope]: one head
    q_pe = _rope(q[..., nope:], pos)
    kv = (latent @ w[f"{p}self_attn.kv_b_proj.weight"].T).view(B, T, H, nope + m.v_head_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    s = torch.einsum("bthd,bshd->bhts", q[..., :nope], k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    s = (s / math.sqrt(nope + rope)).masked_fill(~mask, float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshd->bthd", s, v).reshape(B, T, H * m.v_head_dim)
    return o @ w[f"{p}self_attn.o_proj.weight"].T


def _mlp(w, p, x):
    import torch

    g = x @ w[f"{p}gate_proj.weight"].T
    return (torch.nn.functional.silu(g) * (x @ w[f"{p}up_proj.weight"].T)) @ w[f"{p}down_proj.weight"].T


def route(w, p, x, spec):
    """(expert ids [.., k], their weights [.., k]) as SGLang routes the tokens x [.., h]."""
    import torch

    m = spec.mla
    logits = x @ w[f"{p}mlp.gate.weight"].T
    if spec.architecture is Architecture.DEEPSEEK_V3:  # noaux_tc: biased_grouped_topk_impl
        scores = logits.sigmoid()
        choice = scores + w[f"{p}mlp.gate.e_score_correction_bias"]
        groups = choice.unflatten(-1, (m.n_group, -1))
        best = groups.topk(2, dim=-1).values.sum(-1).topk(m.topk_group, dim=-1).indices
        keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(-1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(m.n_routed_experts // m.n_group, -1), float("-inf"))
        ids = choice.topk(m.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
    else:  # V2 greedy softmax (n_group 1): grouped_topk_gpu, not renormalized
        scores = logits.softmax(-1)
        weights, ids = scores.topk(m.num_experts_per_tok, dim=-1)
    return ids, weights * m.routed_scaling_factor


def _moe(w, p, x, spec):
    import torch

    m = spec.mla
    ids, weights = route(w, p, x, spec)
    dense = torch.zeros(x.shape[:-1] + (m.n_routed_experts,), dtype=x.dtype).scatter(-1, ids, weights)
    out = sum(dense[..., e:e + 1] * _mlp(w, f"{p}mlp.experts.{e}.", x) for e in range(m.n_routed_experts))
    if m.n_shared_experts:
        out = out + _mlp(w, f"{p}mlp.shared_experts.", x)
    return out


def _layer(w, p, x, spec, pos, moe):
    x = x + _attention(w, p, _rms(x, w[f"{p}input_layernorm.weight"]), spec, pos)
    m_in = _rms(x, w[f"{p}post_attention_layernorm.weight"])
    return x + (_moe(w, p, m_in, spec) if moe else _mlp(w, f"{p}mlp.", m_in))


def forward(w, spec: ModelSpec, tokens, layers: int | None = None):
    """The target's final (normed) hidden states [B, T, h] over tokens [B, T] (what SGLang
    hands a NEXTN draft); logits are ``hidden @ w["lm_head.weight"].T``. With `layers`:
    the residual stream after that many layers instead."""
    import torch

    x = w["model.embed_tokens.weight"][tokens]
    pos = torch.arange(tokens.shape[1])
    for i in range(spec.num_layers if layers is None else layers):
        x = _layer(w, f"model.layers.{i}.", x, spec, pos, _moe_layer(spec, i))
    return _rms(x, w["model.norm.weight"]) if layers is None else x


def nextn_forward(w, spec: ModelSpec, next_tokens, hidden):
    """The NEXTN layer's normed output [B, T, h] at positions whose next token is
    ``next_tokens`` [B, T] and whose target hidden state is ``hidden`` [B, T, h]."""
    import torch

    p = f"model.layers.{spec.num_layers}."
    e = w["model.embed_tokens.weight"][next_tokens]
    x = torch.cat([_rms(e, w[f"{p}enorm.weight"]), _rms(hidden, w[f"{p}hnorm.weight"])], -1)
    x = x @ w[f"{p}eh_proj.weight"].T
    x = _layer(w, p, x, spec, torch.arange(next_tokens.shape[1]), moe=True)
    return _rms(x, w[f"{p}shared_head.norm.weight"])


def greedy(w, spec: ModelSpec, prompts, new: int):
    """prompts [B, P] continued greedily by `new` tokens with the reference (recomputed)."""
    import torch

    tokens, head = prompts, w["lm_head.weight"]
    for _ in range(new):
        nxt = (forward(w, spec, tokens)[:, -1] @ head.T).argmax(-1)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
    return tokens


def f64(weights: dict[str, np.ndarray]) -> dict:
    import torch

    return {k: torch.from_numpy(v.astype(np.float64)) for k, v in weights.items()}


# --- The NEXTN layer ---------------------------------------------------------------------


def nextn_weights(spec: ModelSpec, target: dict[str, np.ndarray], tensor: Tensor) -> dict[str, np.ndarray]:
    """The NEXTN layer (``model.layers.{num_layers}.*``): the target's last layer with every
    weight scaled by (1 + _PERTURB N(0, 1)) (its correction bias, which routing training
    would not touch, kept), ``eh_proj`` passing the token's embedding, unit norms."""
    h, L = spec.hidden_size, spec.num_layers
    src, dst = f"model.layers.{L - 1}.", f"model.layers.{L}."
    out = {}
    for name, base in target.items():
        if not name.startswith(src):
            continue
        sub = name[len(src):]
        if not sub.endswith("e_score_correction_bias"):
            noise = tensor(f"nextn:{sub}", base.shape, 1.0).astype(np.float64)
            base = (base.astype(np.float64) * (1.0 + _PERTURB * noise)).astype(np.float32)
        out[dst + sub] = base
    out[f"{dst}eh_proj.weight"] = np.concatenate([np.eye(h), np.zeros((h, h))], 1).astype(np.float32)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{dst}{norm}.weight"] = np.ones((h,), dtype=np.float32)
    return out


def _data(w, spec: ModelSpec, seed: int, prompts: int):
    """(next tokens, target hidden, target hidden at the next position) per draft position
    of the target's greedy continuations of random prompts from `seed`."""
    import torch

    rng = np.random.Generator(np.random.PCG64([seed, 0xDEE95EE]))
    tokens = greedy(w, spec, torch.from_numpy(rng.integers(4, spec.vocab_size, (prompts, _PROMPT_LEN))), _NEW)
    hidden = forward(w, spec, tokens)
    # Draft position i sees (token i+1, hidden i) and should give hidden i+1 (whose argmax is token i+2).
    return tokens[:, 1:], hidden[:, :-1], hidden[:, 1:]


def agreement(spec: ModelSpec, weights: dict[str, np.ndarray], seed: int, prompts: int = 16,
              hidden: bool = True) -> float:
    """How often the NEXTN layer's greedy token equals the target's next token, over every
    position of the target's greedy continuations (40 tokens) of `prompts` random 8-token
    prompts from `seed`: the acceptance rate of one draft step with top-k 1. ``hidden=False``:
    with the target's hidden state withheld (zeros)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = f64(weights)
        nxt_tok, h, want = _data(w, spec, seed, prompts)
        head = w["lm_head.weight"]
        got = (nextn_forward(w, spec, nxt_tok, h if hidden else torch.zeros_like(h)) @ head.T).argmax(-1)
        return float((got == (want @ head.T).argmax(-1)).double().mean())
    finally:
        torch.set_num_threads(threads)
