"""RoPE frequencies of every ``rope_type`` twinseq builds, in numpy float32, as transformers computes them.

Both backends rotate with angles ``position_ids * inv_freq`` (so angles restart with each
document) on the half-split layout. What differs between RoPE types is ``inv_freq``:

============  =====================================================================================
rope_type     inverse frequencies (``d = head_dim``, ``base = rope_theta``)
============  =====================================================================================
default       ``1 / base ** (arange(0, d, 2) / d)``
linear        ``default / factor`` (positions effectively divided by ``factor``)
llama3        Llama 3.x: wavelengths longer than ``original_max_position_embeddings / low_freq_factor``
              divided by ``factor``, shorter than ``... / high_freq_factor`` kept, a smooth blend between
dynamic       NTK: ``base`` stretched to ``base * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2))``
              with ``L = max(max(position_ids) + 1, max_position_embeddings)``: it depends on the batch
yarn          YaRN (gpt-oss): frequencies that turn more than ``beta_fast`` times within
              ``original_max_position_embeddings`` kept, fewer than ``beta_slow`` times divided by ``factor``,
              a linear ramp over the dimensions between; cos and sin also scaled by ``rope_attention_factor``
============  =====================================================================================

``dynamic`` is the one type whose frequencies depend on the input: like transformers, twinseq
takes ``L`` from the largest position id in the whole batch, so a long document changes the
frequencies of the short ones next to it. (transformers also keeps the largest ``L`` seen so far
between calls; twinseq recomputes it for every batch, so that a step does not depend on the steps
before it.) The other types are constants of the config.

Every float operation is float32 in the order transformers performs it, so ``inv_freq`` matches
the torch buffer bit for bit (``default``, ``linear``, ``llama3``) or within a few ulps (``dynamic``,
whose stretched base goes through two float32 ``pow`` calls, which libraries round differently);
the tests compare them with transformers' own functions. ``rope_attention_factor`` is the scale
both backends apply to cos and sin (1.0 except for ``yarn``), as transformers' ``attention_scaling``.
"""

from __future__ import annotations

import math

import numpy as np

from twinseq.common.models.configs import ModelConfig


def _pow_f32(base: float, exponent_F: np.ndarray) -> np.ndarray:
    """float32 ``base ** exponent``, the power taken in float64 and rounded once (torch's float32 ``pow``
    is correctly rounded on almost every entry, and so is this)."""
    return np.power(np.float64(base), exponent_F.astype(np.float64)).astype(np.float32)


