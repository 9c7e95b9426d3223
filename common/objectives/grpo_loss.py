"""The GRPO loss family (and RLOO's loss), the numpy reference: ``LossSpec``, the surrogates, their reductions
and clip metrics, and ``grpo_loss``. ``common.objectives.grpo`` holds the config, the rewards and the advantages.

After the rollout (``common.objectives.grpo``) the policy takes ``num_iterations`` optimizer steps on its batch
with the clipped surrogate, per completion token t (``π`` the policy, ``π_old`` the sampling policy, ``π_ref``
the reference):

    ρ_t   = exp(log π(t) - log π_old(t))
    L_t   = -min(ρ_t A, clip(ρ_t, 1 - ε, 1 + ε_high) A) + β ρ_t KL_t
    KL_t  = exp(log π_ref(t) - log π(t)) - (log π_ref(t) - log π(t)) - 1   (the k3 estimator)

``ρ_t`` multiplies the KL with ``use_bias_correction_kl`` (TRL 1.16's default). With
``importance_sampling_level='sequence'`` (GSPO) ``ρ`` is one per completion, the exponential of the
mean token log-ratio. ``delta`` caps the unclipped ``ρ`` (two-sided clipping). The other surrogates
replace the min-clip term: ``cispo`` ``-min(ρ, ε_high)ᵈᵉᵗᵃᶜʰ A log π``; ``sapo`` ``-σ(τ(ρ - 1)) 4/τ A``
(``τ`` by the sign of ``A``); ``luspo`` keeps the min-clip term and sums each completion's tokens;
``vespo`` ``-φ(w)ᵈᵉᵗᵃᶜʰ A log π`` with the gamma weight ``φ(w) = exp(λ + k log w - λ w)`` of the
completion's ratio ``w = exp(Σ_t log ρ_t)`` (k, λ by the sign of ``A``).

``ρ_t`` is 1 with gradient when ``num_iterations == 1`` (``π_old`` is the detached policy).
The per-token losses ``L`` [N, C] (mask ``m``) are reduced by ``grpo_loss_type``:

- ``grpo``:    mean over completions of each completion's token mean ``Σ_t L m / Σ_t m``;
- ``bnpo``:    token mean over the micro-batch ``Σ L m / Σ m`` (then averaged over micro-batches);
- ``dr_grpo``: ``Σ L m / (N · max_completion_length)``, a constant normaliser;
- ``dapo``:    ``Σ L m / (completion tokens of the whole step)``; TRL's default (``cispo``, ``vespo`` too);
- ``sapo``:    as ``grpo``;
- ``luspo``:   mean over completions of each completion's token sum ``Σ_t L m``;
- ``rloo``:    RLOO's (``common.objectives.rloo``, not a ``grpo_loss_type``): one ratio per completion of its
               summed token log-ratio, the min-clip term, the mean over completions.

``grpo_loss`` evaluates one micro-batch's share of the step's loss, so that summing the
shares of a step's micro-batches gives the step's loss (with one micro-batch, the loss
itself). Everything here is float64 numpy: the reference the backends are tested against.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from twinseq.common.errors import ConfigError
from twinseq.common.objectives.grpo import (
    GRPO_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    GRPOConfig,
    epsilon_bounds,
)

LOSS_FAMILY = GRPO_LOSS_TYPES + ("rloo",)
"""Every loss ``LossSpec`` runs: GRPO's types and RLOO's (``common.objectives.rloo``; ``task=rloo`` picks it)."""
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "rloo")
"""The loss types with the min-clip surrogate (and its clip metrics)."""


@dataclass(frozen=True)
class LossSpec:
    """The static part of a backend's GRPO loss (hashable: a ``jit`` static argument on JAX); the step's normalisers
    (``StepShare``) change with every generation and are passed beside it."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    beta: float = 0.0
    max_completion_length: Optional[int] = None
    use_bias_correction_kl: bool = True
    importance_sampling_level: str = "token"
    delta: Optional[float] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: Optional[float] = None
    top_entropy_quantile: float = 1.0
    entropy_bonus: bool = False
    """The entropy bonus is on (``entropy_coef != 0`` or ``use_adaptive_entropy``): the entropy is computed with its
    gradient; the coefficient itself changes between steps, so it is ``StepShare.entropy_coef``."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_FAMILY:
            raise ConfigError(f"grpo_loss_type={self.loss_type!r} is not valid; choose one of {GRPO_LOSS_TYPES}.")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ConfigError(
                f"importance_sampling_level={self.importance_sampling_level!r} is not valid; choose one of "
                f"{IMPORTANCE_SAMPLING_LEVELS}."
            )
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ConfigError(
                "grpo_loss_type='dr_grpo' needs max_completion_length (got None); set --max-completion-length."
            )

    @classmethod
    def of(cls, grpo: GRPOConfig, max_completion_length: int) -> "LossSpec":
        eps_low, eps_high = epsilon_bounds(grpo)
        # the options GRPOConfig names as LossSpec does pass through; the renamed and resolved ones are given
        same = {f.name: getattr(grpo, f.name) for f in dataclasses.fields(cls) if hasattr(grpo, f.name)}
        same.update(
            entropy_bonus=grpo.entropy_coef != 0.0 or grpo.use_adaptive_entropy,
            loss_type=grpo.grpo_loss_type,
            epsilon=eps_low,
            epsilon_high=eps_high,
            beta=grpo.grpo_beta,
            max_completion_length=max_completion_length,
        )
        return cls(**same)

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class StepShare(NamedTuple):
    """What a micro-batch's loss is a share of: the step's completions (``grpo``, ``dr_grpo``), completion tokens
    (``dapo``; with ``steps_per_generation`` above ``gradient_accumulation_steps``, the generation's tokens per
    step, as TRL) and micro-batches (``bnpo``, the entropy bonus), over every rank. None: the micro-batch's own
    count. ``entropy_coef``: the entropy bonus's coefficient for this step (``EntropyControl.applied``)."""

    num_sequences_in_step: Optional[int] = None
    num_tokens_in_step: Optional[float] = None
    num_micro_batches: int = 1
    entropy_coef: float = 0.0


