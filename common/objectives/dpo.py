"""DPO loss family: the numpy reference both backends are tested against.

Names and parameters follow TRL 1.16 (``DPOConfig.loss_type``, ``loss_weights``, ``beta``,
``label_smoothing``). Inputs are per-example sequence log-probs (sums of the completion's
target log-probs, see ``twinseq.common.data.preference_batching``); outputs are per-example losses.

Notation used in the docstrings below, per example:

- ``c = policy_chosen_logps - ref_chosen_logps``     (chosen log-ratio)
- ``r = policy_rejected_logps - ref_rejected_logps`` (rejected log-ratio)
- ``Δ = c - r``, ``x = β Δ``, ``ε = label_smoothing``, ``σ`` the logistic function,
  ``log σ(z) = -log(1 + e^-z)`` computed as ``-logaddexp(0, -z)`` so that it stays exact
  and finite for any finite ``z`` (``log(sigmoid(z))`` gives -inf for z < -745).

TRL's reduction is ``loss = Σ_k w_k · mean_n L_k[n]``; ``dpo_loss`` returns the per-example
``Σ_k w_k L_k[n]`` whose mean is exactly that. The rewards are ``β c`` and ``β r`` whatever
the loss type, as in TRL's metrics.

Everything is computed in float64 so that it can serve as the reference for float32 tests.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from twinseq.common.errors import ConfigError, ConfigTypeError
from twinseq.common.tasks import TaskSpec, register_task

logger = logging.getLogger(__name__)

DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "aot",
    "aot_unpaired",
    "discopop",
    "sft",
    "sigmoid_norm",
)
# TRL 1.16's loss types that twinseq does not implement (it says so rather than "unknown"): none left.
TRL_LOSS_TYPES_NOT_IMPLEMENTED: tuple[str, ...] = ()
TOKEN_COUNT_LOSS_TYPES = ("ipo", "sigmoid_norm", "sft")
"""Loss types that read the completions' token counts (length normalisation, the SFT token mean)."""
POLICY_LOGPS_LOSS_TYPES = ("aot", "sft")
"""Loss types that read the policy's sequence log-probs themselves, not only the log-ratios."""
# Loss types that read label_smoothing; the others ignore it (TRL 1.16 dropped cDPO's smoothing of
# 'sigmoid').
LABEL_SMOOTHING_LOSS_TYPES = ("robust", "exo_pair", "aot", "aot_unpaired")
# ε is the probability that a preference label is flipped: above 1/2 the pair should be swapped.
LABEL_SMOOTHING_MAX = 0.5


@dataclass(frozen=True)
class DPOLossConfig:
    """A validated DPO loss configuration (see ``validate_dpo_config``)."""

    loss_type: tuple[str, ...]
    loss_weights: tuple[float, ...]
    beta: float
    label_smoothing: float
    discopop_tau: float = 0.05


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigTypeError(f"{name}={value!r} must be a real number, got {type(value).__name__}; pass a number.")
    if not math.isfinite(float(value)):
        raise ConfigError(f"{name}={value!r} must be finite; pass a finite number.")
    return float(value)


def _check_loss_types(loss_type: Union[str, Sequence[str]]) -> tuple[str, ...]:
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not types:
        raise ConfigError(
            f"loss_type={loss_type!r} is empty; give one of {', '.join(DPO_LOSS_TYPES)} or a list "
            f"of them (combined with loss_weights)."
        )
    for t in types:
        if not isinstance(t, str):
            raise ConfigTypeError(
                f"loss_type entries must be strings, got {t!r} ({type(t).__name__}) in {loss_type!r}; pass names "
                f"such as 'sigmoid'."
            )
        if t in TRL_LOSS_TYPES_NOT_IMPLEMENTED:
            raise ConfigError(
                f"loss_type={t!r} is a TRL loss type that twinseq does not implement; choose one of "
                f"{', '.join(DPO_LOSS_TYPES)}."
            )
        if t not in DPO_LOSS_TYPES:
            raise ConfigError(f"loss_type={t!r} is not a DPO loss type; choose one of {', '.join(DPO_LOSS_TYPES)}.")
    return types


