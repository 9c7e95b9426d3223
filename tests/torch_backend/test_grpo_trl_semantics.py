"""GRPO at TRL 1.16's semantics, against TRL's own code in this process (``_trl_grpo``: a real ``GRPOTrainer``, its
``_compute_loss`` and ``_generate_and_score_completions`` on log-probs and rewards chosen here).

Invariants:
- the KL term is TRL 1.16's default, bias-corrected (``use_bias_correction_kl``): on-policy its gradient per token is
  ``beta * (logp - ref_logp)`` (the reverse-KL gradient), not the k3 term's ``beta * (1 - exp(ref_logp - logp))``;
- loss and gradient w.r.t. the policy's log-probs equal TRL's within 1e-6 (numpy reference: loss; torch and JAX:
  loss and gradient), for every loss type both have, on- and off-policy, with and without the correction;
- advantages and the logged reward metrics equal TRL's within 1e-6, with completions that no reward function
  scores (NaN: out of their group's mean and std, advantage 0) and with a group whose rewards are all equal;
- each comparison fails when one side's option is flipped (the negative controls).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")

from twinseq.common.objectives.grpo import GRPO_LOSS_TYPES, group_advantages, reward_metrics, score_advantages  # noqa: E402
from twinseq.common.objectives.grpo_loss import LossSpec, StepShare, grpo_loss  # noqa: E402
from twinseq.jax_backend import grpo as jgrpo  # noqa: E402
from twinseq.torch_backend import grpo as tgrpo  # noqa: E402

N, C, G = 4, 5, 4
TOL = 1e-6


def _inputs(seed: int = 0, off_policy: bool = True):
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.2, 3.0, (N, C))
    mask = (np.arange(C)[None, :] < np.array([5, 3, 4, 2])[:, None]).astype(np.float64)
    old = logps + rng.normal(0, 0.3, (N, C)) if off_policy else None
    ref = logps + rng.normal(0, 0.8, (N, C))
    adv = np.array([1.2, -0.8, 0.5, -0.9])
    return logps, old, ref, adv, mask


def _torch_loss_and_grad(logps, old, ref, adv, mask, spec: LossSpec) -> tuple[float, np.ndarray]:
    lp = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    loss, _ = tgrpo.grpo_loss_torch(
        lp,
        torch.tensor(adv),
        torch.tensor(mask),
        spec,
        StepShare(),
        old_logps_NC=None if old is None else torch.tensor(old),
        ref_logps_NC=torch.tensor(ref),
    )
    loss.backward()
    return float(loss.detach()), lp.grad.numpy().copy()


def _jax_loss_and_grad(logps, old, ref, adv, mask, spec: LossSpec) -> tuple[float, np.ndarray]:
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
                ref_logps_NC=jnp.asarray(ref),
            )[0]

        loss, grad = jax.value_and_grad(f)(jnp.asarray(logps, jnp.float64))
        return float(loss), np.asarray(grad, np.float64)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_on_policy_kl_gradient_is_the_reverse_kl_gradient(backend):
    """With the correction, d(beta * ratio * k3)/d logp = beta * (logp - ref) where ratio = 1; without it,
    beta * (1 - exp(ref - logp)). Checked with no advantage, so only the KL term moves the gradient."""
    logps, _, ref, _, mask = _inputs(off_policy=False)
    zero_adv = np.zeros(N)
    run = _torch_loss_and_grad if backend == "torch" else _jax_loss_and_grad
    beta, tokens = 0.5, mask.sum()
    for corrected, expected in ((True, beta * (logps - ref)), (False, beta * (1 - np.exp(ref - logps)))):
        spec = LossSpec("dapo", beta=beta, use_bias_correction_kl=corrected)
        _, grad = run(logps, None, ref, zero_adv, mask, spec)
        np.testing.assert_allclose(grad, expected * mask / tokens, rtol=0, atol=1e-12)
    # the two forms differ here (a test of a gradient that the option does not move could not fail)
    assert np.abs((logps - ref) - (1 - np.exp(ref - logps)))[mask > 0].max() > 0.1


# ---------------------------------------------------------------------------------------------------------------------
# Against TRL 1.16's code
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_grpo():
    pytest.importorskip("trl")
    from tests.torch_backend import _trl_grpo

    return _trl_grpo


OPTIONS = {
    "token": {},
    "sequence": {"importance_sampling_level": "sequence"},
    "delta": {"delta": 1.25},
    "sapo_temperatures": {"sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.6},
    "off_policy_mask": {"off_policy_mask_threshold": 0.01},  # drops row 3 (gap 0.022, A < 0), keeps row 2 (A > 0)
    "vespo_shape": {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.0, "vespo_k_neg": 4.0, "vespo_lambda_neg": 1.0},
}
LOSS_CASES = (
    [
        (loss_type, beta, corrected, off_policy, "token")
        for loss_type in GRPO_LOSS_TYPES
        for beta, corrected in ((0.0, True), (0.04, True), (0.5, True), (0.5, False))
        for off_policy in (False, True)
    ]
    + [
        (loss_type, 0.04, True, True, option)
        for loss_type in GRPO_LOSS_TYPES
        for option in ("sequence", "delta", "off_policy_mask")
    ]
    + [("sapo", 0.04, True, True, "sapo_temperatures"), ("vespo", 0.04, True, True, "vespo_shape")]
)
# the fast tier keeps TRL's default loss (dapo) and grpo; every case runs in the full tier (make test-all)
LOSS_CASES = [c if c[0] in ("dapo", "grpo") else pytest.param(*c, marks=pytest.mark.slow) for c in LOSS_CASES]


@pytest.mark.parametrize("loss_type, beta, corrected, off_policy, option", LOSS_CASES)
def test_loss_and_gradients_equal_trls(trl_grpo, loss_type, beta, corrected, off_policy, option):
    logps, old, ref, adv, mask = _inputs(seed=1, off_policy=off_policy)
    # cispo's epsilon_high caps the ratio itself (ScaleRL's eps_max): 1.1 lets the cap bind on these ratios
    eps_high = 1.1 if loss_type == "cispo" else 0.28
    options = OPTIONS[option]
    spec = LossSpec(loss_type, 0.2, eps_high, beta, C, use_bias_correction_kl=corrected, **options)
    want_loss, want_grad, want_metrics = trl_grpo.trl_loss_and_grad(
        logps, old, ref, adv, mask, loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=eps_high,
        use_bias_correction_kl=corrected, max_completion_length=C, **options,
    )
    ref_out = grpo_loss(
        logps, adv, mask, old_logps_NC=old, ref_logps_NC=ref, loss_type=loss_type, epsilon=0.2,
        epsilon_high=eps_high, beta=beta, use_bias_correction_kl=corrected, max_completion_length=C, **options,
    )
    assert abs(ref_out.loss - want_loss) <= TOL
    compared = {"kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio",
                "vespo/phi_seq_mean"}
    assert set(ref_out.metrics) == compared & set(want_metrics)
    for key, value in ref_out.metrics.items():
        assert abs(value - want_metrics[key]) <= TOL, key
    for run in (_torch_loss_and_grad, _jax_loss_and_grad):
        loss, grad = run(logps, old, ref, adv, mask, spec)
        assert abs(loss - want_loss) <= TOL, run.__name__
        np.testing.assert_allclose(grad, want_grad, rtol=0, atol=TOL, err_msg=run.__name__)


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_two_micro_batch_step_equals_trls_accumulated_step(trl_grpo, loss_type):
    """TRL's step of two micro-batches (rows 0-1, 2-3) vs the sum of twinseq's two micro-batch shares."""
    logps, old, ref, adv, mask = _inputs(seed=2)
    spec = LossSpec(loss_type, 0.2, 0.28, 0.1, C)
    want_loss, want_grad, _ = trl_grpo.trl_loss_and_grad(
        logps,
        old,
        ref,
        adv,
        mask,
        loss_type=loss_type,
        beta=0.1,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=C,
        grad_accum=2,
    )
    share = StepShare(num_sequences_in_step=N, num_tokens_in_step=int(mask.sum()), num_micro_batches=2)
    total, grad = 0.0, np.zeros((N, C))
    for rows in (slice(0, 2), slice(2, 4)):
        lp = torch.tensor(logps[rows], requires_grad=True)
        loss, _ = tgrpo.grpo_loss_torch(
            lp,
            torch.tensor(adv[rows]),
            torch.tensor(mask[rows]),
            spec,
            share,
            old_logps_NC=torch.tensor(old[rows]),
            ref_logps_NC=torch.tensor(ref[rows]),
        )
        loss.backward()
        total += float(loss.detach())
        grad[rows] = lp.grad.numpy()
    assert abs(total - want_loss) <= TOL
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=TOL)


def test_the_loss_comparison_sees_a_flipped_kl_correction(trl_grpo):
    """Negative control: twinseq without the correction against TRL with it (its default) must not agree, even
    on-policy, where the losses are equal and only the gradients tell them apart."""
    logps, _, ref, adv, mask = _inputs(seed=1, off_policy=False)
    want_loss, want_grad, _ = trl_grpo.trl_loss_and_grad(logps, None, ref, adv, mask, beta=0.5)
    loss, grad = _torch_loss_and_grad(
        logps, None, ref, adv, mask, LossSpec("dapo", beta=0.5, use_bias_correction_kl=False)
    )
    assert abs(loss - want_loss) <= TOL  # on-policy the values agree...
    assert np.abs(grad - want_grad).max() > 1e-2  # ...the gradients do not


REWARD_CASES = {
    # one reward function; completion 2 unscored
    "one_unscored": [[1.0], [0.0], [np.nan], [0.0], [0.5], [0.5], [0.5], [0.5]],
    # two weighted functions abstaining on different completions; completion 5 unscored by both; group 2 has one
    # scored completion only (its std is NaN in TRL: advantage 0)
    "two_functions": [
        [1.0, np.nan],
        [np.nan, 2.0],
        [0.0, 1.0],
        [3.0, 0.0],
        [np.nan, np.nan],
        [np.nan, np.nan],
        [np.nan, np.nan],
        [1.0, np.nan],
    ],
}


def _rewards_from_columns(per_NF: np.ndarray, weights):
    """twinseq's own path: real reward callables that return the columns, None where NaN."""
    from twinseq.common.objectives.grpo import compute_rewards

    def func(j):
        def f(prompts, completions, **_):
            return [None if np.isnan(v) else float(v) for v in per_NF[:, j]]

        f.__name__ = f"reward_{j}"
        return f

    funcs = [func(j) for j in range(per_NF.shape[1])]
    return compute_rewards(funcs, ["p"] * len(per_NF), ["c"] * len(per_NF), weights=weights), funcs