# ---------------------------------------------------------------------------------------
# The loss family (numpy reference)
# ---------------------------------------------------------------------------------------


class GRPOLossOutput(NamedTuple):
    loss: float
    """This micro-batch's share of the step's loss."""
    metrics: dict[str, float]
    """Token means over the micro-batch's completion tokens: ``kl``, ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean``; with an entropy bonus ``policy_loss`` (the share without
    it)."""


@dataclass(frozen=True)
class LossNorm:
    """What the reduction of one micro-batch divides by (see ``loss_normaliser``)."""

    loss_type: str
    num_sequences_in_step: Optional[int] = None  # grpo
    num_tokens_in_step: Optional[float] = None  # dapo
    num_micro_batches: int = 1  # bnpo
    max_completion_length: Optional[int] = None  # dr_grpo


def log_importance_weights_np(logps_NC, old_logps_NC, mask_NC, level: str = "token") -> np.ndarray:
    """log ρ: per token [N, C], or per completion [N, 1] (``sequence``: the mean token log-ratio over its mask;
    ``sum``: the sum, RLOO's)."""
    log_ratio = np.asarray(logps_NC, np.float64) - np.asarray(old_logps_NC, np.float64)
    if level in ("sequence", "sum"):
        m = np.asarray(mask_NC, np.float64)
        summed = (log_ratio * m).sum(-1, keepdims=True)
        return summed if level == "sum" else summed / np.maximum(m.sum(-1, keepdims=True), 1.0)
    return log_ratio


VESPO_LOG_W_MIN = math.log(1e-8)
"""The floor of VESPO's log sequence ratio (TRL's, from the original implementation); the ceiling is 20."""


