"""RLOO (REINFORCE leave-one-out): the config section, the rules and the numpy reference, in TRL 1.16's shape.

RLOO shares GRPO's rollout (``common.run.rollout``: ``num_generations`` completions per prompt, the reward
functions, ``num_iterations``, clipping bounds, the ``grpo`` section's generation knobs) and differs in two places.

The advantage. The reward of completion i, with ``β = rloo_beta``, takes the KL to the reference as a penalty,
the first-order estimate summed over its completion tokens (it can be negative, unlike GRPO's k3)::

    r'_i = clip(r_i) - β Σ_t (log π_old(t) - log π_ref(t))
    A_i  = r'_i - mean_{j ≠ i, j scored} r'_j                       (the leave-one-out baseline of its group)

and with ``normalize_advantages`` the step's advantages become ``(A - mean A) / (std A + 1e-4)``. A completion
that no reward function scores (NaN) is left out of its siblings' baselines and gets advantage 0; so does a
group's only scored completion.

The loss. One importance ratio per completion, of its summed token log-probs, and the clipped surrogate, averaged
over the step's completions (a completion whose mask is empty still counts, with ratio 1)::

    ρ_i = exp(Σ_t m_t (log π(t) - log π_old(t)))
    L   = mean_i  -min(ρ_i A_i, clip(ρ_i, 1 - ε, 1 + ε_high) A_i)

``rloo_loss`` is ``common.objectives.grpo_loss.grpo_loss`` with ``loss_type='rloo'``: the backends run it through
their GRPO loss functions. Everything here is float64 numpy.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from twinseq.common.errors import ConfigError, DataError
from twinseq.common.fields import _CHECKS_ON, _check_fields, knob
from twinseq.common.objectives.grpo import STD_EPS, GRPOConfig, _nanstd, check_online_run, epsilon_bounds
from twinseq.common.objectives.grpo_loss import GRPOLossOutput, LossSpec, grpo_loss
from twinseq.common.tasks import TaskSpec, register_task


@dataclass
class RLOOConfig:
    """REINFORCE leave-one-out (read with ``task=rloo`` only; the rollout's knobs are the ``grpo`` section's).
    TRL 1.16's RLOOConfig names, except ``rloo_beta`` (``beta`` is DPO's)."""

    rloo_beta: float = knob(0.05, ge=0)
    """KL coefficient (TRL's RLOO ``beta``, default 0.05): the completion's summed log-ratio to the reference,
    times this, is subtracted from its reward. 0: no reference model is loaded or run."""
    normalize_advantages: bool = False
    """Normalise the step's advantages to mean 0 and std 1 (over the scored completions)."""
    reward_clip_range: Optional[list[float]] = None
    """``[min, max]``: clip each completion's reward before the KL penalty (None: no clipping)."""

    def __post_init__(self) -> None:
        if _CHECKS_ON.get():
            _check_fields(self)


GRPO_ONLY_FIELDS = (
    "grpo_loss_type",
    "grpo_beta",
    "use_bias_correction_kl",
    "importance_sampling_level",
    "delta",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "top_entropy_quantile",
    "entropy_coef",  # TRL's RLOO has no entropy bonus
    "use_adaptive_entropy",
    "entropy_coef_min",
    "entropy_coef_max",
    "entropy_coef_delta",
    "entropy_target",
    "off_policy_mask_threshold",
    "scale_rewards",
    "multi_objective_aggregation",
    "vllm_importance_sampling_mode",  # TRL's RLOO has no vLLM importance-sampling correction: it is GRPO's
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
)
"""The ``grpo`` section's fields that shape GRPO's loss or advantage, which RLOO replaces: set under ``task=rloo``
they are refused, not ignored."""


def check_rloo_config(rloo: RLOOConfig, grpo: GRPOConfig) -> None:
    """The rules of an RLOO run (beside ``check_grpo_config``, which its rollout knobs pass too)."""
    default = GRPOConfig()
    changed = [name for name in GRPO_ONLY_FIELDS if getattr(grpo, name) != getattr(default, name)]
    if changed:
        flags = " ".join("--" + name.replace("_", "-") for name in changed)
        raise ConfigError(
            f"{', '.join(f'{n}={getattr(grpo, n)!r}' for n in changed)} shape GRPO's loss or advantage, and "
            f"task='rloo' has its own (the leave-one-out baseline, a sequence-level clipped ratio, the KL as a "
            f"reward penalty with --rloo-beta); drop {flags}, or use --task grpo."
        )
    clip = rloo.reward_clip_range
    if clip is not None and (len(clip) != 2 or not clip[0] <= clip[1]):
        raise ConfigError(
            f"reward_clip_range={clip!r} is not valid: give two numbers, min <= max (e.g. --reward-clip-range -1 1), "
            f"or leave it unset."
        )


def rloo_advantages(
    rewards_N: np.ndarray,
    num_generations: int,
    *,
    kl_N: Optional[np.ndarray] = None,
    beta: float = 0.0,
    normalize: bool = False,
    reward_clip_range: Optional[tuple[float, float] | list[float]] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [N], the std of each completion's group of penalised rewards [N]: what ``frac_reward_zero_std``
    reads). ``rewards_N``: the weighted rewards (NaN: unscorable); ``kl_N``: each completion's summed
    ``log π_old - log π_ref`` over its loss mask (needed when ``beta > 0``). Completions ``g*G .. g*G+G-1`` are
    group g.

    >>> rloo_advantages(np.array([1.0, 0.0, 2.0, 3.0]), 2)[0].tolist()
    [1.0, -1.0, -1.0, 1.0]
    >>> rloo_advantages(np.array([1.0, 0.0, np.nan, 4.0]), 4)[0].tolist()
    [-1.0, -2.5, 0.0, 3.5]
    """
    r = np.asarray(rewards_N, np.float64)
    g = num_generations
    if r.ndim != 1 or r.size % g:
        raise DataError(
            f"rewards of shape {r.shape} do not hold whole groups of num_generations={g}; pass num_generations "
            f"completions' rewards per prompt, as a 1-D array."
        )
    if reward_clip_range is not None:
        r = np.clip(r, reward_clip_range[0], reward_clip_range[1])
    if beta != 0.0:
        if kl_N is None:
            raise ConfigError(
                f"rloo_beta={beta} puts the KL to the reference into the reward and needs each completion's summed "
                f"log-ratio kl_N; pass it, or set rloo_beta=0."
            )
        r = r - beta * np.asarray(kl_N, np.float64)
    groups = r.reshape(-1, g)
    std = np.repeat(_nanstd(groups, axis=1), g) if g > 1 else np.zeros_like(r)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if g > 1:
            scored = (~np.isnan(groups)).sum(axis=1, keepdims=True)
            baseline = (np.nansum(groups, axis=1, keepdims=True) - groups) / (scored - 1)
            adv = (groups - baseline).reshape(-1)
        else:
            adv = np.zeros_like(r)
        if normalize:
            adv = (adv - np.nanmean(adv)) / (_nanstd(adv) + STD_EPS)
    return np.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0), std


def rloo_loss_spec(grpo: GRPOConfig) -> LossSpec:
    """The backends' ``LossSpec`` of RLOO's loss: the ``grpo`` section's clip bounds; no KL term (it is in the
    reward)."""
    eps_low, eps_high = epsilon_bounds(grpo)
    return LossSpec(loss_type="rloo", epsilon=eps_low, epsilon_high=eps_high)


def rloo_loss(
    logps_NC: np.ndarray,
    advantages_N: np.ndarray,
    mask_NC: np.ndarray,
    *,
    old_logps_NC: Optional[np.ndarray] = None,
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    num_sequences_in_step: Optional[int] = None,
) -> GRPOLossOutput:
    """RLOO's loss of completions ``[N, C]`` (see the module docstring): this micro-batch's share of a step of
    ``num_sequences_in_step`` completions (None: the micro-batch is the step), and the completion-level clip
    fractions.

    >>> out = rloo_loss(np.zeros((2, 3)), np.array([1.0, -3.0]), np.ones((2, 3)))
    >>> out.loss
    1.0
    """
    return grpo_loss(
        logps_NC,
        advantages_N,
        mask_NC,
        old_logps_NC=old_logps_NC,
        loss_type="rloo",
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        num_sequences_in_step=num_sequences_in_step,
    )


def check_rloo_run(cfg: Any) -> None:
    """RLOO's rules over a ``TrainConfig``: the online task's, its own knobs, and no Liger (no RLOO variant)."""
    check_online_run(cfg)
    check_rloo_config(cfg.rloo, cfg.grpo)
    if cfg.loss.loss_type == "liger" or cfg.loss.use_liger_kernel:
        raise ConfigError(
            "loss_type='liger' runs Liger's fused GRPO loss, which has no RLOO variant; use --loss-type "
            "fused_linear (chunked log-probs, no [tokens, vocab] tensor) with --task rloo."
        )


RLOO_TASK = register_task(
    TaskSpec(
        name="rloo",
        trainer="RLOOTrainer",
        builder="grpo:build_grpo",  # GRPO's rollout and trainer, RLOO's advantage and loss
        order=3,
        sections=("grpo", "rloo"),
        reference=True,
        online=True,
        kl_beta="rloo.rloo_beta",
        shares_prefix=True,
        learning_rate=1e-6,
        peft_learning_rate=1e-5,
        plot_keys=("loss", "reward", "completions/mean_length", "tokens_per_second"),
        check=check_rloo_run,
        evaluator="twinseq.common.run.eval_set:grpo_evaluator",
    )
)
"""REINFORCE leave-one-out (TRL's ``RLOOTrainer``)."""
