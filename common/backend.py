"""The backend contract, and the one switch that picks a backend.

``Backend`` states, as a ``typing.Protocol``, the functions both ``twinseq.torch_backend`` and
``twinseq.jax_backend`` export with identical signatures (a test compares them with
``inspect.signature``). Users, notebooks and parity tests call these names; a backend module
is a plain re-export of them, and ``load_backend`` imports it lazily. No global state is kept
beyond the choice itself (``TWINSEQ_BACKEND`` or the ``--backend`` flag).

>>> sorted(PROTOCOL)[:3]
['build_model', 'compute_sequence_logps', 'dpo_loss_and_grads']
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Protocol, Sequence, Union

import numpy as np

from twinseq.common.config import BACKENDS, DEFAULT_CHUNK_SIZE, ModelConfig, TrainConfig
from twinseq.common.data.batching import Batch
from twinseq.common.data.preference_batching import PreferenceBatch
from twinseq.common.errors import ConfigError, MissingDependencyError
from twinseq.common.models.peft import PeftConfig
from twinseq.common.objectives.dpo import DPOLossConfig
from twinseq.common.run.inputs import RunInputs

_EXTRA_FOR = {"torch": ("torch", "transformers"), "jax": ("jax", "flax", "optax")}

Model = Any
"""A backend's model: a Hugging Face ``AutoModelForCausalLM`` of one of ``common.models.configs.MODEL_TYPES`` (torch) or
twinseq's Flax NNX ``CausalLM`` of the same family (jax)."""
PathLike = Union[str, os.PathLike]


class Backend(Protocol):
    """What each backend module exports (``Model`` is a torch ``nn.Module`` or a Flax NNX module)."""

    def build_model(
        self,
        cfg: ModelConfig,
        weights: Optional[dict[str, np.ndarray]] = None,
        *,
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        device: Any = None,
    ) -> Model:
        """A model of ``cfg`` with ``weights`` (HF names; None: ``init_weights(cfg, seed=0)``), train mode."""

    def export_weights(self, model: Model) -> dict[str, np.ndarray]:
        """float32 numpy weights in HF names and layout (``lm_head.weight`` omitted when tied)."""

    def logits(self, model: Model, batch: Batch) -> np.ndarray:
        """float32 [B, T, V] logits, documents masked on every attention path."""

    def loss_and_grads(
        self, model: Model, batch: Batch, loss_type: str = "nll", *, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> tuple[float, dict[str, np.ndarray]]:
        """(loss normalised by ``batch.num_items_in_batch``, float32 gradients by HF name)."""

    def train(self, config: TrainConfig, inputs: Optional[RunInputs] = None) -> Path:
        """Run a training job; returns the path of ``metrics.jsonl``. ``inputs``: objects beside the config
        (datasets, tokenizer, model, reward callables, callbacks; ``common.run.inputs``)."""

    def load_pretrained(
        self, path: PathLike, *, dtype: Optional[str] = None, attn_implementation: str = "sdpa", device: Any = None
    ) -> Model:
        """A model from a local Hugging Face folder (``dtype`` None: as stored, float32 or bfloat16)."""

    def save_pretrained(self, model: Model, path: PathLike) -> Path:
        """Write ``model`` as a Hugging Face folder (``config.json`` + ``model.safetensors``)."""

    def compute_sequence_logps(
        self,
        model: Model,
        pbatch: PreferenceBatch,
        *,
        loss_type: str = "fused_linear",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(chosen [N], rejected [N]) float64 sequence log-probs of a preference batch, no gradient."""

    def dpo_loss_and_grads(
        self,
        model: Model,
        pbatch: PreferenceBatch,
        config: DPOLossConfig,
        *,
        ref_chosen_logps: Any = None,
        ref_rejected_logps: Any = None,
        loss_type: str = "fused_linear",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        num_examples_in_step: Optional[int] = None,
    ) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(DPO loss, float32 gradients by HF name, per-pair float64 outputs) of one micro-batch."""

    def add_adapters(
        self, model: Model, cfg: ModelConfig, peft: PeftConfig, adapters: Optional[dict[str, np.ndarray]] = None
    ) -> Model:
        """``model`` with LoRA/DoRA adapters on ``common.models.peft.lora_targets`` (plus trainable tokens, and a 4-bit
        NF4 base with ``load_in_4bit``), loaded from ``adapters`` (PEFT keys; None: ``common.models.peft.init_adapters``
        with seed 0). Only adapter tensors train: ``loss_and_grads`` and ``dpo_loss_and_grads`` of the result
        return gradients by PEFT key, and DPO's reference model is the base with the adapters switched off."""

    def export_adapters(self, model: Model) -> dict[str, np.ndarray]:
        """float32 adapter tensors by PEFT key (what ``common.models.peft.save_adapters`` writes)."""

    def merge_adapters(self, model: Model) -> Model:
        """A plain model, without adapters, whose weights have the adapters folded in (for export)."""

    def complete_prompts(
        self,
        model: Model,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        eos_token_id: Optional[int] = None,
        pad_token_id: int = 0,
    ) -> np.ndarray:
        """int [N, C] completions of the token-id prompts (KV cache, eval mode), right-padded with ``pad_token_id``
        after each row's first EOS: greedy at ``temperature`` 0, else drawn from ``softmax(logits / temperature)``
        with ``seed``. At least one token each (EOS is not allowed first), at most ``max_new_tokens``."""


PROTOCOL = tuple(name for name in vars(Backend) if not name.startswith("_"))


def default_backend() -> str:
    return os.environ.get("TWINSEQ_BACKEND", "torch")


def require(backend: str) -> None:
    """Raise ``MissingDependencyError`` naming the extra to install when a backend's framework is missing."""
    for module in _EXTRA_FOR[backend]:
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(
                f"backend={backend!r} needs the '{module}' package; install it with "
                f"`pip install -e '.[{backend}]'` (or '.[all]')."
            )


def load_backend(name: Optional[str] = None) -> ModuleType:
    """The backend module (``twinseq.torch_backend`` or ``twinseq.jax_backend``), imported now."""
    name = name or default_backend()
    if name not in BACKENDS:
        raise ConfigError(
            f"backend={name!r} is not valid; choose one of {BACKENDS} (flag --backend or env TWINSEQ_BACKEND)."
        )
    require(name)
    return importlib.import_module(f"twinseq.{name}_backend")