def vespo_weights_np(log_ratio_NC, advantages_N, mask_NC, spec: LossSpec, is_ratio_NC=None) -> np.ndarray:
    """VESPO's gamma weight φ(w) per completion [N, 1], a constant of the loss (TRL computes it without gradient);
    ``is_ratio_NC``: vLLM's per-token importance ratios, whose clipped logs add to ``log w`` (every column, as TRL)."""
    m = np.asarray(mask_NC, np.float64)
    seq = (np.clip(log_ratio_NC, -20.0, 20.0) * m).sum(-1, keepdims=True)
    if is_ratio_NC is not None:
        with np.errstate(divide="ignore"):
            seq = seq + np.clip(np.log(np.asarray(is_ratio_NC, np.float64)), VESPO_LOG_W_MIN, 20.0).sum(
                -1, keepdims=True
            )
    log_w = np.clip(seq, VESPO_LOG_W_MIN, 20.0)
    nonneg = np.asarray(advantages_N, np.float64)[:, None] >= 0
    k = np.where(nonneg, spec.vespo_k_pos, spec.vespo_k_neg)
    lam = np.maximum(np.where(nonneg, spec.vespo_lambda_pos, spec.vespo_lambda_neg), 1e-4)
    with np.errstate(over="ignore", invalid="ignore"):
        phi = np.exp(lam + k * log_w - lam * np.exp(log_w))
    return np.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def bonus_mask_np(mask_NC, entropy_NC, spec: LossSpec) -> np.ndarray:
    """The tokens the entropy bonus acts on: the completion tokens, or the high-entropy ones that keep their policy
    loss when ``top_entropy_quantile < 1`` (TRL's ``effective_mask``)."""
    m = np.asarray(mask_NC, np.float64)
    return m * high_entropy_mask_np(entropy_NC, m, spec.top_entropy_quantile) if spec.top_entropy_quantile < 1 else m


def entropy_bonus_np(entropy_NC, mask_NC, spec: LossSpec, entropy_coef: float, num_micro_batches: int = 1):
    """(the bonus's share of the step loss, the bonus tokens' entropy sum, their count): ``-entropy_coef`` times the
    micro-batch's mean entropy over its bonus tokens (``bonus_mask_np``), divided by the step's micro-batches only
    (TRL's: the same meaning for every loss type)."""
    if entropy_NC is None:
        raise ConfigError(
            f"entropy_coef={entropy_coef} adds an entropy bonus and needs entropy_NC: pass the completion tokens' "
            f"entropies, or set entropy_coef=0."
        )
    keep = bonus_mask_np(mask_NC, entropy_NC, spec)
    total, count = float((np.asarray(entropy_NC, np.float64) * keep).sum()), float(keep.sum())
    return -entropy_coef * total / max(count, 1.0) / num_micro_batches, total, count


def high_entropy_mask_np(entropy_NC, mask_NC, quantile: float) -> np.ndarray:
    """1 on the completion tokens whose entropy is at or above the ``1 - quantile`` quantile (linear interpolation)
    of the micro-batch's completion-token entropies (TRL's ``get_high_entropy_mask``)."""
    m = np.asarray(mask_NC) > 0
    e = np.asarray(entropy_NC, np.float64)
    if not m.any():
        return np.zeros_like(e)
    return ((e * m >= np.quantile(e[m], 1.0 - quantile)) & m).astype(np.float64)


