"""A pure-numpy Llama forward pass in float64: the third opinion of the parity suite.

It reads the HF-named weights of ``twinseq.common.models.init`` and a ``Batch`` and follows the
transformers ``LlamaForCausalLM`` maths without sharing a line with either backend. Running
in float64 makes it the ground truth for float32 runs: each backend's error against it is
its own float32 rounding, so a bug shows up as an error far above that floor.

Attention is computed one document at a time (a dense causal softmax per document), a
different route from the backends' masked [T, T] softmax; padding positions get no output
(NaN-free zeros are irrelevant here, they are never compared).
"""

from __future__ import annotations

import numpy as np

from twinseq.common.data.batching import Batch
from twinseq.common.config import ModelConfig


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x_NTD: np.ndarray, positions_T: np.ndarray, theta: float) -> np.ndarray:
    """Rotate pairs (i, i + D/2) by angle pos * theta**(-2i/D) (HF's half-split layout)."""
    d = x_NTD.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angle_TF = positions_T[:, None].astype(np.float64) * inv_freq[None, :]
    cos, sin = np.cos(angle_TF), np.sin(angle_TF)
    x1, x2 = x_NTD[..., : d // 2], x_NTD[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _document_attention(q_TX, k_TX, v_TX, positions_T, cfg: ModelConfig) -> np.ndarray:
    n, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t = q_TX.shape[0]
    q = _rope(q_TX.reshape(t, n, d).transpose(1, 0, 2), positions_T, cfg.rope_theta)
    k = _rope(k_TX.reshape(t, kv, d).transpose(1, 0, 2), positions_T, cfg.rope_theta)
    v = v_TX.reshape(t, kv, d).transpose(1, 0, 2)
    group = n // kv
    k, v = k[np.arange(n) // group], v[np.arange(n) // group]  # query head h reads kv head h // group
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)
    allowed = positions_T[None, :] <= positions_T[:, None]
    scores = np.where(allowed[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return (probs @ v).transpose(1, 0, 2).reshape(t, n * d)


def _layer(x_TH, w, layer: int, positions_T, cfg: ModelConfig) -> np.ndarray:
    p = f"model.layers.{layer}."
    h = _rms_norm(x_TH, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
    attn = _document_attention(h @ w[p + "self_attn.q_proj.weight"].T, h @ w[p + "self_attn.k_proj.weight"].T,
                               h @ w[p + "self_attn.v_proj.weight"].T, positions_T, cfg)
    x_TH = x_TH + attn @ w[p + "self_attn.o_proj.weight"].T
    h = _rms_norm(x_TH, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    return x_TH + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T


def document_logits(cfg: ModelConfig, weights: dict[str, np.ndarray], input_ids_T: np.ndarray,
                    positions_T: np.ndarray) -> np.ndarray:
    """float64 [T, V] logits of one document (every token attends causally to the others)."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    x_TH = w["model.embed_tokens.weight"][np.asarray(input_ids_T)]
    for layer in range(cfg.num_hidden_layers):
        x_TH = _layer(x_TH, w, layer, np.asarray(positions_T), cfg)
    x_TH = _rms_norm(x_TH, w["model.norm.weight"], cfg.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return x_TH @ head.T


def logits(cfg: ModelConfig, weights: dict[str, np.ndarray], batch: Batch) -> np.ndarray:
    """float64 [B, T, V]: each (row, segment) document run alone; padding positions are 0."""
    b, t = batch.input_ids.shape
    out = np.zeros((b, t, cfg.vocab_size), np.float64)
    for r in range(b):
        seg = batch.segment_ids[r]
        for s in np.unique(seg[seg != 0]):
            idx = np.nonzero(seg == s)[0]
            out[r, idx] = document_logits(cfg, weights, batch.input_ids[r, idx], batch.position_ids[r, idx])
    return out
