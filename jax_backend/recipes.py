"""``twinseq train --backend jax``: which builder runs each task; ``common.run.trainer.train_task`` runs the result.

A builder returns (trainer, step source, tokenizer, announce lines). Each task's ``common.tasks.TaskSpec.builder``
names it in this package (``trainer:build_sft``, ``kto:build_kto``, ...), so a new training method is found without
an entry here (docs/architecture.md, "Adding a training method").
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
from twinseq.common.tasks import resolve, task_specs
from twinseq.jax_backend.trainer import check_optimizer


def builders(cfg: TrainConfig) -> dict[str, Build]:
    """The JAX builder of each task: ``TaskSpec.builder`` in this package."""
    return {spec.name: partial(resolve(spec.builder, __package__), cfg) for spec in task_specs()}


def train(config: TrainConfig, inputs: Optional[RunInputs] = None) -> Path:
    """Run ``config.max_steps`` optimizer steps of ``config.task``; returns the path of ``metrics.jsonl``."""
    cfg = config
    check_optimizer(cfg)
    platform = jax.devices()[0].platform
    preflight(cfg, Runtime("jax", platform, jax.device_count(), accelerator=platform != "cpu"))
    return train_task(cfg, builders(cfg), desc="jax", inputs=inputs)
