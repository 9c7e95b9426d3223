"""A reference model that follows the policy (TR-DPO's "sync_ref_model"), for DPO, KTO, GRPO and RLOO, in TRL 1.16's
shape (``SyncRefModelCallback``).

After every ``ref_model_sync_steps``-th optimizer step (step numbers counted from 1, a skipped step included, as
TRL's ``global_step``), each reference parameter becomes::

    ref <- (1 - α) ref + α policy,      α = ref_model_mixup_alpha

The reference then has to be part of a checkpoint (it is no longer the initial policy), and precomputed reference
log-probs would go stale; a PEFT run, whose reference is the base with the adapters off, has no separate copy to
move. Both are refused, as TRL refuses them; so is a GRPO/RLOO run without a KL term (no reference is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from twinseq.common.errors import ConfigError
from twinseq.common.fields import _CHECKS_ON, _check_fields, knob


@dataclass
class ReferenceConfig:
    """The reference model's synchronisation with the policy (TRL 1.16's names; off by default)."""

    sync_ref_model: bool = False
    """Move the reference towards the policy every ``ref_model_sync_steps`` steps (TR-DPO)."""
    ref_model_mixup_alpha: float = knob(0.6, ge=0, le=1)
    """α: the policy's share in the new reference."""
    ref_model_sync_steps: int = knob(512, ge=1)
    """Optimizer steps between two synchronisations."""

    def __post_init__(self) -> None:
        if _CHECKS_ON.get():
            _check_fields(self)


def check_ref_sync(
    ref: ReferenceConfig,
    *,
    task: str,
    use_peft: bool,
    precompute_ref_log_probs: bool,
    kl_beta: float,
    kl_beta_name: Optional[str] = None,
) -> None:
    """The refusals of ``sync_ref_model=True`` (TRL's): PEFT, precomputed reference log-probs, no KL term
    (``kl_beta_name``: the ``section.field`` of an online task's KL coefficient, ``grpo.grpo_beta``)."""
    if not ref.sync_ref_model:
        return
    if use_peft:
        raise ConfigError(
            "sync_ref_model=True with use_peft=True: the reference is the base with the adapters off, not a copy "
            "that can move; drop --sync-ref-model, or train every weight (drop --use-peft)."
        )
    if precompute_ref_log_probs:
        raise ConfigError(
            "sync_ref_model=True with precompute_ref_log_probs=True: the precomputed log-probs come from the initial "
            "reference and would go stale when it moves; drop one of --sync-ref-model / --precompute-ref-log-probs."
        )
    if kl_beta_name is not None and kl_beta == 0:
        name = kl_beta_name.split(".")[-1]
        raise ConfigError(
            f"sync_ref_model=True with {name}=0: no reference model is loaded, so there is nothing to synchronise; "
            f"set --{name.replace('_', '-')} above 0 or drop --sync-ref-model."
        )


def sync_due(ref: ReferenceConfig, step: int) -> bool:
    """Whether the reference moves after optimizer step ``step`` (1-based).

    >>> cfg = ReferenceConfig(sync_ref_model=True, ref_model_sync_steps=3)
    >>> [s for s in range(1, 10) if sync_due(cfg, s)]
    [3, 6, 9]
    """
    return ref.sync_ref_model and step > 0 and step % ref.ref_model_sync_steps == 0


def mix(reference: np.ndarray, policy: np.ndarray, alpha: float) -> np.ndarray:
    """The rule in numpy, float64: ``(1 - α) reference + α policy``.

    >>> mix(np.array([1.0, 2.0]), np.array([3.0, 0.0]), 0.25).tolist()
    [1.5, 1.5]
    """
    return (1.0 - alpha) * np.asarray(reference, np.float64) + alpha * np.asarray(policy, np.float64)


__all__ = ["ReferenceConfig", "check_ref_sync", "sync_due", "mix"]