AGGREGATIONS = [("sum_then_normalize", scale) for scale in ("group", "batch", "none")] + [
    ("normalize_then_sum", "group")
]


@pytest.mark.parametrize("case", sorted(REWARD_CASES))
@pytest.mark.parametrize("aggregation, scale_rewards", AGGREGATIONS)
def test_advantages_and_reward_metrics_equal_trls(trl_grpo, case, aggregation, scale_rewards):
    per = np.array(REWARD_CASES[case], np.float64)
    weights = [1.0] if per.shape[1] == 1 else [0.7, 1.5]
    want_adv, want_metrics = trl_grpo.trl_advantages_and_metrics(
        per, G, reward_weights=weights, scale_rewards=scale_rewards, multi_objective_aggregation=aggregation
    )
    (total, per_out), funcs = _rewards_from_columns(per, weights)
    adv, std = score_advantages(
        total, per_out, G, weights=weights, scale_rewards=scale_rewards, aggregation=aggregation
    )
    np.testing.assert_allclose(adv, want_adv, rtol=0, atol=TOL)
    metrics = reward_metrics(total, per_out, [f.__name__ for f in funcs], G, scale_rewards, std)
    assert set(want_metrics) <= set(metrics), sorted(set(want_metrics) - set(metrics))
    for key, want in want_metrics.items():
        got = metrics[key]
        assert (np.isnan(got) and np.isnan(want)) or abs(got - want) <= TOL, (key, got, want)
    # negative controls: the rule before TRL 1.16's (unscored -> 0, kept in its group) does not agree, nor does
    # the other aggregation where there are two functions
    assert np.abs(group_advantages(np.nan_to_num(total), G, scale_rewards) - want_adv).max() > 1e-2
    if per.shape[1] > 1:
        other = {"sum_then_normalize": "normalize_then_sum"}.get(aggregation, "sum_then_normalize")
        flipped, _ = score_advantages(total, per_out, G, weights=weights, scale_rewards=scale_rewards,
                                      aggregation=other)
        assert np.abs(flipped - want_adv).max() > 1e-2