def default_inv_freq(head_dim: int, rope_theta: float) -> np.ndarray:
    """float32 [head_dim / 2]: ``1 / theta ** (arange(0, d, 2) / d)``, the exponent in float32 as in torch."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / _pow_f32(rope_theta, exponent)).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """float32 [head_dim / 2]: the inverse frequencies of ``cfg`` (for ``dynamic``: those of a batch no longer
    than ``max_position_embeddings``, i.e. the default ones; see ``dynamic_inv_freq``).

    >>> cfg = ModelConfig.preset("tiny-llama3")
    >>> bool((rope_inv_freq(cfg) <= default_inv_freq(cfg.head_dim, cfg.rope_theta)).all())
    True
    """
    assert cfg.head_dim is not None  # ModelConfig.__post_init__ fills head_dim
    inv_freq = default_inv_freq(cfg.head_dim, cfg.rope_theta)
    if cfg.rope_type == "linear":
        return (inv_freq / np.float32(cfg.rope_factor)).astype(np.float32)
    if cfg.rope_type == "llama3":
        return _llama3(inv_freq, cfg)
    if cfg.rope_type == "yarn":
        return _yarn(inv_freq, cfg)
    return inv_freq


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The scale of cos and sin (transformers' ``attention_scaling``): ``rope_attention_factor`` if set, else
    YaRN's ``0.1 * ln(factor) + 1`` (1.0 for ``factor <= 1``); 1.0 for every other ``rope_type``.

    >>> round(rope_attention_factor(ModelConfig.preset("tiny-gpt-oss")), 6), rope_attention_factor(ModelConfig())
    (1.346574, 1.0)
    """
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return float(cfg.rope_attention_factor)
    return 1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_position_embeddings: int) -> float:
    """The dimension whose frequency turns ``num_rotations`` times within ``max_position_embeddings`` (python
    floats, as transformers' ``find_correction_dim``)."""
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """transformers' ``_compute_yarn_parameters`` in float32: ``inv_freq / factor`` blended with ``inv_freq`` by a
    ramp over the dimensions between the ``beta_fast`` and ``beta_slow`` correction dims."""
    dim, base, original = cfg.head_dim, cfg.rope_theta, cfg.rope_original_max_position_embeddings
    assert dim is not None and original is not None  # ModelConfig.__post_init__ fills and requires them
    low = _yarn_correction_dim(cfg.rope_beta_fast, dim, base, original)
    high = _yarn_correction_dim(cfg.rope_beta_slow, dim, base, original)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    extrapolation = (np.float32(1) - np.clip(ramp, 0, 1)).astype(np.float32)
    pos_freqs = _pow_f32(base, np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    interpolation = (np.float32(1.0) / (np.float32(cfg.rope_factor) * pos_freqs)).astype(np.float32)
    return (interpolation * (np.float32(1) - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def sliding_rope_inv_freq(cfg: ModelConfig) -> np.ndarray | None:
    """float32 [head_dim / 2] of the sliding layers when they have their own base (Gemma 3: default RoPE of
    ``rope_local_base_freq``, as transformers' ``Gemma3RotaryEmbedding`` for ``sliding_attention``), else None:
    every layer rotates with ``rope_inv_freq``.

    >>> cfg = ModelConfig.preset("tiny-gemma3")  # a local base of 1e4 turns faster than the global 1e6
    >>> bool(sliding_rope_inv_freq(cfg)[1] > rope_inv_freq(cfg)[1]), sliding_rope_inv_freq(ModelConfig.preset("tiny"))
    (True, None)
    """
    if cfg.rope_local_base_freq is None:
        return None
    assert cfg.head_dim is not None  # ModelConfig.__post_init__ fills head_dim
    return default_inv_freq(cfg.head_dim, cfg.rope_local_base_freq)


def _llama3(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    factor = np.float32(cfg.rope_factor)
    old_context_len = cfg.rope_original_max_position_embeddings
    assert old_context_len is not None  # ModelConfig.__post_init__ requires it for rope_type 'llama3'
    low_freq_wavelen = old_context_len / cfg.rope_low_freq_factor  # python floats, as in transformers
    high_freq_wavelen = old_context_len / cfg.rope_high_freq_factor
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > np.float32(low_freq_wavelen), inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (
        (np.float32(old_context_len) / wavelen - np.float32(cfg.rope_low_freq_factor))
        / np.float32(cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    ).astype(np.float32)
    smoothed = ((np.float32(1) - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    is_medium = ~(wavelen < np.float32(high_freq_wavelen)) & ~(wavelen > np.float32(low_freq_wavelen))
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def dynamic_base(cfg: ModelConfig, seq_len: float) -> float:
    """The stretched NTK base of ``dynamic`` RoPE for a batch whose largest position id is ``seq_len - 1``
    (``seq_len`` is raised to ``max_position_embeddings`` first, so short batches use the plain base)."""
    seq_len = max(float(seq_len), float(cfg.max_position_embeddings))
    dim = cfg.head_dim
    assert dim is not None  # ModelConfig.__post_init__ fills head_dim
    return cfg.rope_theta * ((cfg.rope_factor * seq_len / cfg.max_position_embeddings) - (cfg.rope_factor - 1)) ** (
        dim / (dim - 2)
    )


def dynamic_inv_freq(cfg: ModelConfig, max_position_id: int) -> np.ndarray:
    """float32 [head_dim / 2] of ``dynamic`` RoPE for a batch whose largest position id is ``max_position_id``."""
    assert cfg.head_dim is not None  # ModelConfig.__post_init__ fills head_dim
    seq_len = max(max_position_id + 1, cfg.max_position_embeddings)
    base = np.float32(cfg.rope_theta) * (
        (np.float32(cfg.rope_factor) * np.float32(seq_len) / np.float32(cfg.max_position_embeddings))
        - np.float32(cfg.rope_factor - 1)
    ) ** np.float32(cfg.head_dim / (cfg.head_dim - 2))
    exponent = np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim)
    return (np.float32(1.0) / _pow_f32(float(np.float32(base)), exponent)).astype(np.float32)