def _check_loss_weights(loss_weights: Optional[Sequence[float]], types: tuple[str, ...]) -> tuple[float, ...]:
    if loss_weights is None:
        return (1.0,) * len(types)
    if isinstance(loss_weights, (str, bytes)) or not hasattr(loss_weights, "__len__"):
        raise ConfigTypeError(
            f"loss_weights={loss_weights!r} is not valid; pass a list of numbers, one per loss_type, or None."
        )
    if len(loss_weights) != len(types):
        raise ConfigError(
            f"loss_weights={list(loss_weights)!r} has {len(loss_weights)} entries but loss_type="
            f"{list(types)!r} has {len(types)}; give one weight per loss type, or None for all 1.0."
        )
    return tuple(_check_real(f"loss_weights[{i}]", w) for i, w in enumerate(loss_weights))


def _check_label_smoothing(eps: float, types: tuple[str, ...]) -> None:
    if not 0.0 <= eps <= LABEL_SMOOTHING_MAX:
        raise ConfigError(
            f"label_smoothing={eps!r} is not valid; it is the probability that a preference label is "
            f"flipped and must lie in [0, {LABEL_SMOOTHING_MAX}] (above that, swap chosen and rejected)."
        )
    if "robust" in types and eps >= LABEL_SMOOTHING_MAX:
        # TRL 1.16 only warns; the robust loss divides by 1 - 2ε and is undefined at ε = 1/2.
        raise ConfigError(
            f"label_smoothing={eps!r} is not valid with loss_type 'robust', which divides by "
            f"1 - 2*label_smoothing; use a value in [0, 0.5), e.g. 0.1 (Robust DPO paper)."
        )
    if "exo_pair" in types and eps == 0.0:
        raise ConfigError(
            "label_smoothing=0.0 is not valid with loss_type 'exo_pair': EXO takes log(label_smoothing); "
            "use a value in (0, 0.5], e.g. 1e-3 (EXO paper)."
        )
    if eps > 0.0 and not set(types) & set(LABEL_SMOOTHING_LOSS_TYPES):
        logger.warning(
            "label_smoothing=%s has no effect on loss_type %s; only %s read it (TRL 1.16 semantics).",
            eps,
            list(types),
            list(LABEL_SMOOTHING_LOSS_TYPES),
        )


def validate_dpo_config(
    loss_type: Union[str, Sequence[str]] = "sigmoid",
    loss_weights: Optional[Sequence[float]] = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
) -> DPOLossConfig:
    """Check a DPO loss configuration against TRL's rules (and a few stricter ones).

    ``loss_type`` is a name or a list of names from ``DPO_LOSS_TYPES``; ``loss_weights`` is
    None (all 1.0) or one weight per loss type. ``beta`` must be > 0. ``label_smoothing`` must
    lie in [0, 0.5]; 'robust' needs it < 0.5 and 'exo_pair' needs it > 0. Raises ValueError
    (or TypeError for a wrong type) naming the field, the value and the fix.

    >>> validate_dpo_config(["sigmoid", "bco_pair"], [0.8, 0.2], beta=0.1)  # doctest: +NORMALIZE_WHITESPACE
    DPOLossConfig(loss_type=('sigmoid', 'bco_pair'), loss_weights=(0.8, 0.2), beta=0.1, label_smoothing=0.0,
                  discopop_tau=0.05)
    """
    types = _check_loss_types(loss_type)
    weights = _check_loss_weights(loss_weights, types)
    beta = _check_real("beta", beta)
    if beta <= 0.0:
        raise ConfigError(
            f"beta={beta!r} is not valid; it must be > 0: pass e.g. 0.1 (TRL's default; for 'ipo' it is τ)."
        )
    eps = _check_real("label_smoothing", label_smoothing)
    _check_label_smoothing(eps, types)
    tau = _check_real("discopop_tau", discopop_tau)
    if tau <= 0.0:
        raise ConfigError(f"discopop_tau={tau!r} is not valid; it must be > 0: pass e.g. 0.05 (TRL's default).")
    return DPOLossConfig(loss_type=types, loss_weights=weights, beta=beta, label_smoothing=eps, discopop_tau=tau)


def check_liger_dpo_config(loss_type: Sequence[str], *, padding_free: bool, precompute: bool) -> None:
    """Liger's fused DPO loss computes exactly twinseq's only for padded, live-reference 'sigmoid'."""
    if tuple(loss_type) != ("sigmoid",):
        raise ConfigError(
            f"loss_type='liger' computes the 'sigmoid' DPO loss only; dpo_loss_type="
            f"{list(loss_type)} needs --loss-type fused_linear: use it, or drop --dpo-loss-type."
        )
    if padding_free:
        raise ConfigError(
            "loss_type='liger' needs padded batches (chosen and rejected stacked as rows); drop "
            "--padding-free or use --loss-type fused_linear."
        )
    if precompute:
        raise ConfigError(
            "precompute_ref_log_probs=True is not supported with loss_type='liger': twinseq's Liger "
            "path feeds the reference hidden states to the kernel. Drop --precompute-ref-log-probs "
            "or use --loss-type fused_linear."
        )


