"""The committed parity tolerances, one table per dtype. TOLERANCES.md explains every entry.

A bound is derived from the arithmetic (units in the last place at the magnitude compared,
error propagation through the loss), never from what a run happened to produce. A bound
is never loosened to make a test pass: past it, there is a bug to find.
"""

from __future__ import annotations

import numpy as np

# Unit roundoff: half the spacing of the numbers at 1.0 (float32 24 significand bits, bfloat16 8).
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}

TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {
        # max |a - b| over non-padding logits: torch vs jax, and each vs the float64 numpy reference
        "logits_abs": 1e-5,
        # max |a - b| of the per-token NLL (nats), same pairs; where a and b come from two forwards, after
        # removing the part their logits difference explains (nll_change_from_logits)
        "token_loss_abs": 1e-6,
        # |a - b| / |b| of the scalar loss (mean NLL over the step)
        "loss_rel": 1e-6,
        # per tensor ||a - b|| / ||b|| of every gradient: torch vs jax, any loss type vs nll
        "grad_rel": 1e-5,
        # |<g, d> - finite difference| / |finite difference| against the float64 reference
        "grad_directional_rel": 1e-5,
        # 20 AdamW steps: per step, loss rel and per tensor ||p_a - p_b|| / ||p_b||
        "adamw_rel": 1e-5,
        # `twinseq train` through the CLI, torch vs jax, 50 steps: per step loss rel (issue 4 acceptance)
        "cli_50_steps_loss_rel": 1e-4,
        # entropy metric (mean over valid targets), relative
        "entropy_rel": 1e-5,
    },
    "bfloat16": {
        # in units of bfloat16 ulps at the largest |reference logit| (see logits_abs_bound)
        "logits_ulps": 2.0,
        # |delta nll| <= 2 max |delta logit|: twice the logits bound, in the same ulps
        "token_loss_ulps": 4.0,
        "grad_rel": 10 * UNIT_ROUNDOFF["bfloat16"],
    },
}


def bf16_ulp(magnitude: float) -> float:
    """Spacing of bfloat16 numbers at ``magnitude`` (8 significand bits): 2**(floor(log2 m) - 7)."""
    return float(2.0 ** (np.floor(np.log2(max(abs(magnitude), 2.0 ** -126))) - 7))


def nll_change_from_logits(logits_a: np.ndarray, logits_b: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The per-token NLL difference that the logits difference alone explains, to first order (float64).

    ``NLL = logsumexp(x) - x[target]``, so ``NLL(a) - NLL(b) = Σ_v softmax(b)_v (a - b)_v - (a - b)[target]``
    up to ``O(max |a - b|²)`` (~1e-12 here). ``logits_*``: ``[..., V]``; ``targets``: ``[...]``, negative where
    ignored (0 returned there). Two forwards' NLLs are compared after subtracting this: what is left is each
    loss's own arithmetic, which ``token_loss_abs`` bounds, while the forward itself is held to ``logits_abs``
    (TOLERANCES.md, "per-token NLL of two forwards").
    """
    a, b = np.asarray(logits_a, np.float64), np.asarray(logits_b, np.float64)
    delta = a - b
    p = np.exp(b - b.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    safe = np.where(targets < 0, 0, targets)
    change = (p * delta).sum(-1) - np.take_along_axis(delta, safe[..., None], -1)[..., 0]
    return np.where(targets < 0, 0.0, change)


def tol(dtype: str, name: str) -> float:
    return TOLERANCES[dtype][name]