@pytest.mark.parametrize(
    "loss_type, option",
    [("grpo", "sequence"), ("dapo", "delta"), ("dapo", "off_policy_mask"), ("sapo", "sapo_temperatures"),
     ("vespo", "vespo_shape"), ("cispo", "token"), ("luspo", "token")],
)
def test_the_loss_comparison_sees_each_option(trl_grpo, loss_type, option):
    """Negative controls: twinseq without the option (or, for a loss type, with its neighbour's reduction) against
    TRL with it must not agree; the inputs make every option bind."""
    logps, old, ref, adv, mask = _inputs(seed=1)
    eps_high = 1.1 if loss_type == "cispo" else 0.28
    _, want_grad, _ = trl_grpo.trl_loss_and_grad(
        logps, old, ref, adv, mask, loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=eps_high,
        max_completion_length=C, **OPTIONS[option],
    )
    neighbour = {"cispo": "dapo", "luspo": "grpo"}.get(loss_type, loss_type)  # the others: without the option
    _, grad = _torch_loss_and_grad(logps, old, ref, adv, mask, LossSpec(neighbour, 0.2, eps_high, 0.04, C))
    assert np.abs(grad - want_grad).max() > 1e-3


@pytest.mark.parametrize("quantile", [0.2, 0.55])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_top_entropy_quantile_equals_trls(trl_grpo, loss_type, quantile):
    """Only the tokens at or above the 1 - q quantile of the micro-batch's entropies keep their policy loss (the KL
    term stays on every token, as in TRL). The quantiles fall between the 14 tokens' entropies (no tie: TRL takes
    its quantile in float32)."""
    logps, old, ref, adv, mask = _inputs(seed=3)
    entropy = np.random.default_rng(7).uniform(0.1, 4.0, (N, C))
    spec = LossSpec(loss_type, 0.2, 0.28, 0.04, C, top_entropy_quantile=quantile)
    want_loss, want_grad, _ = trl_grpo.trl_loss_and_grad(
        logps, old, ref, adv, mask, loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28,
        max_completion_length=C, entropies_NC=entropy, top_entropy_quantile=quantile,
    )
    ref_out = grpo_loss(logps, adv, mask, old_logps_NC=old, ref_logps_NC=ref, loss_type=loss_type, epsilon=0.2,
                        epsilon_high=0.28, beta=0.04, max_completion_length=C, top_entropy_quantile=quantile,
                        entropy_NC=entropy)
    assert abs(ref_out.loss - want_loss) <= TOL
    lp = torch.tensor(logps, requires_grad=True)
    loss, _ = tgrpo.grpo_loss_torch(lp, torch.tensor(adv), torch.tensor(mask), spec, StepShare(),
                                    old_logps_NC=torch.tensor(old), ref_logps_NC=torch.tensor(ref),
                                    entropy_NC=torch.tensor(entropy))
    loss.backward()
    assert abs(float(loss) - want_loss) <= TOL
    np.testing.assert_allclose(lp.grad.numpy(), want_grad, rtol=0, atol=TOL)
    import jax

    with jax.enable_x64(True):
        def f(x):
            return jgrpo.grpo_loss_jax(x, jnp.asarray(adv), jnp.asarray(mask), jgrpo.loss_norms(jnp.asarray(mask)),
                                       spec, old_logps_NC=jnp.asarray(old), ref_logps_NC=jnp.asarray(ref),
                                       entropy_NC=jnp.asarray(entropy))[0]

        j_loss, j_grad = jax.value_and_grad(f)(jnp.asarray(logps))
    assert abs(float(j_loss) - want_loss) <= TOL
    np.testing.assert_allclose(np.asarray(j_grad), want_grad, rtol=0, atol=TOL)
    # negative control: every token (q = 1) is not what TRL computed
    everything, _, _ = trl_grpo.trl_loss_and_grad(
        logps, old, ref, adv, mask, loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28,
        max_completion_length=C, entropies_NC=entropy,
    )
    assert abs(everything - want_loss) > 1e-4