def per_token_loss_np(
    logps_NC, old_logps_NC, advantages_N, mask_NC, spec: LossSpec, ref_logps_NC=None, entropy_NC=None, is_ratio_NC=None
):
    """(per-token loss [N, C] or [N, 1], ratio ρ [N, C] or [N, 1] as the metrics read it, KL term [N, C] or None),
    float64, of ``spec``'s surrogate (see the module docstring). ``is_ratio_NC``: vLLM's importance ratios
    (``vllm_importance_ratio``), which weigh the policy loss (VESPO: its gamma weight), not the KL term."""
    logps = np.asarray(logps_NC, np.float64)
    old = logps if old_logps_NC is None else np.asarray(old_logps_NC, np.float64)
    adv = np.asarray(advantages_N, np.float64)[:, None]
    level = "sum" if spec.loss_type == "rloo" else spec.importance_sampling_level
    ratio = np.exp(log_importance_weights_np(logps, old, mask_NC, level))
    kl = None
    if spec.beta > 0:
        if ref_logps_NC is None:
            raise ConfigError(
                f"grpo_beta={spec.beta} > 0 needs the reference model's log-probs: pass ref_logps_NC, or set "
                f"grpo_beta=0."
            )
        delta = np.asarray(ref_logps_NC, np.float64) - logps
        kl = np.exp(delta) - delta - 1
        if spec.use_bias_correction_kl:
            kl = kl * ratio
    if spec.loss_type == "cispo":
        loss = -np.minimum(ratio, spec.eps_high) * adv * logps  # the capped ratio is a constant (TRL detaches it)
    elif spec.loss_type == "sapo":
        tau = np.where(adv > 0, spec.sapo_temperature_pos, spec.sapo_temperature_neg)
        loss = -(4 / tau) / (1 + np.exp(-tau * (ratio - 1))) * adv
    elif spec.loss_type == "vespo":
        loss = -vespo_weights_np(logps - old, advantages_N, mask_NC, spec, is_ratio_NC) * adv * logps
    else:
        clipped = np.clip(ratio, 1 - spec.epsilon, 1 + spec.eps_high)
        if spec.delta is not None:
            ratio = np.minimum(ratio, spec.delta)
        loss = -np.minimum(ratio * adv, clipped * adv)
    if spec.off_policy_mask_threshold is not None:
        loss = loss * off_policy_keep_np(logps, old, adv, mask_NC, spec.off_policy_mask_threshold)
    if spec.top_entropy_quantile < 1.0:
        if entropy_NC is None:
            raise ConfigError(
                f"top_entropy_quantile={spec.top_entropy_quantile} masks tokens by entropy and needs entropy_NC: "
                f"pass the completion tokens' entropies, or set top_entropy_quantile=1.0."
            )
        loss = loss * high_entropy_mask_np(entropy_NC, mask_NC, spec.top_entropy_quantile)
    if is_ratio_NC is not None and spec.loss_type != "vespo":
        loss = loss * np.asarray(is_ratio_NC, np.float64)
    if kl is not None:
        loss = loss + spec.beta * kl
    return loss, ratio, kl


def off_policy_keep_np(logps_NC, sampling_logps_NC, adv_N1, mask_NC, threshold: float) -> np.ndarray:
    """1 where a completion keeps its policy loss, per completion [N, 1]: a non-negative advantage, or a mean token
    ``log π_sampling - log π`` at most ``threshold`` (TRL's ``get_off_policy_mask``)."""
    m = np.asarray(mask_NC, np.float64)
    kl = np.nan_to_num(np.asarray(sampling_logps_NC, np.float64) - np.asarray(logps_NC, np.float64), nan=0.0)
    mean_kl = (kl * m).sum(-1, keepdims=True) / np.maximum(m.sum(-1, keepdims=True), 1.0)
    return ((adv_N1 >= 0) | (mean_kl <= threshold)).astype(np.float64)


def reduce_loss_np(loss_NC: np.ndarray, mask_NC: np.ndarray, norm: LossNorm) -> float:
    """One micro-batch's share of the step loss, by ``norm.loss_type`` (see the module docstring)."""
    m = np.asarray(mask_NC, np.float64)
    summed = loss_NC * m
    n = m.shape[0]
    if norm.loss_type in ("grpo", "sapo"):
        per_seq = summed.sum(-1) / np.maximum(m.sum(-1), 1.0)
        return float(per_seq.sum() / (norm.num_sequences_in_step or n))
    if norm.loss_type == "luspo":
        return float(summed.sum() / (norm.num_sequences_in_step or n))
    if norm.loss_type == "rloo":  # one loss per completion, masked or not (TRL's mean over completions)
        return float(np.asarray(loss_NC)[:, 0].sum() / (norm.num_sequences_in_step or n))
    if norm.loss_type == "bnpo":
        return float(summed.sum() / max(m.sum(), 1.0) / norm.num_micro_batches)
    if norm.loss_type == "dr_grpo":
        if norm.max_completion_length is None:
            raise ConfigError(
                "grpo_loss_type='dr_grpo' needs max_completion_length (got None); set --max-completion-length."
            )
        return float(summed.sum() / ((norm.num_sequences_in_step or n) * norm.max_completion_length))
    if norm.loss_type in ("dapo", "cispo", "vespo"):
        return float(summed.sum() / max(norm.num_tokens_in_step or m.sum(), 1.0))
    raise ConfigError(f"grpo_loss_type={norm.loss_type!r} is not valid; choose one of {GRPO_LOSS_TYPES}.")


