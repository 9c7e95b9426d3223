"""KTO's rules and numpy reference (``common.objectives.kto``), without TRL (the comparison with TRL's code is
``tests/torch_backend/test_kto_trl_semantics.py``).

Invariants:
- every row's 'kto' loss lies in (0, w) for its side's weight w, and equals the paper's value written out by hand;
- with the KL estimate at 0 the 'kto' loss of a desirable row equals 'apo_zero_unpaired''s, and an undesirable
  row's 'kto' loss is 1 minus that of a desirable row with the negated log-ratio;
- the KL estimate is clamped at 0 and moves the desirable loss up and the undesirable loss down;
- scaling one side's weight scales that side's losses only;
- the config refuses DPO's loss knobs under task=kto, KTO's knobs under other tasks, one row per micro-batch with
  the KL term, and bad values, naming the field.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError, DataError
from twinseq.common.objectives.kto import kl_estimate, kto_loss, weight_advice


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _rows(seed: int, n: int = 6):
    rng = np.random.default_rng(seed)
    pol, ref = rng.normal(-20, 3, n), rng.normal(-20, 3, n)
    labels = rng.random(n) < 0.5
    labels[0], labels[1] = True, False
    return pol, ref, labels, rng.normal(-20, 3, n), rng.normal(-21, 3, n)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_kto_losses_equal_the_paper_written_out(seed, beta):
    pol, ref, labels, pkl, rkl = _rows(seed)
    out = kto_loss(
        pol, ref, labels, policy_kl_logps=pkl, ref_kl_logps=rkl, beta=beta, desirable_weight=1.5, undesirable_weight=0.5
    )
    z = max(0.0, float(np.mean(pkl - rkl)))
    assert out.kl == pytest.approx(z, abs=1e-15)
    for i, (r, lab) in enumerate(zip(pol - ref, labels)):
        want = 1.5 * (1 - _sig(beta * (r - z))) if lab else 0.5 * (1 - _sig(beta * (z - r)))
        assert out.losses[i] == pytest.approx(want, rel=1e-12)
        assert 0 < out.losses[i] < (1.5 if lab else 0.5)
    np.testing.assert_allclose(out.rewards, beta * (pol - ref), rtol=1e-15)
    assert out.loss == pytest.approx(out.losses.mean(), rel=1e-15)


def test_with_no_kl_the_kto_loss_is_apo_zero_unpaireds_and_the_sides_mirror():
    r = np.array([-2.0, -0.5, 0.0, 0.7, 3.0])
    zeros = np.zeros_like(r)
    ones, nones = np.ones(5, bool), np.zeros(5, bool)
    kto_d = kto_loss(r, zeros, ones, policy_kl_logps=[0.0], ref_kl_logps=[0.0], beta=0.5).losses
    apo_d = kto_loss(r, zeros, ones, loss_type="apo_zero_unpaired", beta=0.5).losses
    np.testing.assert_allclose(kto_d, apo_d, rtol=1e-15)
    kto_u = kto_loss(r, zeros, nones, policy_kl_logps=[0.0], ref_kl_logps=[0.0], beta=0.5).losses
    desirable_of_neg = kto_loss(-r, zeros, ones, policy_kl_logps=[0.0], ref_kl_logps=[0.0], beta=0.5).losses
    np.testing.assert_allclose(kto_u, desirable_of_neg, rtol=1e-15)
    apo_u = kto_loss(r, zeros, nones, loss_type="apo_zero_unpaired", beta=0.5).losses
    np.testing.assert_allclose(apo_u, 1 - apo_d, rtol=1e-12)  # σ(βr) = 1 - (1 - σ(βr))


def test_the_kl_estimate_is_clamped_and_moves_the_two_sides_apart():
    assert kl_estimate(np.array([-5.0, -6.0]), np.array([-4.0, -4.0])) == 0.0  # mean -1.5, clamped
    assert kl_estimate(np.array([-3.0]), np.array([-4.0])) == 1.0
    assert kl_estimate(np.zeros(0), np.zeros(0)) == 0.0
    r, lab = np.array([0.3, 0.3]), np.array([True, False])
    low = kto_loss(r, np.zeros(2), lab, policy_kl_logps=[0.0], ref_kl_logps=[0.0]).losses
    high = kto_loss(r, np.zeros(2), lab, policy_kl_logps=[2.0], ref_kl_logps=[0.0]).losses
    assert high[0] > low[0] and high[1] < low[1]


def test_a_sides_weight_scales_that_side_only():
    pol, ref, labels, pkl, rkl = _rows(7)
    base = kto_loss(pol, ref, labels, policy_kl_logps=pkl, ref_kl_logps=rkl).losses
    heavier = kto_loss(pol, ref, labels, policy_kl_logps=pkl, ref_kl_logps=rkl, undesirable_weight=3.0).losses
    np.testing.assert_allclose(heavier[labels], base[labels], rtol=1e-15)
    np.testing.assert_allclose(heavier[~labels], 3.0 * base[~labels], rtol=1e-15)


def test_weight_advice_follows_the_papers_range():
    labels = [True] * 6 + [False] * 2
    assert "desirable-weight in [0.33, 0.44]" in weight_advice(labels, 1.0, 1.0)
    assert weight_advice(labels, 0.4, 1.0) is None
    assert weight_advice(labels, 1.0, 2.5) is None  # undesirable in [2.26, 3.0]
    assert weight_advice([True, False], 1.0, 1.0) is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(loss_type="sigmoid"), "kto_loss_type='sigmoid'"),
        (dict(beta=0.0), "beta=0.0"),
        (dict(desirable_weight=-1.0), "desirable_weight=-1.0"),
    ],
)
def test_bad_loss_arguments_are_named(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
        kto_loss([-1.0], [-1.0], [True], **kwargs)


def test_bad_labels_and_logps_are_named():
    with pytest.raises(DataError, match="labels must be a boolean array"):
        kto_loss([-1.0, -2.0], [-1.0, -2.0], [1, 0], loss_type="apo_zero_unpaired")
    with pytest.raises(ConfigError, match="policy_logps holds non-finite"):
        kto_loss([float("nan")], [-1.0], [True], loss_type="apo_zero_unpaired")


@pytest.mark.parametrize(
    "flat, needle",
    [
        (dict(task="kto", dpo_loss_type=["ipo"]), "dpo_loss_type=['ipo'] shape DPO's loss"),
        (dict(task="kto", per_device_train_batch_size=1), "per_device_train_batch_size=1 leaves each prompt"),
        (dict(task="kto", packing=True, max_length=64), "packing=True does not apply to KTO"),
        (dict(task="kto", kto_loss_type="ipo"), "kto_loss_type='ipo' is not a KTO loss"),
        (dict(task="dpo", desirable_weight=2.0), "read by task='kto' only"),
        (dict(task="sft", beta=0.5), "read by task='dpo' or 'kto' only"),
    ],
)
def test_the_config_refuses_what_kto_does_not_read(flat, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        TrainConfig.from_flat(**flat)


def test_the_config_accepts_kto_with_its_knobs_and_dpos_shared_ones():
    cfg = TrainConfig.from_flat(
        task="kto", beta=0.2, desirable_weight=1.33, precompute_ref_log_probs=True, per_device_train_batch_size=2
    )
    assert (cfg.dpo.beta, cfg.kto.desirable_weight, cfg.dpo.precompute_ref_log_probs) == (0.2, 1.33, True)
    assert TrainConfig.from_flat(task="kto", kto_loss_type="apo_zero_unpaired", per_device_train_batch_size=1)
    assert cfg.optim.learning_rate == 1e-6  # TRL's KTOConfig default