# ---------------------------------------------------------------------------------------
# Stable building blocks
# ---------------------------------------------------------------------------------------


def log_sigmoid(z: np.ndarray) -> np.ndarray:
    """``log σ(z) = -log(1 + e^-z)``, exact and finite for every finite z (float64)."""
    return -np.logaddexp(0.0, -np.asarray(z, dtype=np.float64))


def sigmoid(z: np.ndarray) -> np.ndarray:
    """``σ(z)`` without overflow for large |z| (float64)."""
    return np.exp(log_sigmoid(z))


# ---------------------------------------------------------------------------------------
# The loss family, written once over an array namespace. Each loss takes the per-example
# log-ratios and returns [N] in the framework of its inputs.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayOps:
    """The four array functions the loss family needs, from one framework.

    numpy (``NUMPY_OPS``, float64, the reference), torch and jax each supply theirs, so the
    formulas below are the only copy of the DPO losses in the project.
    """

    log_sigmoid: Callable
    exp: Callable
    relu: Callable
    zeros_like: Callable
    sort: Callable
    """Ascending values along the pairs (axis 0), differentiable as a permutation."""


NUMPY_OPS = ArrayOps(
    log_sigmoid=log_sigmoid,
    exp=np.exp,
    relu=lambda z: np.maximum(0.0, z),
    zeros_like=np.zeros_like,
    sort=lambda z: np.sort(z, axis=0),
)


@dataclass(frozen=True)
class _Pair:
    c: Any  # chosen log-ratio [N]
    r: Any  # rejected log-ratio [N]
    beta: float
    eps: float  # label_smoothing
    ops: ArrayOps
    n_c: Any = None  # chosen completion token counts [N] (TOKEN_COUNT_LOSS_TYPES)
    n_r: Any = None
    pc: Any = None  # the policy's chosen sequence log-probs [N] (POLICY_LOGPS_LOSS_TYPES)
    pr: Any = None
    tau: float = 0.05  # discopop


def _loss_sigmoid(p: _Pair):
    """``-log σ(x)`` (DPO)."""
    return -p.ops.log_sigmoid(p.beta * (p.c - p.r))


def _loss_hinge(p: _Pair):
    """``max(0, 1 - x)`` (SLiC)."""
    return p.ops.relu(1.0 - p.beta * (p.c - p.r))


def _loss_ipo(p: _Pair):
    """``(c/n_c - r/n_r - 1/(2β))²``: TRL normalises the log-ratios by completion length."""
    return (p.c / p.n_c - p.r / p.n_r - 0.5 / p.beta) ** 2


def _loss_exo_pair(p: _Pair):
    """``KL(q ‖ (1-ε, ε))`` with ``q = (σ(x), σ(-x))`` (EXO-pref, K = 2)."""
    x = p.beta * (p.c - p.r)
    log_qw, log_ql = p.ops.log_sigmoid(x), p.ops.log_sigmoid(-x)
    # exp(log_q) underflows to exactly 0 where log_q is huge and negative, so 0 * finite stays 0.
    return p.ops.exp(log_qw) * (log_qw - math.log1p(-p.eps)) + p.ops.exp(log_ql) * (log_ql - math.log(p.eps))


def _loss_nca_pair(p: _Pair):
    """``-log σ(βc) - ½ log σ(-βc) - ½ log σ(-βr)`` (NCA)."""
    bc, br = p.beta * p.c, p.beta * p.r
    return -p.ops.log_sigmoid(bc) - 0.5 * p.ops.log_sigmoid(-bc) - 0.5 * p.ops.log_sigmoid(-br)


def _loss_robust(p: _Pair):
    """``(-(1-ε) log σ(x) + ε log σ(-x)) / (1 - 2ε)`` (Robust DPO; unbounded below if ε > 0)."""
    x = p.beta * (p.c - p.r)
    return (-(1.0 - p.eps) * p.ops.log_sigmoid(x) + p.eps * p.ops.log_sigmoid(-x)) / (1.0 - 2.0 * p.eps)


def _loss_bco_pair(p: _Pair):
    """``-log σ(βc) - log σ(-βr)``."""
    return -p.ops.log_sigmoid(p.beta * p.c) - p.ops.log_sigmoid(-p.beta * p.r)


