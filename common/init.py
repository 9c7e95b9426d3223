"""Initial weights, drawn once in numpy so that both backends start from the same model.

The layout is Hugging Face Llama's ``state_dict`` (``model.layers.{i}.self_attn.q_proj.weight``,
shape ``[out_features, in_features]``), so a torch ``LlamaForCausalLM`` loads it directly and
the JAX backend transposes where it needs to.
"""

from __future__ import annotations

import numpy as np

from twinseq.common.config import ModelConfig
from twinseq.common.errors import ConfigError


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Ordered ``{hf_name: shape}`` for every parameter of the model ``cfg`` describes."""
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def init_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Draw float32 weights: N(0, initializer_range) for matrices, ones for RMSNorm scales.

    >>> w = init_weights(ModelConfig.preset("tiny"), seed=0)
    >>> w["model.norm.weight"][:3]
    array([1., 1., 1.], dtype=float32)
    """
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in parameter_shapes(cfg).items():
        if len(shape) == 1:
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            weights[name] = (rng.standard_normal(shape, dtype=np.float32) * cfg.initializer_range).astype(np.float32)
    return weights


def check_weights(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Raise ``ValueError`` naming every missing, unexpected or mis-shaped tensor."""
    expected = parameter_shapes(cfg)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [f"{k}: got {tuple(weights[k].shape)}, expected {expected[k]}"
             for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if wrong:
        problems.append("wrong shape " + "; ".join(wrong[:5]))
    if problems:
        raise ConfigError("weights do not match the ModelConfig: " + " | ".join(problems)
                         + ". Check vocab_size/hidden_size/num_hidden_layers/tie_word_embeddings "
                           "against the checkpoint's config.json.")