def clip_metrics_np(ratio_NC, advantages_N, mask_NC, spec: LossSpec) -> dict[str, float]:
    """The clip metrics TRL logs: for the min-clip types the fractions clipped low (ρ < 1-ε with A < 0), high
    (ρ > 1+ε_high with A > 0) and either; for ``cispo`` where the ratio cap binds; none for ``sapo``. Token
    fractions, or completion fractions for a per-completion ratio. ``vespo`` logs its mean weight, which
    ``grpo_loss`` adds."""
    adv = np.asarray(advantages_N, np.float64)[:, None]
    m = np.asarray(mask_NC, bool) if ratio_NC.shape[1] > 1 else np.ones_like(ratio_NC, bool)
    count = max(int(m.sum()), 1)
    if spec.loss_type == "cispo":
        return {"cispo_clip_ratio": float(((ratio_NC > spec.eps_high) & (adv > 0) & m).sum() / count)}
    if spec.loss_type not in CLIP_LOSS_TYPES:
        return {}
    low = (ratio_NC < 1 - spec.epsilon) & (adv < 0)
    high = (ratio_NC > 1 + spec.eps_high) & (adv > 0)
    return {
        "clip_ratio/low_mean": float((low & m).sum() / count),
        "clip_ratio/high_mean": float((high & m).sum() / count),
        "clip_ratio/region_mean": float(((low | high) & m).sum() / count),
    }