# --------------------------------------------------------------------------------------
# vLLM's importance-sampling correction (vllm_importance_sampling_*)
# --------------------------------------------------------------------------------------

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _engine_logps(seed: int = 3):
    """The sampling policy's log-probs [N, C] (float32 values, as TRL holds them) and the engine's per row (one NaN
    that vLLM did not score), with gaps wide enough that the bounds [0.6, 1.8] truncate and mask some ratios."""
    rng = np.random.default_rng(seed)
    lengths = [5, 3, 4, 2]
    old = (-rng.uniform(0.2, 3.0, (N, C))).astype(np.float32).astype(np.float64)
    engine = [list((old[i, :n] + rng.normal(0, 0.5, n)).astype(np.float32).astype(np.float64)) for i, n in
              enumerate(lengths)]  # fmt: skip
    engine[0][2] = float("nan")
    mask = (np.arange(C)[None, :] < np.array(lengths)[:, None]).astype(np.float64)
    padded = np.full((N, C), np.nan)
    for i, row in enumerate(engine):
        padded[i, : len(row)] = row
    return old, engine, padded, mask


@pytest.mark.parametrize("mode", IS_MODES)
def test_vllm_importance_ratios_and_metrics_equal_trls(trl_grpo, mode):
    from twinseq.common.objectives.grpo_loss import vllm_importance_metrics, vllm_importance_ratio

    old, engine, padded, mask = _engine_logps()
    want, want_metrics = trl_grpo.trl_vllm_importance_ratio(old, engine, mode=mode, clip_min=0.6, clip_max=1.8)
    ours = vllm_importance_ratio(old, padded, mask, mode=mode, clip_min=0.6, clip_max=1.8)
    assert ours.shape == want.shape
    # TRL computes in float32: its ratios carry float32 rounding (relative 1e-6 at most here)
    np.testing.assert_allclose(ours * (mask if ours.shape[1] > 1 else 1), want * (mask if want.shape[1] > 1 else 1),
                               rtol=TOL, atol=0)  # fmt: skip
    if mode.endswith("truncate"):
        assert ((ours == 0.6) | (ours == 1.8)).any()  # a bound binds
    else:
        assert (ours == 0).any() and (ours > 0).any()  # some masked, some kept
    metrics = vllm_importance_metrics(old, padded, mask, ours)
    assert set(metrics) == set(want_metrics)
    for key, value in metrics.items():
        assert value == pytest.approx(want_metrics[key], rel=TOL), key
    other = vllm_importance_ratio(old, padded, mask, mode=IS_MODES[(IS_MODES.index(mode) + 1) % 4], clip_min=0.6,
                                  clip_max=1.8)  # fmt: skip
    assert other.shape != want.shape or np.abs(other - want).max() > 1e-3  # the negative control