def _loss_sppo_hard(p: _Pair):
    """``(c - 1/(2β))² + (r + 1/(2β))²`` (SPPO with hard win probabilities 1 and 0)."""
    half = 0.5 / p.beta
    return (p.c - half) ** 2 + (p.r + half) ** 2


def _sigmoid(p: _Pair, z):
    return p.ops.exp(p.ops.log_sigmoid(z))


def _loss_apo_zero(p: _Pair):
    """``1 - σ(βc) + σ(βr)`` (APO-zero), with ``1 - σ(z)`` written ``σ(-z)`` to keep precision."""
    return _sigmoid(p, -p.beta * p.c) + _sigmoid(p, p.beta * p.r)


def _loss_apo_down(p: _Pair):
    """``σ(βc) + 1 - σ(β(c - r))`` (APO-down)."""
    return _sigmoid(p, p.beta * p.c) + _sigmoid(p, -p.beta * (p.c - p.r))


def _smoothed_logistic(p: _Pair, delta):
    """``-(1-ε) log σ(βδ) - ε log σ(-βδ)``: AOT's loss of a sorted margin."""
    return -p.ops.log_sigmoid(p.beta * delta) * (1.0 - p.eps) - p.ops.log_sigmoid(-p.beta * delta) * p.eps


def _loss_aot(p: _Pair):
    """AOT (paired): the sorted policy margins ``pc - pr`` against the sorted reference margins, over the
    micro-batch's pairs, through the smoothed logistic loss."""
    policy = p.pc - p.pr
    return _smoothed_logistic(p, p.ops.sort(policy) - p.ops.sort(policy - (p.c - p.r)))


def _loss_aot_unpaired(p: _Pair):
    """AOT (unpaired): the sorted chosen log-ratios against the sorted rejected ones."""
    return _smoothed_logistic(p, p.ops.sort(p.c) - p.ops.sort(p.r))


def _loss_discopop(p: _Pair):
    """DiscoPOP: ``-log σ(x)`` and ``e^-x`` mixed by ``σ(x/τ)``, ``x = β(c - r)``."""
    x = p.beta * (p.c - p.r)
    # e^-x σ(x/τ) as one exponential: finite where e^-x alone overflows (TRL's product is inf * 0 = NaN there)
    return -p.ops.log_sigmoid(x) * _sigmoid(p, -x / p.tau) + p.ops.exp(-x + p.ops.log_sigmoid(x / p.tau))


def _loss_sft(p: _Pair):
    """The chosen completions' NLL, a token mean over the micro-batch, the same for every pair (TRL's RPO-style
    term, used in a weighted list)."""
    return p.ops.zeros_like(p.c) - p.pc.sum() / p.n_c.sum()


def _loss_sigmoid_norm(p: _Pair):
    """``-log σ(β (c/n_c - r/n_r)))``: DPO on length-normalised log-ratios."""
    return -p.ops.log_sigmoid(p.beta * (p.c / p.n_c - p.r / p.n_r))


_LOSSES: dict[str, Callable[[_Pair], Any]] = {
    "sigmoid": _loss_sigmoid,
    "hinge": _loss_hinge,
    "ipo": _loss_ipo,
    "exo_pair": _loss_exo_pair,
    "nca_pair": _loss_nca_pair,
    "robust": _loss_robust,
    "bco_pair": _loss_bco_pair,
    "sppo_hard": _loss_sppo_hard,
    "apo_zero": _loss_apo_zero,
    "apo_down": _loss_apo_down,
    "aot": _loss_aot,
    "aot_unpaired": _loss_aot_unpaired,
    "discopop": _loss_discopop,
    "sft": _loss_sft,
    "sigmoid_norm": _loss_sigmoid_norm,
}
assert set(_LOSSES) == set(DPO_LOSS_TYPES)


class DPOFamilyOutput(NamedTuple):
    losses: Any  # [N]: Σ_k w_k L_k
    chosen_rewards: Any  # [N]: β c
    rejected_rewards: Any  # [N]: β r
    losses_by_type: dict  # unweighted L_k [N]


