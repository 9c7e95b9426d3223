"""RLOO at TRL 1.16's semantics, against TRL's own code in this process (``_trl_rloo``: a real ``RLOOTrainer``, its
``_generate_and_score_completions`` and ``_compute_loss`` on log-probs and rewards chosen here).

Invariants:
- the advantages (leave-one-out baseline over the scored siblings, the KL to the reference as a reward penalty,
  ``reward_clip_range``, ``normalize_advantages``, unscorable completions) and the logged reward and KL metrics
  equal TRL's within 1e-6 (``common.objectives.rloo.rloo_advantages`` + ``reward_metrics``);
- the loss (one ratio per completion of its summed log-ratio, the min-clip surrogate, the mean over completions)
  and its gradient w.r.t. the policy's log-probs equal TRL's within 1e-6: the numpy reference (loss), torch and
  JAX (loss and gradient), on- and off-policy, with both clips firing; two micro-batch shares sum to TRL's loss;
- each comparison fails when one side's rule is changed (the negative controls).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("trl")

pytestmark = pytest.mark.slow  # TRL's import and trainers take ~25 s: the full tier (make test-all, CI)

from twinseq.common.objectives.grpo import reward_metrics  # noqa: E402
from twinseq.common.objectives.grpo_loss import StepShare  # noqa: E402
from twinseq.common.objectives.rloo import rloo_advantages, rloo_loss  # noqa: E402
from twinseq.jax_backend import grpo as jgrpo  # noqa: E402
from twinseq.torch_backend import grpo as tgrpo  # noqa: E402

TOL = 1e-6
N, C, G = 6, 4, 3
MASK = (np.arange(C)[None, :] < np.array([4, 2, 3, 1, 4, 3])[:, None]).astype(np.float64)


@pytest.fixture(scope="module")
def trl_rloo():
    from tests.torch_backend import _trl_rloo

    return _trl_rloo


def _logps(seed: int = 0, spread: float = 0.3):
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.2, 3.0, (N, C)) * MASK
    old = (logps + rng.normal(0, spread, (N, C))) * MASK
    ref = (logps + rng.normal(0, 0.5, (N, C))) * MASK
    return logps, old, ref


def _spec(epsilon: float, epsilon_high):
    return tgrpo.LossSpec(loss_type="rloo", epsilon=epsilon, epsilon_high=epsilon_high)


def _torch(logps, old, adv, mask, spec, share=StepShare()):
    lp = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    loss, metrics = tgrpo.grpo_loss_torch(
        lp, torch.tensor(adv), torch.tensor(mask), spec, share, old_logps_NC=None if old is None else torch.tensor(old)
    )
    loss.backward()
    return float(loss.detach()), lp.grad.numpy().copy(), metrics


def _jax(logps, old, adv, mask, spec):
    import jax

    with jax.enable_x64(True):

        def f(lp):
            return jgrpo.grpo_loss_jax(
                lp,
                jnp.asarray(adv),
                jnp.asarray(mask),
                jgrpo.loss_norms(jnp.asarray(mask)),
                spec,
                old_logps_NC=None if old is None else jnp.asarray(old),
            )

        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logps, jnp.float64))
        return float(loss), np.asarray(grad, np.float64), {k: float(v) for k, v in metrics.items()}


# --------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------

LOSS_CASES = {
    "on_policy": dict(off_policy=False, epsilon=0.2, epsilon_high=None),
    "off_policy": dict(off_policy=True, epsilon=0.2, epsilon_high=None),
    "off_policy_clip_higher": dict(off_policy=True, epsilon=0.2, epsilon_high=0.28),
    "far_off_policy_both_clips": dict(off_policy=True, epsilon=0.1, epsilon_high=0.15, spread=0.6),
}


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_loss_and_gradients_equal_trls(trl_rloo, case):
    o = LOSS_CASES[case]
    logps, old, _ = _logps(seed=1, spread=o.get("spread", 0.3))
    old = old if o["off_policy"] else None
    adv = np.array([1.2, -0.8, 0.5, -0.9, 0.3, -1.1])
    want_loss, want_grad, want_metrics = trl_rloo.trl_rloo_loss_and_grad(
        logps, adv, MASK, old_logps_NC=old, epsilon=o["epsilon"], epsilon_high=o["epsilon_high"]
    )
    spec = _spec(o["epsilon"], o["epsilon_high"])
    ref = rloo_loss(logps, adv, MASK, old_logps_NC=old, epsilon=o["epsilon"], epsilon_high=o["epsilon_high"])
    assert abs(ref.loss - want_loss) <= TOL, (ref.loss, want_loss)
    for name, (loss, grad, metrics) in {
        "torch": _torch(logps, old, adv, MASK, spec),
        "jax": _jax(logps, old, adv, MASK, spec),
    }.items():
        assert abs(loss - want_loss) <= TOL, (name, loss, want_loss)
        np.testing.assert_allclose(grad, want_grad, atol=TOL, err_msg=name)
        for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert abs(metrics[k] - want_metrics[k]) <= TOL and abs(ref.metrics[k] - want_metrics[k]) <= TOL, (name, k)
    if case == "far_off_policy_both_clips":  # the case exercises both clips
        assert want_metrics["clip_ratio/low_mean"] > 0 and want_metrics["clip_ratio/high_mean"] > 0


def test_two_micro_batch_shares_sum_to_trls_loss(trl_rloo):
    logps, old, _ = _logps(seed=2)
    adv = np.array([0.7, -0.2, -0.5, 1.0, -0.4, -0.6])
    want_loss, want_grad, _ = trl_rloo.trl_rloo_loss_and_grad(logps, adv, MASK, old_logps_NC=old)
    spec, total, grads = _spec(0.2, None), 0.0, []
    for sl in (slice(0, 4), slice(4, 6)):  # unequal micro-batches: each a share of the step's 6 completions
        loss, grad, _ = _torch(logps[sl], old[sl], adv[sl], MASK[sl], spec, StepShare(num_sequences_in_step=N))
        total += loss
        grads.append(grad)
    assert abs(total - want_loss) <= TOL
    np.testing.assert_allclose(np.concatenate(grads), want_grad, atol=TOL)


def test_the_loss_comparison_sees_a_mean_instead_of_a_sum_of_log_ratios(trl_rloo):
    """Negative control: GSPO's per-completion ratio (the mean token log-ratio) in place of RLOO's sum."""
    logps, old, _ = _logps(seed=1)
    adv = np.array([1.2, -0.8, 0.5, -0.9, 0.3, -1.1])
    want_loss, want_grad, _ = trl_rloo.trl_rloo_loss_and_grad(logps, adv, MASK, old_logps_NC=old)
    gspo = tgrpo.LossSpec(loss_type="grpo", importance_sampling_level="sequence")
    loss, grad, _ = _torch(logps, old, adv, MASK, gspo)
    assert abs(loss - want_loss) > 100 * TOL or np.abs(grad - want_grad).max() > 100 * TOL


# --------------------------------------------------------------------------------------
# The advantages and the logged metrics
# --------------------------------------------------------------------------------------

# rewards are multiples of 1/4 (exact in TRL's float32); NaN: the reward function returned None
REWARDS = {
    "plain": [[1.0], [0.0], [0.5], [0.25], [0.75], [0.75]],
    "unscored": [[1.0], [np.nan], [0.5], [np.nan], [np.nan], [0.75]],
    "two_funcs": [[1.0, 0.5], [0.0, np.nan], [0.5, 0.25], [np.nan, np.nan], [0.75, 1.0], [0.25, 0.0]],
}
OPTIONS = {
    "beta0": dict(beta=0.0),
    "kl_default_beta": dict(beta=0.05),
    "kl_normalized": dict(beta=0.1, normalize_advantages=True),
    "clip_weights": dict(beta=0.05, reward_clip_range=(0.0, 0.6), reward_weights=None),
}


@pytest.mark.parametrize("rewards", sorted(REWARDS))
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_advantages_and_reward_metrics_equal_trls(trl_rloo, rewards, option):
    per = np.array(REWARDS[rewards], np.float64)
    opts = dict(OPTIONS[option])
    if per.shape[1] == 2 and option == "clip_weights":
        opts["reward_weights"] = [1.0, 0.5]
    opts = {k: v for k, v in opts.items() if v is not None}
    _, old, ref = _logps(seed=3)
    want_adv, want = trl_rloo.trl_rloo_advantages_and_metrics(
        per, G, old_logps_NC=old, ref_logps_NC=ref, mask_NC=MASK, logps_dtype="float64", **opts
    )
    weights = np.asarray(opts.get("reward_weights", [1.0] * per.shape[1]))
    total = np.nansum(per * weights, axis=1)
    total[np.isnan(per).all(axis=1)] = np.nan
    kl = ((old - ref) * MASK).sum(-1)
    beta = opts["beta"]
    adv, std = rloo_advantages(
        total,
        G,
        kl_N=kl,
        beta=beta,
        normalize=opts.get("normalize_advantages", False),
        reward_clip_range=opts.get("reward_clip_range"),
    )
    np.testing.assert_allclose(adv, want_adv, atol=TOL)
    names = [f"reward_{j}" for j in range(per.shape[1])]
    got = reward_metrics(total, per, names, G, "group", std)
    if beta:
        got["kl"] = float(kl.sum() / MASK.sum())
    for k, v in got.items():
        assert (np.isnan(v) and np.isnan(want[k])) or abs(v - want[k]) <= TOL, (k, v, want[k])
    assert ("kl" in want) == bool(beta)


@pytest.mark.parametrize("flip", ["normalize", "no_kl", "plain_mean_baseline"])
def test_the_advantage_comparison_sees_each_rule(trl_rloo, flip):
    """Negative controls: the normalisation switched, the KL penalty dropped, and the group mean (GRPO's centring)
    in place of the leave-one-out baseline each move the advantages past the tolerance."""
    per = np.array(REWARDS["unscored"], np.float64)
    _, old, ref = _logps(seed=3)
    want_adv, _ = trl_rloo.trl_rloo_advantages_and_metrics(
        per, G, old_logps_NC=old, ref_logps_NC=ref, mask_NC=MASK, logps_dtype="float64", beta=0.1
    )
    total, kl = per[:, 0], ((old - ref) * MASK).sum(-1)
    if flip == "normalize":
        adv, _ = rloo_advantages(total, G, kl_N=kl, beta=0.1, normalize=True)
    elif flip == "no_kl":
        adv, _ = rloo_advantages(total, G)
    else:
        r = (total - 0.1 * kl).reshape(-1, G)
        adv = np.nan_to_num((r - np.nanmean(r, axis=1, keepdims=True)).reshape(-1))
    assert np.abs(adv - want_adv).max() > 100 * TOL
