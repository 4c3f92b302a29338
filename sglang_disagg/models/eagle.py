"""A built-in EAGLE draft head for a target, trained briefly on its hidden states.

An EAGLE head (SGLang's ``LlamaForCausalLMEagle``) predicts the target's next hidden
state from the current one and the next token's embedding: ``fc([embed(t+1); h_t])``, one
decoder layer without its input norm, no final norm, then the *target's* lm_head (SGLang
hands the draft the target's embedding and head). A random head accepts almost nothing
and would hide a corrupted draft state, and one trained from scratch on the little data a
model generator can afford overfits (measured on tiny-llama: 90% agreement on its training
data, 3% on other prompts). So the head starts from its one-layer target's own layer with
every weight scaled by (1 + perturb N(0, 1)) (its KV differs from the target's) and ``fc``
passing the token's embedding, then takes a few small Adam steps on the target's greedy
continuations of fixed random prompts: EAGLE's loss (regress the next hidden state) plus
cross-entropy on the token after, which gives ``fc`` a (small) weight on the hidden state.

Determinism: data, start and every step are float64 torch on one thread from fixed seeds,
and the result is rounded to 10 mantissa bits, far coarser than the last bits a different
BLAS build could change, so every node builds the same bytes.
"""

from __future__ import annotations

import math

import numpy as np

_PROMPTS, _PROMPT_LEN, _NEW = 24, 8, 56  # training data: 24 greedy continuations of 56 tokens
_STEPS, _LR = 20, 3e-5
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm")


def _rms(x, w, eps=1e-6):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


def _rope(x, pos, theta=10000.0):
    """Neox-style rotary embedding (SGLang's Llama default), x [B, H, T, d]."""
    import torch

    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    ang = pos.to(x.dtype)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def _layer(w, p, x, spec, pos, norm_in=True):
    """One Llama decoder layer over x [B, T, h] (causal, from position pos[0])."""
    import torch

    B, T, _ = x.shape
    d, H, K = spec.resolved_head_dim, spec.num_heads, spec.num_kv_heads
    a_in = _rms(x, w[f"{p}input_layernorm.weight"]) if norm_in else x
    q = (a_in @ w[f"{p}self_attn.q_proj.weight"].T).view(B, T, H, d).transpose(1, 2)
    k = (a_in @ w[f"{p}self_attn.k_proj.weight"].T).view(B, T, K, d).transpose(1, 2)
    v = (a_in @ w[f"{p}self_attn.v_proj.weight"].T).view(B, T, K, d).transpose(1, 2)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    o = (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * d)
    x = x + o @ w[f"{p}self_attn.o_proj.weight"].T
    m_in = _rms(x, w[f"{p}post_attention_layernorm.weight"])
    g = m_in @ w[f"{p}mlp.gate_proj.weight"].T
    u = m_in @ w[f"{p}mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(g) * u) @ w[f"{p}mlp.down_proj.weight"].T


def _target_hidden(w, spec, tokens):
    """The target's final (normed) hidden states over tokens [B, T]: what it hands a draft."""
    import torch

    x = w["model.embed_tokens.weight"][tokens]
    pos = torch.arange(tokens.shape[1])
    for i in range(spec.num_layers):
        x = _layer(w, f"model.layers.{i}.", x, spec, pos)
    return _rms(x, w["model.norm.weight"])


def _greedy_data(w, spec, seed):
    """Fixed random prompts, continued greedily by the target (recomputed: small)."""
    import torch

    rng = np.random.Generator(np.random.PCG64([seed, 0xEA61E]))
    tokens = torch.from_numpy(rng.integers(4, spec.vocab_size, (_PROMPTS, _PROMPT_LEN)))
    head = w["lm_head.weight"]
    for _ in range(_NEW):
        nxt = (_target_hidden(w, spec, tokens)[:, -1] @ head.T).argmax(-1)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
    return tokens, _target_hidden(w, spec, tokens)


def _f64(weights: dict[str, np.ndarray]) -> dict:
    import torch

    return {k: torch.from_numpy(v.astype(np.float64)) for k, v in weights.items()}


def _round(a: np.ndarray) -> np.ndarray:
    """To 10 mantissa bits (round half up on the bit pattern), as float32."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(1 << 12)) & np.uint32(~((1 << 13) - 1) & 0xFFFFFFFF)).view(np.float32)


def train_eagle(spec, target_spec, target_weights: dict[str, np.ndarray], noise) -> dict[str, np.ndarray]:
    """The head's weights, named as an EAGLE checkpoint (no ``model.`` prefix).

    ``noise(name, shape)`` gives the N(0, 1) draws of the perturbation (the generator's
    seeded streams)."""
    import torch

    if target_spec.num_layers != 1:
        raise ValueError(f"{spec.name}: the built-in EAGLE head starts from its target's layer: "
                         f"{target_spec.name} must have one layer, not {target_spec.num_layers}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(spec, target_spec, target_weights, noise)
    finally:
        torch.set_num_threads(threads)


def _data(w, spec, seed):
    """(features, next hidden, token after) per position of the target's greedy data."""
    import torch

    tokens, hidden = _greedy_data(w, spec, seed)
    # Position i sees (token i+1, hidden i) and should give hidden i+1, whose argmax is token i+2.
    feats = torch.cat([w["model.embed_tokens.weight"][tokens[:, 1:]], hidden[:, :-1]], -1)
    return feats, hidden[:, 1:], tokens[:, 2:]


def _train(spec, target_spec, target_weights, noise):
    import torch

    w = _f64(target_weights)
    feats, want, nxt = _data(w, target_spec, spec.seed)
    h, head = spec.hidden_size, w["lm_head.weight"]
    params = {"fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1).double(),
              "fc.bias": torch.zeros(h, dtype=torch.float64)}
    for name in _LAYER:
        base = w[f"model.layers.0.{name}.weight"]
        scale = 1.0 + spec.perturb * torch.from_numpy(noise(f"eagle:{name}", tuple(base.shape))).double()
        params[f"layers.0.{name}.weight"] = base * scale
    for t in params.values():
        t.requires_grad_(True)
    opt = torch.optim.Adam(params.values(), lr=_LR)
    pos = torch.arange(feats.shape[1])
    for _ in range(_STEPS):
        opt.zero_grad()
        out = _head(params, spec, feats, pos)
        loss = (out - want).pow(2).sum(-1).mean() + torch.nn.functional.cross_entropy(
            (out[:, :-1] @ head.T).reshape(-1, head.shape[0]), nxt.reshape(-1))
        loss.backward()
        opt.step()
    out = {k: _round(v.detach().numpy()) for k, v in params.items()}
    out["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"]  # the target's, as SGLang loads it
    return out


def _head(params, spec, feats, pos):
    x = feats @ params["fc.weight"].T + params["fc.bias"]
    return _layer(params, "layers.0.", x, spec, pos, norm_in=False)


def agreement(spec, target_spec, target_weights, head_weights, seed: int, hidden: bool = True) -> float:
    """How often the head's greedy token equals the target's on greedy data from `seed`
    (``hidden=False``: with the hidden state withheld, zeros in its place)."""
    import torch

    w, p = _f64(target_weights), _f64(head_weights)
    feats, _, nxt = _data(w, target_spec, seed)
    if not hidden:
        feats = torch.cat([feats[..., :spec.hidden_size], torch.zeros_like(feats[..., spec.hidden_size:])], -1)
    out = _head(p, spec, feats, torch.arange(feats.shape[1]))
    return float(((out[:, :-1] @ w["lm_head.weight"].T).argmax(-1) == nxt).double().mean())
