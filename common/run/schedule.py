"""Learning-rate schedules as plain multipliers, so torch (LambdaLR) and optax agree exactly, and the length of a
run they are drawn over.

``lr_multiplier(k)`` is the factor applied to ``learning_rate`` for the k-th optimizer update
(k = 0 for the first), the convention of both ``torch.optim.lr_scheduler.LambdaLR`` and
optax's ``count``. Warmup is linear from 0, as in Hugging Face's ``get_*_schedule_with_warmup``.

``resolve_max_steps`` decides how many optimizer steps a run takes, as Hugging Face's ``TrainingArguments`` do: a
positive ``max_steps``, else ``ceil(num_train_epochs x steps per epoch)`` (``max_steps=-1``). A builder calls
``with_resolved_max_steps`` once its step source is built, so that the schedule, the warmup ratio and the runner
all read that number as ``cfg.max_steps``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from twinseq.common.config import LR_SCHEDULERS, TrainConfig
from twinseq.common.errors import ConfigError


def resolve_max_steps(cfg: TrainConfig, steps_per_epoch: Optional[int]) -> int:
    """The run's optimizer steps: ``cfg.max_steps`` when positive, else ``ceil(num_train_epochs * steps_per_epoch)``
    (at least 1; the product is rounded to 1e-9 first, so 0.1 epoch of 30 steps is 3 steps, not 4).

    >>> resolve_max_steps(TrainConfig.from_flat(max_steps=-1, num_train_epochs=1.5), steps_per_epoch=3)
    5
    >>> resolve_max_steps(TrainConfig.from_flat(max_steps=7, num_train_epochs=1.5), steps_per_epoch=3)
    7
    """
    if cfg.max_steps > 0:
        return cfg.max_steps
    if not steps_per_epoch:
        raise ConfigError(
            f"max_steps=-1 asks for num_train_epochs={cfg.num_train_epochs:g} epochs, but this step source has no "
            f"epochs (steps_per_epoch={steps_per_epoch}); pass a positive --max-steps."
        )
    return max(1, math.ceil(round(cfg.num_train_epochs * steps_per_epoch, 9)))


def describe_run_length(cfg: TrainConfig, steps_per_epoch: int) -> str:
    """One announce line: the run's optimizer steps in epochs, and which field decided them.

    >>> describe_run_length(TrainConfig.from_flat(max_steps=-1, num_train_epochs=2), steps_per_epoch=6)
    '12 optimizer steps = 2 epochs of 6 steps (num_train_epochs=2, max_steps=-1)'
    """
    steps = resolve_max_steps(cfg, steps_per_epoch)
    decided = f"num_train_epochs={cfg.num_train_epochs:g}, max_steps=-1" if cfg.max_steps < 0 else f"max_steps={steps}"
    return f"{steps} optimizer steps = {steps / steps_per_epoch:.4g} epochs of {steps_per_epoch} steps ({decided})"


def with_resolved_max_steps(cfg: TrainConfig, source: Any) -> TrainConfig:
    """``cfg`` itself when ``max_steps`` is positive, else a copy whose ``max_steps`` is ``resolve_max_steps`` of
    ``source.steps_per_epoch``: what the trainer's schedule and the runner read."""
    if cfg.max_steps > 0:
        return cfg
    return cfg.replace(max_steps=resolve_max_steps(cfg, source.steps_per_epoch))


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int, scheduler: str = "cosine") -> float:
    """Multiplier for update ``step`` (0-based).

    >>> [round(lr_multiplier(k, warmup_steps=2, max_steps=6, scheduler="linear"), 3) for k in range(6)]
    [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]
    """
    if scheduler not in LR_SCHEDULERS:
        raise ConfigError(f"lr_scheduler_type={scheduler!r} is not valid; choose one of {LR_SCHEDULERS}.")
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if scheduler == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    if scheduler == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))
