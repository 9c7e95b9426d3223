"""PEFT on the jax backend: LoRA/DoRA/rsLoRA adapters, QLoRA's 4-bit base and trainable tokens.

The rules (targets, initial values, scaling, key names, merge) are twinseq.common.peft's.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from twinseq.common.backend import Model
from twinseq.common.models import ModelConfig
from twinseq.common.peft import PeftConfig


def add_adapters(model: Model, cfg: ModelConfig, peft: PeftConfig,
                 adapters: Optional[dict[str, np.ndarray]] = None) -> Model:
    raise NotImplementedError("PEFT on the jax backend is being built")


def export_adapters(model: Model) -> dict[str, np.ndarray]:
    raise NotImplementedError("PEFT on the jax backend is being built")


def merge_adapters(model: Model) -> Model:
    raise NotImplementedError("PEFT on the jax backend is being built")