def grpo_loss(
    logps_NC: np.ndarray,
    advantages_N: np.ndarray,
    mask_NC: np.ndarray,
    *,
    old_logps_NC: Optional[np.ndarray] = None,
    ref_logps_NC: Optional[np.ndarray] = None,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    importance_sampling_level: str = "token",
    delta: Optional[float] = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    off_policy_mask_threshold: Optional[float] = None,
    top_entropy_quantile: float = 1.0,
    entropy_NC: Optional[np.ndarray] = None,
    max_completion_length: Optional[int] = None,
    num_sequences_in_step: Optional[int] = None,
    num_tokens_in_step: Optional[int] = None,
    num_micro_batches: int = 1,
    is_ratio_NC: Optional[np.ndarray] = None,
    entropy_coef: float = 0.0,
) -> GRPOLossOutput:
    """The GRPO loss of completions ``[N, C]`` (padded right, ``mask_NC`` 1 on completion tokens).

    ``logps_NC``: the policy's log-prob of each completion token; ``old_logps_NC``: the sampling
    policy's (None: the policy's own, ratio 1); ``ref_logps_NC``: the reference's (needed when
    ``beta > 0``). The ``num_*_in_step`` arguments make the result one micro-batch's share of a
    larger step; left None, the micro-batch is the whole step. ``is_ratio_NC``: vLLM's importance ratios
    ([N, C] or [N, 1], ``vllm_importance_ratio``; None: no correction). ``entropy_coef``: the entropy bonus's
    coefficient this step (``entropy_bonus_np``; it reads ``entropy_NC``).

    >>> out = grpo_loss(np.zeros((2, 1)), np.array([1.0, -1.0]), np.ones((2, 1)), loss_type="grpo")
    >>> out.loss, out.metrics["clip_ratio/region_mean"]
    (0.0, 0.0)
    """
    spec = LossSpec(
        loss_type,
        epsilon,
        epsilon_high,
        beta,
        max_completion_length,
        use_bias_correction_kl,
        importance_sampling_level,
        delta,
        sapo_temperature_pos,
        sapo_temperature_neg,
        vespo_k_pos,
        vespo_lambda_pos,
        vespo_k_neg,
        vespo_lambda_neg,
        off_policy_mask_threshold,
        top_entropy_quantile,
        entropy_coef != 0.0,
    )
    mask = np.asarray(mask_NC, np.float64)
    loss_NC, ratio_NC, kl_NC = per_token_loss_np(
        logps_NC, old_logps_NC, advantages_N, mask, spec, ref_logps_NC, entropy_NC, is_ratio_NC
    )
    norm = LossNorm(loss_type, num_sequences_in_step, num_tokens_in_step, num_micro_batches, max_completion_length)
    metrics = clip_metrics_np(ratio_NC, advantages_N, mask, spec)
    if loss_type == "vespo":
        logps = np.asarray(logps_NC, np.float64)
        old = logps if old_logps_NC is None else np.asarray(old_logps_NC, np.float64)
        phi = vespo_weights_np(logps - old, advantages_N, mask, spec, is_ratio_NC)
        metrics["vespo/phi_seq_mean"] = float(phi.mean())
    if kl_NC is not None:
        metrics["kl"] = float((kl_NC * mask).sum() / max(mask.sum(), 1.0))
    loss = reduce_loss_np(loss_NC, mask, norm)
    if spec.entropy_bonus:
        bonus, total, count = entropy_bonus_np(entropy_NC, mask, spec, entropy_coef, num_micro_batches)
        metrics["policy_loss"] = loss
        loss += bonus
    return GRPOLossOutput(loss, metrics)


