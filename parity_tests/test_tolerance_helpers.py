"""The helpers of the tolerance table measure what they claim.

``nll_change_from_logits`` is the first-order NLL change a logits difference explains; the family tests
subtract it so that ``token_loss_abs`` bounds each loss's own arithmetic. It must (a) equal the exact
float64 NLL change up to second order, and (b) leave a wrong loss (wrong target, missing ignore mask)
far outside ``token_loss_abs``, so the subtraction cannot hide a loss bug.
"""

from __future__ import annotations

import numpy as np

from parity_tests.tolerances import nll_change_from_logits, tol


def _nll64(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(x - top).sum(-1))
    safe = np.where(targets < 0, 0, targets)
    return np.where(targets < 0, 0.0, lse - np.take_along_axis(x, safe[..., None], -1)[..., 0])


def _case(seed: int = 0, scale: float = 2e-6):
    rng = np.random.default_rng(seed)
    logits_b = rng.normal(0.0, 1.0, (3, 17, 512))
    logits_a = logits_b + rng.normal(0.0, scale, logits_b.shape)
    targets = rng.integers(0, 512, (3, 17))
    targets[1, :5] = -100
    return logits_a, logits_b, targets


def test_it_is_the_exact_change_to_second_order():
    for scale in (2e-6, 1e-4):
        a, b, targets = _case(scale=scale)
        exact = _nll64(a, targets) - _nll64(b, targets)
        residual = np.abs(exact - nll_change_from_logits(a, b, targets)).max()
        # second order: |delta|^2 ~ (4 scale)^2
        assert residual <= 16 * scale ** 2, (scale, residual)
        assert np.abs(exact).max() > 100 * residual
    assert not nll_change_from_logits(a, b, targets)[1, :5].any(), "ignored targets contribute nothing"


def test_a_wrong_loss_stays_outside_the_bound():
    a, b, targets = _case()
    explained = nll_change_from_logits(a, b, targets)
    shifted = np.roll(targets, 1, axis=1)           # targets one position off (a shift bug)
    unmasked = np.where(targets < 0, 7, targets)    # the ignore mask not applied
    for wrong in (shifted, unmasked):
        residual = np.abs(_nll64(a, wrong) - _nll64(b, targets) - explained).max()
        assert residual > 1e3 * tol("float32", "token_loss_abs"), residual
