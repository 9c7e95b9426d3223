"""Initial weights, drawn once in numpy so that both backends start from the same model.

The layout is Hugging Face's ``state_dict`` of the family (``model.layers.{i}.self_attn.q_proj.weight``,
shape ``[out_features, in_features]``; ``common.models.configs.parameter_shapes``), so a torch
``AutoModelForCausalLM`` loads it directly and the JAX backend transposes where it needs to.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from twinseq.common.errors import ConfigError
from twinseq.common.models.configs import ModelConfig, parameter_shapes

__all__ = ["check_weights", "init_weights", "parameter_shapes"]


def init_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Draw float32 weights in ``parameter_shapes`` order, from one ``numpy`` generator.

    - matrices and biases: N(0, initializer_range). Hugging Face starts biases at zero; drawing them
      makes every bias (Qwen2's q/k/v) matter from the first step, so a test that drops one fails;
    - RMSNorm scales: ones, so the norm starts as the identity scale. Gemma's norms compute
      ``x * (1 + w)`` (Gemma 3's q/k norms too), so their ones are stored as zeros.

    >>> w = init_weights(ModelConfig.preset("tiny"), seed=0)
    >>> w["model.norm.weight"][:3]
    array([1., 1., 1.], dtype=float32)
    >>> init_weights(ModelConfig.preset("tiny-gemma2"), seed=0)["model.norm.weight"][:3]
    array([0., 0., 0.], dtype=float32)
    """
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in parameter_shapes(cfg).items():
        if name.endswith("norm.weight"):
            scale = 0.0 if cfg.gemma else 1.0  # Gemma 3's q/k norms are ``1 + w`` too
            weights[name] = np.full(shape, scale, dtype=np.float32)
        else:
            weights[name] = (rng.standard_normal(shape, dtype=np.float32) * cfg.initializer_range).astype(np.float32)
    return weights


def check_weights(cfg: ModelConfig, weights: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` naming every missing, unexpected or mis-shaped tensor (arrays or ``LazyArray``s: anything
    with a ``shape``)."""
    expected = parameter_shapes(cfg)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [
        f"{k}: got {tuple(weights[k].shape)}, expected {expected[k]}"
        for k in expected
        if k in weights and tuple(weights[k].shape) != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if wrong:
        problems.append("wrong shape " + "; ".join(wrong[:5]))
    if problems:
        raise ConfigError(
            f"weights do not match the ModelConfig (model_type {cfg.model_type!r}): "
            + " | ".join(problems)
            + ". Check model_type/vocab_size/hidden_size/num_hidden_layers/"
            "tie_word_embeddings against the checkpoint's config.json."
        )
