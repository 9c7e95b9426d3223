"""Learning-rate schedules as plain multipliers, so torch (LambdaLR) and optax agree exactly.

``lr_multiplier(k)`` is the factor applied to ``learning_rate`` for the k-th optimizer update
(k = 0 for the first), the convention of both ``torch.optim.lr_scheduler.LambdaLR`` and
optax's ``count``. Warmup is linear from 0, as in Hugging Face's ``get_*_schedule_with_warmup``.
"""

from __future__ import annotations

import math

from twinseq.common.config import LR_SCHEDULERS
from twinseq.common.errors import ConfigError


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