def dpo_family(
    chosen_logratios,
    rejected_logratios,
    config: DPOLossConfig,
    ops: ArrayOps,
    *,
    chosen_num_tokens=None,
    rejected_num_tokens=None,
    policy_chosen_logps=None,
    policy_rejected_logps=None,
) -> DPOFamilyOutput:
    """Per-pair DPO losses and rewards from the log-ratios ``c`` and ``r`` [N], in ``ops``' framework.

    ``config`` comes from ``validate_dpo_config``; the ``TOKEN_COUNT_LOSS_TYPES`` need the completion token counts,
    the ``POLICY_LOGPS_LOSS_TYPES`` the policy's sequence log-probs. ``aot``, ``aot_unpaired`` and ``sft`` read the
    whole micro-batch (sorted margins, a token mean), as TRL computes them per micro-batch.
    """
    counted = [t for t in config.loss_type if t in TOKEN_COUNT_LOSS_TYPES]
    if counted and (chosen_num_tokens is None or rejected_num_tokens is None):
        raise ConfigError(
            f"loss_type={list(config.loss_type)!r} includes {counted[0]!r}, which reads completion lengths and needs "
            "chosen_num_tokens and rejected_num_tokens: pass PreferenceBatch.chosen_num_tokens / rejected_num_tokens."
        )
    reading = [t for t in config.loss_type if t in POLICY_LOGPS_LOSS_TYPES]
    if reading and (policy_chosen_logps is None or policy_rejected_logps is None):
        raise ConfigError(
            f"loss_type={list(config.loss_type)!r} includes {reading[0]!r}, which reads the policy's sequence "
            "log-probs: pass policy_chosen_logps and policy_rejected_logps."
        )
    pair = _Pair(
        c=chosen_logratios,
        r=rejected_logratios,
        beta=config.beta,
        eps=config.label_smoothing,
        ops=ops,
        n_c=chosen_num_tokens,
        n_r=rejected_num_tokens,
        pc=policy_chosen_logps,
        pr=policy_rejected_logps,
        tau=config.discopop_tau,
    )
    by_type = {t: _LOSSES[t](pair) for t in dict.fromkeys(config.loss_type)}
    losses = ops.zeros_like(pair.c)
    for t, w in zip(config.loss_type, config.loss_weights):
        losses = losses + w * by_type[t]
    return DPOFamilyOutput(losses, config.beta * pair.c, config.beta * pair.r, by_type)


@dataclass
class DPOLossOutput:
    """Per-example outputs of ``dpo_loss``; ``loss`` is TRL's scalar."""

    losses: np.ndarray  # float64 [N]: Σ_k w_k L_k
    chosen_rewards: np.ndarray  # float64 [N]: β c
    rejected_rewards: np.ndarray  # float64 [N]: β r
    losses_by_type: dict[str, np.ndarray] = field(default_factory=dict)  # unweighted L_k [N]

    @property
    def loss(self) -> float:
        return float(self.losses.mean())


def _as_logps(name: str, value: np.ndarray) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError(
            f"{name} must be a non-empty 1-D array [N] of sequence log-probs, got shape {arr.shape}; pass one "
            "log-prob per pair."
        )
    if not np.isfinite(arr).all():
        raise ConfigError(
            f"{name} holds non-finite values (e.g. {arr[~np.isfinite(arr)][:3].tolist()}); a "
            f"sequence log-prob must be finite: check the model output and the target mask."
        )
    return arr


def _as_counts(name: str, value: Optional[np.ndarray], n: int) -> np.ndarray:
    if value is None:
        raise ConfigError(
            f"loss types {TOKEN_COUNT_LOSS_TYPES} read completion lengths (TRL 1.16) and need "
            f"{name}, but {name}=None; pass PreferenceBatch.{name} from twinseq.common.data.preference_batching."
        )
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape != (n,) or (arr < 1).any():
        raise ConfigError(
            f"{name} must be [N={n}] counts >= 1 of scored completion tokens, got shape {arr.shape} "
            f"and min {arr.min(initial=np.inf)}; pass PreferenceBatch.{name}."
        )
    return arr