# ---------------------------------------------------------------------------------------
# Adaptive entropy control (TRL 1.16's ``use_adaptive_entropy``)
# ---------------------------------------------------------------------------------------


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient over a run: constant, or adaptive (Skywork-OR1, as TRL 1.16).

    ``applied()`` is the coefficient a step uses: ``coef``; adaptive, ``coef`` only when the previous step's entropy
    was at or below ``target`` (0 on the first step, whose previous entropy is +inf). ``update(total, count)``
    ends a step with its bonus tokens' entropy sum and count over every rank: the coefficient moves by ``delta``
    towards more bonus when the step's mean entropy is at or below ``target``, towards less otherwise, clamped to
    ``[low, high]``. A resume restores ``state_dict()``.

    >>> c = EntropyControl(0.5, adaptive=True, low=0.0, high=1.0, delta=0.25, target=0.2)
    >>> c.applied(); c.update(1.0, 10.0); c.applied(), c.coef
    0.0
    (0.75, 0.75)
    """

    coef: float
    adaptive: bool = False
    low: float = 0.0
    high: float = 1.0
    delta: float = 0.005
    target: float = 0.2
    last_entropy: float = math.inf

    @classmethod
    def of(cls, grpo: GRPOConfig) -> "EntropyControl":
        return cls(
            grpo.entropy_coef,
            grpo.use_adaptive_entropy,
            grpo.entropy_coef_min,
            grpo.entropy_coef_max,
            grpo.entropy_coef_delta,
            grpo.entropy_target,
        )

    def applied(self) -> float:
        if self.adaptive:
            return self.coef if self.last_entropy <= self.target else 0.0
        return self.coef

    def update(self, entropy_total: float, token_count: float) -> None:
        if not self.adaptive:
            return
        entropy = entropy_total / max(token_count, 1.0)
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_entropy"])


# ---------------------------------------------------------------------------------------
# vLLM's importance-sampling correction (TRL 1.16's ``vllm_importance_sampling_*``)
# ---------------------------------------------------------------------------------------

VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def vllm_importance_ratio(
    old_logps_NC: np.ndarray,
    sampling_logps_NC: np.ndarray,
    mask_NC: np.ndarray,
    *,
    mode: str = "sequence_mask",
    clip_min: Optional[float] = None,
    clip_max: Optional[float] = 3.0,
) -> np.ndarray:
    """The ratio ``π_old / π_vLLM`` that weighs each token's loss when vLLM sampled the completions, float64: per
    token [N, C] (``token_*``) or per completion [N, 1] (``sequence_*``: the exponential of the summed log-ratio).
    A token vLLM did not score (NaN) counts a log-ratio of 0. ``*_truncate`` clips the ratio to ``[clip_min,
    clip_max]``; ``*_mask`` sets it to 0 outside them (None: no bound on that side).

    >>> vllm_importance_ratio(np.log([[0.5, 0.5]]), np.log([[0.25, 0.5]]), np.ones((1, 2)), mode="token_truncate",
    ...                       clip_max=1.5).tolist()
    [[1.5, 1.0]]
    """
    if mode not in VLLM_IS_MODES:
        raise ConfigError(f"vllm_importance_sampling_mode={mode!r} is not valid; choose one of {list(VLLM_IS_MODES)}.")
    diff = (np.asarray(old_logps_NC, np.float64) - np.asarray(sampling_logps_NC, np.float64)) * np.asarray(mask_NC)
    diff = np.nan_to_num(diff, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    with np.errstate(over="ignore"):
        ratio = np.exp(diff)
    lo = -np.inf if clip_min is None else clip_min
    hi = np.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return np.clip(ratio, lo, hi)
    return np.where((ratio < lo) | (ratio > hi), 0.0, ratio)


def vllm_importance_metrics(
    old_logps_NC: np.ndarray, sampling_logps_NC: np.ndarray, mask_NC: np.ndarray, ratio: np.ndarray
) -> dict[str, float]:
    """TRL's ``sampling/*`` metrics: the mean and max |log π_old - log π_vLLM| over the scored tokens (NaN ones left
    out), and the min, mean and max of the ratio (over completions, or over scored tokens for a per-token ratio)."""
    m = np.asarray(mask_NC) > 0
    delta = np.abs(np.asarray(old_logps_NC, np.float64) - np.asarray(sampling_logps_NC, np.float64))[m]
    delta = delta[~np.isnan(delta)]
    flat = ratio.reshape(-1) if ratio.shape[1] == 1 else ratio[m]
    pick = lambda f, a: float(f(a)) if a.size else 0.0  # noqa: E731
    return {
        "sampling/sampling_logp_difference/mean": pick(np.mean, delta),
        "sampling/sampling_logp_difference/max": pick(np.max, delta),
        "sampling/importance_sampling_ratio/min": pick(np.min, flat),
        "sampling/importance_sampling_ratio/mean": pick(np.mean, flat),
        "sampling/importance_sampling_ratio/max": pick(np.max, flat),
    }


def vllm_importance_ratios(
    old_logps_NC: np.ndarray, mask_NC: np.ndarray, sampling_logps: Sequence[Sequence[float]], grpo: Any
) -> tuple[np.ndarray, dict[str, float]]:
    """One generation's ratios (``vllm_importance_ratio`` with ``grpo``'s mode and bounds) and metrics, from the
    sampling policy's log-probs [N, C], the mask, and the engine's log-probs of each row (its completion's length;
    a shorter row is NaN past its end)."""
    rows, width = np.shape(old_logps_NC)
    engine = np.full((rows, width), np.nan)
    for i, row in enumerate(sampling_logps):
        n = min(len(row), width)
        engine[i, :n] = row[:n]
    ratio = vllm_importance_ratio(
        old_logps_NC,
        engine,
        mask_NC,
        mode=grpo.vllm_importance_sampling_mode,
        clip_min=grpo.vllm_importance_sampling_clip_min,
        clip_max=grpo.vllm_importance_sampling_clip_max,
    )
    return ratio, vllm_importance_metrics(old_logps_NC, engine, mask_NC, ratio)
