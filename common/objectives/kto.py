"""KTO (Kahneman-Tversky optimisation): the config section, the loss family and its numpy reference, in TRL 1.16's
shape.

KTO learns from unpaired rows: a prompt x, one completion y and a label, True when y is desirable. With the
completion's log-ratio to the reference ``r = log π(y|x) - log π_ref(y|x)`` (summed over its completion tokens)
and ``z`` the batch's KL estimate, the loss of one row is::

    kto                 desirable   w_d (1 - σ(β (r - z)))       undesirable   w_u (1 - σ(β (z - r)))
    apo_zero_unpaired   desirable   w_d (1 - σ(β r))              undesirable   w_u σ(β r)

``z`` is the mean over the micro-batch's *mismatched* pairs (x_i, y'_i), each row's prompt with another row's
completion, of ``log π(y'|x) - log π_ref(y'|x)``, clamped at 0 and held constant (no gradient flows through it).
``apo_zero_unpaired`` has no ``z`` and needs no mismatched pairs. The loss of a micro-batch is the mean over its
rows (TRL); twinseq divides the sum by the rows of the whole optimizer step instead, which is the same when
micro-batches hold equal counts and keeps gradient accumulation exact when they do not.

The reward of a row is ``β r`` (no gradient). ``kto_family`` is written once over ``ArrayOps`` and run by numpy
(the float64 reference, ``kto_loss``), torch and jax.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from twinseq.common.errors import ConfigError, DataError
from twinseq.common.fields import _CHECKS_ON, _check_fields, _flag, knob
from twinseq.common.objectives.dpo import NUMPY_OPS, ArrayOps
from twinseq.common.tasks import TaskSpec, register_task

logger = logging.getLogger(__name__)

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
"""TRL 1.16's ``KTOConfig.loss_type`` values."""


@dataclass
class KTOConfig:
    """Kahneman-Tversky optimisation (read with ``task=kto`` only). TRL 1.16's ``KTOConfig`` names, except
    ``kto_loss_type`` (``loss_type`` names the token-loss kernel). ``beta`` and ``precompute_ref_log_probs`` are
    the ``dpo`` section's, shared with DPO."""

    kto_loss_type: str = "kto"
    """'kto' (the paper's loss, with the KL estimate) or 'apo_zero_unpaired' (no KL term)."""
    desirable_weight: float = knob(1.0, gt=0)
    """Weight of the desirable rows' losses (λ_D)."""
    undesirable_weight: float = knob(1.0, gt=0)
    """Weight of the undesirable rows' losses (λ_U)."""

    def __post_init__(self) -> None:
        if _CHECKS_ON.get():
            _check_fields(self)


@dataclass(frozen=True)
class KTOLossConfig:
    """A validated KTO loss configuration (``validate_kto_config``)."""

    loss_type: str
    beta: float
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def uses_kl(self) -> bool:
        """True when the loss reads the KL estimate (so the batches carry mismatched pairs)."""
        return self.loss_type == "kto"


