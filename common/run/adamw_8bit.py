"""8-bit AdamW, blockwise (``optimizer='adamw_bnb_8bit'``): the rule, written once in numpy.

The torch backend runs bitsandbytes' ``AdamW8bit``; the jax backend runs ``jax_backend.adamw_8bit``, an optax
transformation of this rule. The tests hold this reference against bitsandbytes, step by step, and the jax
transformation against this reference, so the two backends store and update the same 8-bit moments.

The scheme:

- A tensor of at least ``MIN_8BIT_SIZE`` numbers keeps each AdamW moment as one ``uint8`` code per number plus one
  float32 ``absmax`` per block of ``BLOCK`` numbers (the tensor flattened row-major; the last block may be short).
  A number's value is ``code_map[code] * absmax`` of its block: 2 bytes of optimizer state per parameter, plus
  8 bytes per block, instead of 8.
- The first moment uses the signed dynamic map, the second (never negative) the unsigned one (``dynamic_map``):
  256 values in [-1, 1] or [0, 1], spread over ``DECADES`` decades on a log scale and linearly within each decade,
  so a moment far below its block's largest keeps its relative precision.
- A step dequantises both moments, updates them in float32 as AdamW does, moves the weight with those float32
  values (decoupled weight decay, bias correction), then re-quantises them to the nearest code under the block's new
  absmax.
- A smaller tensor (norms, biases) keeps float32 moments, as bitsandbytes' ``min_8bit_size`` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK = 256
"""Numbers per absmax block."""
MIN_8BIT_SIZE = 4096
"""Tensors with fewer numbers keep float32 moments."""
DECADES = 7
"""The dynamic maps span 1e-7 .. 1 of the block's absmax."""


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted code values: 0, 1 and, for each decade ``10**(i - DECADES + 1)`` (i = 0 .. DECADES-1), the
    midpoints of an even split of [0.1, 1] into ``2**i`` (signed, each with its negative) or ``2**(i + 1)``
    (unsigned) parts, times the decade.

    >>> [len(dynamic_map(s)) for s in (True, False)], float(dynamic_map(False)[1])
    ([256, 256], 3.25e-07)
    """
    values = [0.0, 1.0]
    for i in range(DECADES):
        parts = 2**i if signed else 2 ** (i + 1)
        edges = np.linspace(0.1, 1.0, parts + 1)
        mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - DECADES + 1)
        values += list(mids) + ([-m for m in mids] if signed else [])
    return np.sort(np.asarray(values, dtype=np.float32))


def midpoints(code_map: np.ndarray) -> np.ndarray:
    """The 255 boundaries between neighbouring codes: a value goes to the code whose interval holds it (a value on a
    boundary goes to the lower code)."""
    return ((code_map[1:] + code_map[:-1]) / 2).astype(np.float32)


def n_blocks(size: int) -> int:
    return -(-size // BLOCK)


def is_quantized(size: int) -> bool:
    """Whether a tensor of ``size`` numbers keeps 8-bit moments."""
    return size >= MIN_8BIT_SIZE


def quantize(x: np.ndarray, code_map: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes shaped like ``x``, float32 absmax per block)."""
    flat = np.asarray(x, np.float32).reshape(-1)
    padded = np.zeros(n_blocks(flat.size) * BLOCK, np.float32)
    padded[: flat.size] = flat
    blocks = padded.reshape(-1, BLOCK)
    absmax = np.abs(blocks).max(axis=1)
    normed = blocks / np.where(absmax > 0, absmax, np.float32(1.0))[:, None]
    codes = np.searchsorted(midpoints(code_map), normed, side="left").astype(np.uint8)
    return codes.reshape(-1)[: flat.size].reshape(np.shape(x)), absmax.astype(np.float32)


def dequantize(codes: np.ndarray, absmax: np.ndarray, code_map: np.ndarray) -> np.ndarray:
    scale = np.repeat(absmax, BLOCK)[: codes.size]
    return (code_map[codes.reshape(-1)] * scale).reshape(codes.shape).astype(np.float32)


def init_state(param: np.ndarray) -> dict[str, Any]:
    """Zero moments: codes of 0 under an absmax of 0, or float32 zeros for a small tensor."""
    if not is_quantized(param.size):
        return {"m": np.zeros(param.shape, np.float32), "v": np.zeros(param.shape, np.float32)}
    zeros = np.zeros(n_blocks(param.size), np.float32)
    return {
        "m_codes": np.zeros(param.shape, np.uint8),
        "m_absmax": zeros.copy(),
        "v_codes": np.zeros(param.shape, np.uint8),
        "v_absmax": zeros.copy(),
    }


def step(
    param: np.ndarray,
    grad: np.ndarray,
    state: dict[str, Any],
    *,
    step_number: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> tuple[np.ndarray, dict[str, Any]]:
    """One AdamW step of one tensor (``step_number`` counts from 1): the new float32 weight and the new state."""
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    g = np.asarray(grad, np.float32)
    if "m" in state:
        m, v = state["m"], state["v"]
    else:
        m = dequantize(state["m_codes"], state["m_absmax"], signed)
        v = dequantize(state["v_codes"], state["v_absmax"], unsigned)
    m = (beta1 * m + (1 - beta1) * g).astype(np.float32)
    v = (beta2 * v + (1 - beta2) * g * g).astype(np.float32)
    m_hat = m / (1 - beta1**step_number)
    v_hat = v / (1 - beta2**step_number)
    new = np.asarray(param, np.float32) * (1 - lr * weight_decay) - lr * m_hat / (np.sqrt(v_hat) + eps)
    if "m" in state:
        return new.astype(np.float32), {"m": m, "v": v}
    m_codes, m_absmax = quantize(m, signed)
    v_codes, v_absmax = quantize(v, unsigned)
    return new.astype(np.float32), {"m_codes": m_codes, "m_absmax": m_absmax, "v_codes": v_codes, "v_absmax": v_absmax}


def state_bytes(size: int) -> int:
    """Optimizer-state bytes of one tensor: 2 codes + 2 absmax per block, or 2 float32 moments below the size."""
    return 2 * size + 8 * n_blocks(size) if is_quantized(size) else 8 * size
