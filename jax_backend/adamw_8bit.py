"""8-bit AdamW on the jax backend (``optimizer='adamw_bnb_8bit'``): ``common.run.adamw_8bit``'s rule as an optax
transformation.

``scale_by_adam_8bit`` replaces ``optax.scale_by_adam``: each moment of a tensor with at least
``MIN_8BIT_SIZE`` numbers is a ``Quantized`` pair (uint8 codes shaped like the tensor, float32 absmax per block of
``BLOCK``); smaller tensors keep float32 moments. The update is the bias-corrected ``m_hat / (sqrt(v_hat) + eps)``
from the float32 moments of this step, before they are re-quantised; ``build_optimizer`` chains it with the decoupled
weight decay and the learning rate, as ``optax.adamw`` does with ``scale_by_adam``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from twinseq.common.run import adamw_8bit as rule


class Quantized(NamedTuple):
    codes: jax.Array
    absmax: jax.Array


class Adam8bitState(NamedTuple):
    steps: jax.Array
    mu: Any
    nu: Any


_SIGNED = rule.dynamic_map(True)
_UNSIGNED = rule.dynamic_map(False)


def _quantize(x: jax.Array, code_map) -> Quantized:
    flat = x.reshape(-1).astype(jnp.float32)
    blocks = jnp.pad(flat, (0, rule.n_blocks(flat.size) * rule.BLOCK - flat.size)).reshape(-1, rule.BLOCK)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    normed = blocks / jnp.where(absmax > 0, absmax, 1.0)[:, None]
    codes = _nearest_codes(normed, jnp.asarray(rule.midpoints(code_map)))
    return Quantized(codes.reshape(-1)[: flat.size].reshape(x.shape), absmax)


def _nearest_codes(normed: jax.Array, bounds: jax.Array) -> jax.Array:
    """``searchsorted(bounds, normed, side="left")`` as uint8, by an 8-step binary search over the count of
    boundaries below each value: elementwise, so XLA fuses it (4 bytes of scratch per number; ``jnp.searchsorted``
    keeps 24, and across a model's tensors that made the 8-bit update's scratch larger than float32 AdamW's state)."""
    count = jnp.zeros(normed.shape, jnp.int32)
    for bit in (128, 64, 32, 16, 8, 4, 2, 1):  # 255 boundaries: the count is at most 255
        more = count + bit
        count = jnp.where(bounds[more - 1] < normed, more, count)
    return count.astype(jnp.uint8)


def _dequantize(q: Quantized, code_map) -> jax.Array:
    scale = jnp.repeat(q.absmax, rule.BLOCK)[: q.codes.size]
    return (jnp.asarray(code_map)[q.codes.reshape(-1).astype(jnp.int32)] * scale).reshape(q.codes.shape)


def _zeros(p: jax.Array):
    """Zero moments; ``zeros_like`` keeps a sharded parameter's sharding on its moments (codes included)."""
    if not rule.is_quantized(p.size):
        return jnp.zeros_like(p, dtype=jnp.float32)
    return Quantized(jnp.zeros_like(p, dtype=jnp.uint8), jnp.zeros((rule.n_blocks(p.size),), jnp.float32))


def scale_by_adam_8bit(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's scaling with 8-bit blockwise moments (``common.run.adamw_8bit``)."""

    def init(params):
        return Adam8bitState(
            steps=jnp.zeros([], jnp.int32), mu=jax.tree.map(_zeros, params), nu=jax.tree.map(_zeros, params)
        )

    def update(updates, state, params=None):
        del params
        count = state.steps + 1
        # 1 - beta**t as -expm1(t * log(beta)), log(beta) taken in float64: float32's 1 - 0.999**t loses 1e-5
        # relative at t = 1 (0.999 is not a float32), where the rule (and torch) compute it in float64
        t = count.astype(jnp.float32)
        c1 = -jnp.expm1(t * math.log(b1)) if b1 > 0 else jnp.float32(1.0)
        c2 = -jnp.expm1(t * math.log(b2)) if b2 > 0 else jnp.float32(1.0)

        def one(g, m_state, v_state):
            g = g.astype(jnp.float32)
            quantized = isinstance(m_state, Quantized)
            m = _dequantize(m_state, _SIGNED) if quantized else m_state
            v = _dequantize(v_state, _UNSIGNED) if quantized else v_state
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            step = (m / c1) / (jnp.sqrt(v / c2) + eps)
            if quantized:
                return step, _quantize(m, _SIGNED), _quantize(v, _UNSIGNED)
            return step, m, v

        treedef = jax.tree.structure(updates)
        # the moments' trees have the updates' tree as a prefix (a Quantized pair where the update has an array)
        flat: list[Any] = []
        for g, m, v in zip(
            treedef.flatten_up_to(updates), treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        ):
            flat.append(one(g, m, v))
        scaled, mu, nu = (treedef.unflatten([r[i] for r in flat]) for i in range(3))
        return scaled, Adam8bitState(steps=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def adamw_8bit(
    learning_rate, b1: float, b2: float, eps: float, weight_decay: float, mask
) -> optax.GradientTransformation:
    """``optax.adamw``'s chain with ``scale_by_adam_8bit``: ``-lr * (adam + wd * p)`` (wd on ``mask``'s leaves)."""
    return optax.chain(
        scale_by_adam_8bit(b1, b2, eps),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