def validate_kto_config(
    loss_type: str, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
) -> KTOLossConfig:
    if loss_type not in KTO_LOSS_TYPES:
        raise ConfigError(
            f"kto_loss_type={loss_type!r} is not a KTO loss; choose one of {list(KTO_LOSS_TYPES)} (TRL 1.16's "
            f"KTOConfig.loss_type)."
        )
    for name, value in (
        ("beta", beta),
        ("desirable_weight", desirable_weight),
        ("undesirable_weight", undesirable_weight),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
            raise ConfigError(
                f"{name}={value!r} must be a finite number > 0; pass e.g. --{name.replace('_', '-')} 1.0."
            )
    return KTOLossConfig(loss_type, float(beta), float(desirable_weight), float(undesirable_weight))


def check_liger_kto_config(config: KTOLossConfig, *, padding_free: bool, precompute: bool) -> None:
    """Liger's fused KTO loss (``loss_type='liger'``) computes exactly twinseq's only for ``kto`` with unit weights
    (it has no desirable/undesirable weights), padded rows, and a live reference (it reads the reference's hidden
    states)."""
    if config.loss_type != "kto" or config.desirable_weight != 1.0 or config.undesirable_weight != 1.0:
        raise ConfigError(
            f"loss_type='liger' runs Liger's fused KTO loss, which computes kto_loss_type='kto' with "
            f"desirable_weight=1 and undesirable_weight=1 only; got kto_loss_type={config.loss_type!r}, "
            f"desirable_weight={config.desirable_weight}, undesirable_weight={config.undesirable_weight}: use "
            f"--loss-type fused_linear (every KTO variant, no [tokens, vocab] tensor) or drop those flags."
        )
    if padding_free:
        raise ConfigError(
            "loss_type='liger' for KTO needs padded batches (one completion per row); drop --padding-free or use "
            "--loss-type fused_linear."
        )
    if precompute:
        raise ConfigError(
            "precompute_ref_log_probs=True is not supported with loss_type='liger': Liger's KTO loss reads the "
            "reference's hidden states; drop --precompute-ref-log-probs or use --loss-type fused_linear."
        )


def check_kto_batch_size(config: KTOLossConfig, per_device_train_batch_size: int) -> None:
    """The KL estimate needs another row to pair each prompt with: refused with one row per micro-batch (TRL)."""
    if config.uses_kl and per_device_train_batch_size < 2:
        raise ConfigError(
            f"kto_loss_type='kto' estimates the KL term from mismatched pairs within a micro-batch, and "
            f"per_device_train_batch_size={per_device_train_batch_size} leaves each prompt only its own completion "
            f"(the estimate would equal the reward); set --per-device-train-batch-size 2 or more, or use "
            f"--kto-loss-type apo_zero_unpaired."
        )


def weight_advice(labels: Sequence[bool], desirable_weight: float, undesirable_weight: float) -> str | None:
    """A warning when the desirable/undesirable counts are unbalanced and neither weight is in the range that Eq. (8)
    of the KTO paper recommends (TRL's check, same rounding), or None.

    >>> weight_advice([True] * 3 + [False], 1.0, 1.0)[:44]
    'there are 3 desirable and 1 undesirable rows'
    >>> weight_advice([True] * 3 + [False], 0.33, 1.0) is None
    True
    """
    flags = np.asarray(labels, bool)
    n_d = max(int(flags.sum()), 1)
    n_u = max(int(flags.size) - n_d, 1)
    if n_d == n_u:
        return None
    d_lo, d_hi = round(n_u * undesirable_weight / n_d, 2), round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_lo, u_hi = round(n_d * desirable_weight / n_u / 1.33, 2), round(n_d * desirable_weight / n_u, 2)
    if d_lo <= desirable_weight <= d_hi or u_lo <= undesirable_weight <= u_hi:
        return None
    return (
        f"there are {n_d} desirable and {n_u} undesirable rows, but the weights (desirable_weight="
        f"{desirable_weight}, undesirable_weight={undesirable_weight}) are outside the range the KTO paper "
        f"recommends (Eq. 8); set EITHER --desirable-weight in [{d_lo}, {d_hi}] OR --undesirable-weight in "
        f"[{u_lo}, {u_hi}] (not both)."
    )


# ---------------------------------------------------------------------------------------
# The loss family, written once over an array namespace
# ---------------------------------------------------------------------------------------


class KTOFamilyOutput(NamedTuple):
    losses: Any  # [N]: each row's weighted loss
    rewards: Any  # [N]: β r (the caller detaches)


def kto_family(logratios: Any, labels: Any, kl: Any, config: KTOLossConfig, ops: ArrayOps) -> KTOFamilyOutput:
    """Per-row KTO losses from the log-ratios ``r`` [N], the boolean labels [N] (True: desirable) and the KL
    estimate ``z`` (a scalar the caller computed without gradient; ignored by 'apo_zero_unpaired')."""
    b = config.beta
    if config.loss_type == "kto":
        # 1 - σ(u) = σ(-u)
        desirable = ops.exp(ops.log_sigmoid(-b * (logratios - kl)))
        undesirable = ops.exp(ops.log_sigmoid(-b * (kl - logratios)))
    else:  # apo_zero_unpaired
        desirable = ops.exp(ops.log_sigmoid(-b * logratios))
        undesirable = ops.exp(ops.log_sigmoid(b * logratios))
    w_d, w_u = config.desirable_weight, config.undesirable_weight
    losses = labels * (w_d * desirable) + (1 - labels) * (w_u * undesirable)
    return KTOFamilyOutput(losses, b * logratios)


def kl_estimate(policy_kl_logps: np.ndarray, ref_kl_logps: np.ndarray) -> float:
    """``z = max(0, mean(log π(y'|x) - log π_ref(y'|x)))`` over the mismatched pairs; 0 when there are none."""
    if len(policy_kl_logps) == 0:
        return 0.0
    return max(0.0, float(np.mean(np.asarray(policy_kl_logps, np.float64) - np.asarray(ref_kl_logps, np.float64))))


@dataclass
class KTOLossOutput:
    """Per-row outputs of ``kto_loss``; ``loss`` is TRL's scalar (the mean over the rows)."""

    losses: np.ndarray  # float64 [N]
    rewards: np.ndarray  # float64 [N]: β r
    kl: float

    @property
    def loss(self) -> float:
        return float(self.losses.mean())


def _as_1d(name: str, value: Any, n: int | None = None) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 1 or (n is not None and arr.size != n):
        want = "[N]" if n is None else f"[{n}]"
        raise ConfigError(f"{name} must be a 1-D array {want}, got shape {arr.shape}; pass one value per row.")
    if not np.isfinite(arr).all():
        raise ConfigError(
            f"{name} holds non-finite values (e.g. {arr[~np.isfinite(arr)][:3].tolist()}); a sequence log-prob "
            f"must be finite: check the model output and the target mask."
        )
    return arr


def kto_loss(
    policy_logps: Any,
    ref_logps: Any,
    labels: Any,
    *,
    policy_kl_logps: Any = (),
    ref_kl_logps: Any = (),
    loss_type: str = "kto",
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> KTOLossOutput:
    """The float64 reference: per-row KTO losses, rewards and the KL estimate of one micro-batch.

    >>> out = kto_loss([-3.0, -5.0], [-4.0, -4.0], [True, False], policy_kl_logps=[-4.0, -4.0],
    ...                ref_kl_logps=[-4.5, -4.5], beta=1.0)      # r = [1, -1], z = 0.5
    >>> round(out.kl, 6), out.losses.round(6).tolist(), out.rewards.tolist()
    (0.5, [0.377541, 0.182426], [1.0, -1.0])
    """
    config = validate_kto_config(loss_type, beta, desirable_weight, undesirable_weight)
    pol = _as_1d("policy_logps", policy_logps)
    ref = _as_1d("ref_logps", ref_logps, pol.size)
    lab = np.asarray(labels)
    if lab.dtype != bool or lab.shape != pol.shape:
        raise DataError(
            f"labels must be a boolean array [{pol.size}] (True: desirable), got dtype {lab.dtype} and shape "
            f"{lab.shape}; pass one bool per row."
        )
    kl = 0.0
    if config.uses_kl:
        pkl = _as_1d("policy_kl_logps", policy_kl_logps)
        rkl = _as_1d("ref_kl_logps", ref_kl_logps, pkl.size)
        kl = kl_estimate(pkl, rkl)
    out = kto_family(pol - ref, lab.astype(np.float64), kl, config, NUMPY_OPS)
    return KTOLossOutput(losses=np.asarray(out.losses), rewards=np.asarray(out.rewards), kl=kl)


def kto_step_metrics(
    losses: Sequence[float],
    per_row: Mapping[str, Sequence[np.ndarray]],
    kls: Sequence[float],
    *,
    num_tokens: int,
    num_label_tokens: int,
) -> dict[str, Any]:
    """TRL's KTO metrics of one step: the loss (the micro-batch losses summed, each already divided by the step's
    rows), ``kl`` (the mean of the micro-batches' estimates), and per side the mean reward and sequence log-prob
    over the step's desirable (``chosen``) and undesirable (``rejected``) rows; ``rewards/margins`` when both occur.

    ``per_row`` holds, per micro-batch, ``labels`` (bool), ``rewards`` and ``logps`` arrays [N].
    """
    cat = {k: np.concatenate([np.asarray(a) for a in v]) if v else np.zeros(0) for k, v in per_row.items()}
    labels = cat["labels"].astype(bool)
    out: dict[str, Any] = {
        "loss": float(sum(losses)),
        "num_tokens": int(num_tokens),
        "num_label_tokens": int(num_label_tokens),
        "kl": float(np.mean(kls)) if len(kls) else 0.0,
        "count/desirable": int(labels.sum()),
        "count/undesirable": int((~labels).sum()),
    }
    for side, mask in (("chosen", labels), ("rejected", ~labels)):
        if mask.any():
            out[f"rewards/{side}"] = float(np.asarray(cat["rewards"], np.float64)[mask].mean())
            out[f"logps/{side}"] = float(np.asarray(cat["logps"], np.float64)[mask].mean())
    if labels.any() and (~labels).any():
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


DPO_ONLY_FIELDS = ("dpo_loss_type", "loss_weights", "label_smoothing", "discopop_tau")
"""The ``dpo`` section's fields that KTO does not read (it reads ``beta`` and ``precompute_ref_log_probs``): set
under ``task=kto`` they are refused, not ignored."""


def check_kto_run(cfg: Any) -> None:
    """KTO's rules over a ``TrainConfig``: DPO's loss knobs refused, no packing, its loss family's knobs together,
    the batch size its KL estimate needs, and Liger's fused KTO loss where it is asked for."""
    d, default = cfg.data, type(cfg.dpo)()
    changed = [name for name in DPO_ONLY_FIELDS if getattr(cfg.dpo, name) != getattr(default, name)]
    if changed:
        raise ConfigError(
            f"{', '.join(f'{n}={getattr(cfg.dpo, n)!r}' for n in changed)} shape DPO's loss, and task='kto' has "
            f"its own (--kto-loss-type, --desirable-weight, --undesirable-weight); drop "
            f"{' '.join(_flag(n) for n in changed)}, or use --task dpo."
        )
    if d.packing:
        raise ConfigError(
            "packing=True does not apply to KTO (a row's completion and its mismatched pair are scored "
            "separately); use --padding-free to put a micro-batch's sequences in one row."
        )
    config = validate_kto_config(
        cfg.kto.kto_loss_type, cfg.dpo.beta, cfg.kto.desirable_weight, cfg.kto.undesirable_weight
    )
    check_kto_batch_size(config, d.per_device_train_batch_size)
    if cfg.loss.loss_type == "liger" or cfg.loss.use_liger_kernel:
        check_liger_kto_config(config, padding_free=d.padding_free, precompute=cfg.dpo.precompute_ref_log_probs)


KTO_TASK = register_task(
    TaskSpec(
        name="kto",
        trainer="KTOTrainer",
        builder="kto:build_kto",
        order=4,
        sections=("dpo", "kto"),  # beta and precompute_ref_log_probs are the dpo section's
        reference=True,
        one_process=True,
        data="preference",
        learning_rate=1e-6,
        peft_learning_rate=1e-5,
        plot_keys=("loss", "rewards/margins", "kl", "tokens_per_second"),
        check=check_kto_run,
        evaluator="twinseq.common.run.eval_set:kto_evaluator",
    )
)
"""Kahneman-Tversky optimisation from unpaired rows (TRL's ``KTOTrainer``)."""

__all__ = [
    "KTO_LOSS_TYPES",
    "KTO_TASK",
    "check_kto_run",
    "KTOConfig",
    "KTOLossConfig",
    "validate_kto_config",
    "check_kto_batch_size",
    "weight_advice",
    "kto_family",
    "kl_estimate",
    "kto_loss",
    "KTOLossOutput",
    "kto_step_metrics",
]
