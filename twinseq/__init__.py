"""twinseq: memory-efficient LLM fine-tuning on two backends (PyTorch, JAX) that share one set of rules.

The public surface. ``import twinseq`` imports neither torch nor jax; a backend is imported when it is loaded::

    from twinseq import SFTConfig, SFTTrainer   # and DPO, GRPO, RLOO and KTO trainers, in TRL's shape

    trainer = SFTTrainer(model="tiny", args=SFTConfig(max_steps=10, max_length=512), train_dataset=rows,
                         backend="jax")
    trainer.train()

    import twinseq
    cfg = twinseq.TrainConfig(task="sft", max_steps=10, max_length=512, per_device_train_batch_size=2)
    metrics_path = twinseq.train(cfg)           # the backend of cfg.backend (default "torch", TWINSEQ_BACKEND)
    be = twinseq.load_backend("jax")            # the mirrored backend protocol: build_model, logits, ...

The config sections (``DataConfig``, the DPO and GRPO sections, ...) are in ``twinseq.common.config``; at the top,
``DPOConfig``, ``GRPOConfig``, ``RLOOConfig`` and ``KTOConfig`` are the trainers' argument classes, as in TRL.

The three code folders are the subpackages ``twinseq.common`` (backend-neutral: numpy, pyarrow),
``twinseq.torch_backend`` and ``twinseq.jax_backend``; in the repository they sit at the root and this folder links
them, so that an editable install, a built wheel and static tools (import graphs, type checkers) resolve every
``twinseq.*`` import the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinseq.common import api
from twinseq.common.api import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
    TrainOutput,
)
from twinseq.common.backend import load_backend
from twinseq.common.config import (
    DataConfig,
    LossConfig,
    MemoryConfig,
    ModelArgs,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from twinseq.common.errors import TwinseqError
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.peft import PeftConfig
from twinseq.common.run.callbacks import EarlyStoppingCallback, TrainerCallback

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The trainer and config classes of a method registered beyond the ones imported above
    (``common.tasks.TaskSpec.trainer``)."""
    try:
        return getattr(api, name)
    except AttributeError:
        raise AttributeError(f"module 'twinseq' has no attribute {name!r}") from None


def train(config: TrainConfig) -> Path:
    """Train ``config`` on its backend (``config.backend``); returns the path of ``metrics.jsonl``."""
    return load_backend(config.backend).train(config)


__all__ = [
    "SFTTrainer",
    "DPOTrainer",
    "GRPOTrainer",
    "RLOOTrainer",
    "KTOTrainer",
    "SFTConfig",
    "DPOConfig",
    "GRPOConfig",
    "RLOOConfig",
    "KTOConfig",
    "TrainOutput",
    "TrainerCallback",
    "EarlyStoppingCallback",
    "train",
    "load_backend",
    "TrainConfig",
    "ModelArgs",
    "DataConfig",
    "OptimConfig",
    "LossConfig",
    "MemoryConfig",
    "ParallelConfig",
    "PeftConfig",
    "ModelConfig",
    "TwinseqError",
    "__version__",
]