@pytest.mark.parametrize("loss_type, mode", [("dapo", "sequence_mask"), ("grpo", "token_truncate"),
                                             pytest.param("vespo", "token_mask", marks=pytest.mark.slow),
                                             pytest.param("cispo", "sequence_truncate", marks=pytest.mark.slow)])
def test_the_loss_weighted_by_vllm_ratios_equals_trls(trl_grpo, loss_type, mode):
    from twinseq.common.objectives.grpo_loss import vllm_importance_ratio

    logps, old, ref, adv, mask = _inputs(seed=1, off_policy=True)
    _, _, padded, _ = _engine_logps()
    ratio = vllm_importance_ratio(old, padded, mask, mode=mode, clip_min=0.6, clip_max=1.8)
    eps_high = 1.1 if loss_type == "cispo" else 0.28
    want_loss, want_grad, _ = trl_grpo.trl_loss_and_grad(
        logps, old, ref, adv, mask, loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=eps_high,
        max_completion_length=C, is_ratio_NC=ratio,
    )  # fmt: skip
    ours = grpo_loss(logps, adv, mask, old_logps_NC=old, ref_logps_NC=ref, loss_type=loss_type, epsilon=0.2,
                     epsilon_high=eps_high, beta=0.04, max_completion_length=C, is_ratio_NC=ratio)  # fmt: skip
    assert abs(ours.loss - want_loss) <= TOL
    lp = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    spec = LossSpec(loss_type, 0.2, eps_high, 0.04, C)
    loss, _ = tgrpo.grpo_loss_torch(lp, torch.tensor(adv), torch.tensor(mask), spec, StepShare(),
                                    old_logps_NC=torch.tensor(old), ref_logps_NC=torch.tensor(ref),
                                    is_ratio_NC=torch.tensor(ratio))  # fmt: skip
    loss.backward()
    assert abs(float(loss.detach()) - want_loss) <= TOL
    np.testing.assert_allclose(lp.grad.numpy(), want_grad, rtol=0, atol=TOL)
    uncorrected = grpo_loss(logps, adv, mask, old_logps_NC=old, ref_logps_NC=ref, loss_type=loss_type, epsilon=0.2,
                            epsilon_high=eps_high, beta=0.04, max_completion_length=C)  # fmt: skip
    assert abs(uncorrected.loss - want_loss) > 1e-4  # the negative control: the correction changes the loss