def dpo_loss(
    policy_chosen_logps: np.ndarray,
    policy_rejected_logps: np.ndarray,
    ref_chosen_logps: np.ndarray,
    ref_rejected_logps: np.ndarray,
    *,
    loss_type: Union[str, Sequence[str]] = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_weights: Optional[Sequence[float]] = None,
    discopop_tau: float = 0.05,
    chosen_num_tokens: Optional[np.ndarray] = None,
    rejected_num_tokens: Optional[np.ndarray] = None,
) -> DPOLossOutput:
    """Per-example DPO losses and rewards from sequence log-probs, all float [N].

    ``chosen_num_tokens`` / ``rejected_num_tokens`` (scored completion tokens per sequence)
    are needed by 'ipo' only, which TRL length-normalises.

    >>> out = dpo_loss([-3.0], [-5.0], [-4.0], [-4.0], beta=0.5)   # c = 1, r = -1, x = 1
    >>> round(out.loss, 6), out.chosen_rewards.tolist(), out.rejected_rewards.tolist()
    (0.313262, [0.5], [-0.5])
    """
    cfg = validate_dpo_config(loss_type, loss_weights, beta, label_smoothing, discopop_tau)
    pc = _as_logps("policy_chosen_logps", policy_chosen_logps)
    pr = _as_logps("policy_rejected_logps", policy_rejected_logps)
    rc = _as_logps("ref_chosen_logps", ref_chosen_logps)
    rr = _as_logps("ref_rejected_logps", ref_rejected_logps)
    if not pc.shape == pr.shape == rc.shape == rr.shape:
        raise ConfigError(
            f"the four log-prob arrays must have the same shape [N]; got policy_chosen {pc.shape}, "
            f"policy_rejected {pr.shape}, ref_chosen {rc.shape}, ref_rejected {rr.shape}; pass one value per pair "
            f"in each."
        )
    n_c = n_r = None
    if set(cfg.loss_type) & set(TOKEN_COUNT_LOSS_TYPES):
        n_c = _as_counts("chosen_num_tokens", chosen_num_tokens, pc.size)
        n_r = _as_counts("rejected_num_tokens", rejected_num_tokens, pc.size)
    out = dpo_family(
        pc - rc,
        pr - rr,
        cfg,
        NUMPY_OPS,
        chosen_num_tokens=n_c,
        rejected_num_tokens=n_r,
        policy_chosen_logps=pc,
        policy_rejected_logps=pr,
    )
    return DPOLossOutput(
        losses=out.losses,
        chosen_rewards=out.chosen_rewards,
        rejected_rewards=out.rejected_rewards,
        losses_by_type=out.losses_by_type,
    )


def reward_metrics(chosen_rewards: np.ndarray, rejected_rewards: np.ndarray) -> dict[str, float]:
    """TRL's reward metrics: means over examples of β c, β r, [β c > β r] and β (c - r).

    >>> reward_metrics(np.array([1.0, -1.0]), np.array([0.0, 0.0]))
    {'rewards/chosen': 0.0, 'rewards/rejected': 0.0, 'rewards/accuracies': 0.5, 'rewards/margins': 0.0}
    """
    chosen = np.asarray(chosen_rewards, dtype=np.float64)
    rejected = np.asarray(rejected_rewards, dtype=np.float64)
    if chosen.shape != rejected.shape or chosen.ndim != 1 or chosen.size == 0:
        raise ConfigError(
            f"chosen_rewards {chosen.shape} and rejected_rewards {rejected.shape} must be the same "
            f"non-empty 1-D shape [N]; pass one reward per pair in each."
        )
    return {
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
        # Strict: a tie is not a win, as in TRL.
        "rewards/accuracies": float((chosen > rejected).mean()),
        "rewards/margins": float((chosen - rejected).mean()),
    }


def check_dpo_run(cfg: Any) -> None:
    """DPO's rules over a ``TrainConfig``: no packing (it would cut pairs apart), the loss family's knobs together,
    and Liger's fused DPO loss where it is asked for."""
    if cfg.data.packing:
        raise ConfigError(
            "packing=True does not apply to DPO (it would cut pairs apart); use "
            "--padding-free to put every pair of a micro-batch in one row."
        )
    dpo = cfg.dpo
    validate_dpo_config(dpo.dpo_loss_type, dpo.loss_weights, dpo.beta, dpo.label_smoothing, dpo.discopop_tau)
    if cfg.loss.loss_type == "liger" or cfg.loss.use_liger_kernel:
        check_liger_dpo_config(
            dpo.dpo_loss_type, padding_free=cfg.data.padding_free, precompute=dpo.precompute_ref_log_probs
        )


DPO_TASK = register_task(
    TaskSpec(
        name="dpo",
        trainer="DPOTrainer",
        builder="trainer:build_dpo",
        order=1,
        sections=("dpo",),
        reference=True,
        one_process=True,
        data="preference",
        shares_prefix=True,  # chosen and rejected share the prompt
        learning_rate=1e-6,
        peft_learning_rate=1e-5,
        plot_keys=("loss", "rewards/accuracies", "tokens_per_second"),
        check=check_dpo_run,
        evaluator="twinseq.common.run.eval_set:dpo_evaluator",
    )
)
"""Direct preference optimisation (TRL's ``DPOTrainer``); context parallelism is its one multi-process mode."""
