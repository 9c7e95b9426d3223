"""``twinseq train --backend torch``: which builder runs each task, in one process, under FSDP2 (+ context
parallelism) or under DeepSpeed ZeRO-3; ``common.run.trainer.train_task`` runs the result.

A builder returns (trainer, step source, tokenizer, announce lines). Each task's ``common.tasks.TaskSpec.builder``
names it in this package (``trainer:build_sft``, ``kto:build_kto``, ...), so a new training method is found without
an entry here (docs/architecture.md, "Adding a training method"); under ZeRO-3 the builders are
``deepspeed.build_zero3_sft`` and ``zero3_grpo.build_grpo_zero3``.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.run.capabilities import Runtime as CapabilityRuntime
from twinseq.common.run.inputs import RunInputs
from twinseq.common.run.runner import preflight
from twinseq.common.run.trainer import Build, train_task
from twinseq.common.tasks import resolve, task_specs
from twinseq.torch_backend.deepspeed import build_zero3_sft, check_zero3_config, ensure_process_group, require_deepspeed
from twinseq.torch_backend.distributed import Runtime, init_runtime, wants_distributed
from twinseq.torch_backend.trainer import pick_device
from twinseq.torch_backend.zero3_grpo import build_grpo_zero3


def builders(cfg: TrainConfig, device: torch.device, runtime: Optional[Runtime]) -> dict[str, Build]:
    """The torch builder of each task (one process, or FSDP2 on every rank of a launch): ``TaskSpec.builder`` in
    this package."""
    return {spec.name: partial(resolve(spec.builder, __package__), cfg, device, runtime) for spec in task_specs()}


def train(config: TrainConfig, inputs: Optional[RunInputs] = None) -> Path:
    """Run ``config.max_steps`` optimizer steps of ``config.task``; returns the path of ``metrics.jsonl``.

    One process, or every rank of a ``torchrun``/``accelerate launch`` (FSDP2, context parallelism); with
    ``deepspeed_zero_stage=3``, ``train_zero3``. ``inputs``: objects beside the config (``common.run.inputs``).
    """
    cfg = config
    if cfg.parallel.deepspeed_zero_stage:  # DeepSpeed owns the process group, the model and the optimizer
        return train_zero3(cfg, inputs)
    runtime = init_runtime(cfg) if wants_distributed(cfg) else None
    try:
        device = pick_device() if runtime is None else runtime.device
        if runtime is None:
            preflight(cfg, CapabilityRuntime("torch", device.type, 1, accelerator=device.type == "cuda"))
        torch.manual_seed(cfg.seed)
        desc = "torch" if runtime is None else "torch-fsdp2"
        return train_task(cfg, builders(cfg, device, runtime), desc=desc, inputs=inputs)
    finally:
        if runtime is not None and runtime.owns_group:
            dist.destroy_process_group()


def train_zero3(cfg: TrainConfig, inputs: Optional[RunInputs] = None) -> Path:
    """``twinseq train`` with ``deepspeed_zero_stage=3``: SFT or GRPO on every rank of a torchrun launch (or one
    process); returns the path of ``metrics.jsonl``."""
    check_zero3_config(cfg)
    if cfg.optim.skip_nonfinite_steps:
        raise ConfigError(
            "skip_nonfinite_steps=True does not combine with deepspeed_zero_stage=3: DeepSpeed applies "
            "the update before the step's norm is known here; drop --skip-nonfinite-steps."
        )
    require_deepspeed()
    owns_group = not dist.is_initialized()
    ensure_process_group()
    try:
        device = (
            torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
        )
        preflight(
            cfg, CapabilityRuntime("torch", device.type, dist.get_world_size(), accelerator=device.type == "cuda")
        )
        torch.manual_seed(cfg.seed)
        return train_task(
            cfg,
            {
                "sft": partial(build_zero3_sft, cfg),
                "grpo": partial(build_grpo_zero3, cfg),
                "rloo": partial(build_grpo_zero3, cfg),
            },
            desc="torch-zero3",
            inputs=inputs,
        )
    finally:
        if owns_group:
            dist.barrier()
            dist.destroy_process_group()
