"""RLOO's rules and numpy reference (``common.objectives.rloo``), without TRL (the comparison with TRL's code is
``tests/torch_backend/test_rloo_trl_semantics.py``).

Invariants:
- a fully scored group's leave-one-out advantages sum to 0, and equal ``G / (G - 1)`` times the centred rewards;
- an unscored completion (NaN) gets 0 and is out of its siblings' baselines: their advantages are those of the
  group without it; a group's only scored completion gets 0;
- the KL penalty is subtracted after the reward clip; ``normalize_advantages`` gives mean 0, std 1 (the scored);
- on-policy, the loss is ``-mean A`` whatever the masks (an empty one included), and a micro-batch's shares add
  up to the step's loss;
- the config refuses GRPO's loss knobs under ``task=rloo`` and RLOO's knobs under other tasks, naming them.
"""

from __future__ import annotations

import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.rloo import GRPO_ONLY_FIELDS, rloo_advantages, rloo_loss

G = 4


def _rewards(seed: int, n_groups: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=n_groups * G)


@pytest.mark.parametrize("seed", range(3))
def test_a_scored_groups_advantages_sum_to_zero_and_scale_the_centred_rewards(seed):
    r = _rewards(seed)
    adv, std = rloo_advantages(r, G)
    groups = r.reshape(-1, G)
    np.testing.assert_allclose(adv.reshape(-1, G).sum(axis=1), 0.0, atol=1e-12)
    centred = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
    np.testing.assert_allclose(adv, G / (G - 1) * centred, rtol=1e-12)
    np.testing.assert_allclose(std, np.repeat(groups.std(axis=1, ddof=1), G), rtol=1e-12)


def test_an_unscored_completion_is_out_of_its_siblings_baselines():
    r = _rewards(5)
    r[1] = np.nan
    adv, _ = rloo_advantages(r, G)
    assert adv[1] == 0.0
    kept = np.array([0, 2, 3])
    alone, _ = rloo_advantages(r[kept], 3)  # the group of its three scored siblings alone
    np.testing.assert_allclose(adv[kept], alone, rtol=1e-12)
    r[4:8] = [np.nan, np.nan, 2.0, np.nan]  # a group with one scored completion: no baseline, advantage 0
    adv, _ = rloo_advantages(r, G)
    np.testing.assert_array_equal(adv[4:8], 0.0)


def test_the_kl_penalty_follows_the_clip():
    r, kl = np.array([3.0, -2.0, 0.5, 0.0]), np.array([1.0, 2.0, 0.0, -1.0])
    adv, _ = rloo_advantages(r, 2, kl_N=kl, beta=0.5, reward_clip_range=[-1.0, 1.0])
    penalised = np.clip(r, -1, 1) - 0.5 * kl  # [0.5, -2, 0.5, 0.5]
    np.testing.assert_allclose(adv, [2.5, -2.5, 0.0, 0.0])
    wrong, _ = rloo_advantages(np.clip(r - 0.5 * kl, -1, 1), 2)  # clip after the penalty: another answer
    assert np.abs(wrong - adv).max() > 0.1 and penalised[0] - penalised[1] == adv[0]


def test_normalized_advantages_have_mean_zero_and_std_one_over_the_scored():
    r = _rewards(7)
    r[[2, 9]] = np.nan
    adv, _ = rloo_advantages(r, G, normalize=True)
    scored = adv[~np.isnan(r)]
    assert abs(scored.mean()) < 1e-12 and abs(scored.std(ddof=1) - 1.0) < 1e-3  # 1e-4 is added to the std
    assert adv[2] == adv[9] == 0.0


def test_on_policy_the_loss_is_minus_the_mean_advantage_and_micro_batches_add_up():
    rng = np.random.default_rng(0)
    logps = -rng.uniform(0.1, 2.0, (4, 3))
    mask = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], float)  # an empty mask counts, ratio 1
    adv = np.array([0.5, -1.5, 2.0, 0.25])
    assert rloo_loss(logps, adv, mask).loss == pytest.approx(-adv.mean(), abs=1e-15)
    old = logps + rng.normal(0, 0.3, logps.shape)
    whole = rloo_loss(logps, adv, mask, old_logps_NC=old).loss
    shares = [
        rloo_loss(logps[sl], adv[sl], mask[sl], old_logps_NC=old[sl], num_sequences_in_step=4).loss
        for sl in (slice(0, 1), slice(1, 4))
    ]
    assert sum(shares) == pytest.approx(whole, abs=1e-15)
    assert whole != pytest.approx(-adv.mean(), abs=1e-3)  # off-policy the ratios move it


def _flat(**kw):
    return dict(model_config="tiny", max_steps=2, per_device_train_batch_size=4, num_generations=4, **kw)


def test_an_rloo_run_reads_the_rollout_knobs_and_its_own():
    cfg = TrainConfig.from_flat(**_flat(task="rloo", rloo_beta=0.1, normalize_advantages=True, epsilon=0.3))
    assert cfg.rloo.rloo_beta == 0.1 and cfg.grpo.epsilon == 0.3 and cfg.reference_kl_beta == 0.1
    assert TrainConfig.from_flat(**_flat(task="rloo")).reference_kl_beta == 0.05  # TRL's default
    assert TrainConfig.from_flat(**_flat(task="grpo")).reference_kl_beta == 0.0


@pytest.mark.parametrize("name", GRPO_ONLY_FIELDS)
def test_grpos_loss_knobs_are_refused_under_rloo(name):
    value = {
        "grpo_loss_type": "bnpo",
        "use_bias_correction_kl": False,
        "importance_sampling_level": "sequence",
        "scale_rewards": "batch",
        "multi_objective_aggregation": "normalize_then_sum",
        "delta": 2.0,
        "off_policy_mask_threshold": 0.5,
        "top_entropy_quantile": 0.5,
        "vllm_importance_sampling_mode": "token_mask",
        "use_adaptive_entropy": True,
    }.get(name, 0.5)
    extra = {"use_vllm": True} if name.startswith("vllm_") else {}  # without vLLM they are refused as GRPO's too
    if name.startswith("entropy_coef_") or name == "entropy_target":  # GRPO refuses them without adaptive control
        extra = {"use_adaptive_entropy": True}
    with pytest.raises(ConfigError, match=f"{name}=.*task='rloo'.*--{name.replace('_', '-')}"):
        TrainConfig.from_flat(**_flat(task="rloo", **extra, **{name: value}))
    TrainConfig.from_flat(**_flat(task="grpo", **extra, **{name: value}))  # the same value is GRPO's to take


def test_rloos_knobs_are_refused_on_other_tasks():
    with pytest.raises(ConfigError, match="normalize_advantages is read by task='rloo' only"):
        TrainConfig.from_flat(**_flat(task="grpo", normalize_advantages=True))
    with pytest.raises(ConfigError, match="num_generations is read by task='grpo' or 'rloo' only"):
        TrainConfig.from_flat(model_config="tiny", num_generations=4)
