"""``twinseq train --backend jax``: which builder runs each task; ``common.run.trainer.train_task`` runs the result.

A builder returns (trainer, step source, tokenizer, announce lines): ``trainer.build_sft`` and ``build_dpo``,
``grpo.build_grpo``, ``kto.build_kto``. A new training method adds its builder to ``builders``
(docs/architecture.md, "Adding a training method").
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import jax

from twinseq.common.config import TrainConfig
from twinseq.common.run.capabilities import Runtime
from twinseq.common.run.inputs import RunInputs
from twinseq.common.run.runner import preflight
from twinseq.common.run.trainer import Build, train_task
from twinseq.jax_backend.grpo import build_grpo
from twinseq.jax_backend.kto import build_kto
from twinseq.jax_backend.trainer import build_dpo, build_sft, check_optimizer


def builders(cfg: TrainConfig) -> dict[str, Build]:
    """The JAX builder of each task."""
    return {
        "sft": partial(build_sft, cfg),
        "dpo": partial(build_dpo, cfg),
        "grpo": partial(build_grpo, cfg),
        "rloo": partial(build_grpo, cfg),  # the same rollout and trainer, RLOO's advantage and loss
        "kto": partial(build_kto, cfg),
    }


def train(config: TrainConfig, inputs: Optional[RunInputs] = None) -> Path:
    """Run ``config.max_steps`` optimizer steps of ``config.task``; returns the path of ``metrics.jsonl``."""
    cfg = config
    check_optimizer(cfg)
    platform = jax.devices()[0].platform
    preflight(cfg, Runtime("jax", platform, jax.device_count(), accelerator=platform != "cpu"))
    return train_task(cfg, builders(cfg), desc="jax", inputs=inputs)
