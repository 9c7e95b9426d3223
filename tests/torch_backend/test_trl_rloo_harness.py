"""Sanity checks of ``_trl_rloo`` (TRL 1.16's RLOOTrainer run in-process) against values computed by hand here.

Slow: the first call imports TRL and builds a trainer (about 10 s); the other configurations build in under a second.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")

from tests.torch_backend._trl_rloo import trl_rloo_advantages_and_metrics, trl_rloo_loss_and_grad  # noqa: E402

pytestmark = pytest.mark.slow

TOL = 1e-6


def test_leave_one_out_advantages_and_reward_metrics():
    # groups (1, 0) and (2, 3): A_i = r_i - mean of the sibling = [1, -1, -1, 1]
    adv, metrics = trl_rloo_advantages_and_metrics([1.0, 0.0, 2.0, 3.0], 2, beta=0.0)
    np.testing.assert_allclose(adv, [1.0, -1.0, -1.0, 1.0], atol=TOL)
    assert metrics["reward"] == pytest.approx(1.5)
    assert metrics["reward_std"] == pytest.approx(np.std([1, 0, 2, 3], ddof=1), abs=TOL)
    assert metrics["rewards/reward_0/mean"] == pytest.approx(1.5)
    assert metrics["frac_reward_zero_std"] == 0.0
    assert "kl" not in metrics


def test_kl_sum_enters_the_reward_with_the_completion_mask():
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    old = -np.arange(12.0).reshape(4, 3) / 10
    ref = old - 0.5  # old - ref = 0.5 on every token
    adv, metrics = trl_rloo_advantages_and_metrics(
        [1.0, 0.0, 2.0, 3.0], 2, beta=0.1, old_logps_NC=old, ref_logps_NC=ref, mask_NC=mask
    )
    # sequence KL = 0.5 * length = [1.5, 1.0, 0.5, 1.5]; rewards - 0.1 * KL = [0.85, -0.1, 1.95, 2.85]
    np.testing.assert_allclose(adv, [0.95, -0.95, -0.9, 0.9], atol=TOL)
    assert metrics["kl"] == pytest.approx(0.5, abs=TOL)  # masked token mean of old - ref
    assert metrics["reward"] == pytest.approx(1.5)  # the logged reward is before the KL penalty


def test_unscorable_completion_gets_zero_and_leaves_the_baseline():
    nan = float("nan")
    # group (1, NaN, 3): the NaN row gets 0, the others' baseline is the one scorable sibling
    # group (4, 0, 2): baselines (0 + 2) / 2, (4 + 2) / 2, (4 + 0) / 2
    adv, metrics = trl_rloo_advantages_and_metrics([1.0, nan, 3.0, 4.0, 0.0, 2.0], 3, beta=0.0)
    np.testing.assert_allclose(adv, [-2.0, 0.0, 2.0, 3.0, -3.0, 0.0], atol=TOL)
    assert metrics["reward"] == pytest.approx(2.0)  # nanmean of the scorable rewards

    # normalize_advantages: over the scorable rows, (A - mean) / (std(ddof=1) + 1e-4); the NaN row stays 0
    adv_n, _ = trl_rloo_advantages_and_metrics([1.0, nan, 3.0, 4.0, 0.0, 2.0], 3, beta=0.0, normalize_advantages=True)
    a = np.array([-2.0, 2.0, 3.0, -3.0, 0.0])
    np.testing.assert_allclose(adv_n[[0, 2, 3, 4, 5]], (a - a.mean()) / (a.std(ddof=1) + 1e-4), atol=TOL)
    assert adv_n[1] == 0.0


def test_on_policy_loss_is_minus_mean_advantage():
    rng = np.random.default_rng(0)
    logps = -rng.uniform(0.2, 3.0, (4, 5))
    mask = (np.arange(5)[None, :] < np.array([5, 3, 1, 2])[:, None]).astype(np.float64)
    adv = np.array([1.2, -0.8, 0.5, -0.9])
    loss, grad, metrics = trl_rloo_loss_and_grad(logps, adv, mask)
    assert loss == pytest.approx(-adv.mean(), abs=TOL)
    np.testing.assert_allclose(grad, -adv[:, None] / 4 * mask, atol=TOL)  # ratio 1: -A_i / N on scored tokens
    assert metrics == {
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/low_min": 0.0,
        "clip_ratio/high_mean": 0.0,
        "clip_ratio/high_max": 0.0,
        "clip_ratio/region_mean": 0.0,
    }


def test_sequence_ratio_clipping():
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    logps = -np.ones((3, 3))
    # sequence log-ratios 0.5 (A > 0: above 1 + 0.2), -0.5 (A < 0: below 1 - 0.2), 0.1 (inside): masked sums
    old = logps - np.array([[0.25, 0.25, 9.0], [-0.2, -0.2, -0.1], [0.1, 9.0, 9.0]])
    adv = np.array([1.0, -1.0, 2.0])
    loss, grad, metrics = trl_rloo_loss_and_grad(logps, adv, mask, old_logps_NC=old, epsilon=0.2)
    r3 = np.exp(0.1)
    assert loss == pytest.approx(-(1.2 * 1.0 + 0.8 * -1.0 + r3 * 2.0) / 3, abs=TOL)
    expected = np.zeros((3, 3))
    expected[2, 0] = -r3 * 2.0 / 3  # the clipped rows get no gradient
    np.testing.assert_allclose(grad, expected, atol=TOL)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 3)
