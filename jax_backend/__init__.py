"""The JAX backend (Flax NNX + optax): the same public names as ``twinseq.torch_backend``.

A plain re-export of the backend protocol (``twinseq.common.backend.Backend``) and the other
public names. Importing it imports jax.

>>> from twinseq.common.config import ModelConfig
>>> from twinseq.common.data.batching import collate
>>> model = build_model(ModelConfig.preset("tiny"))
>>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}], padding_free=True)
>>> logits(model, batch).shape
(1, 5, 8192)
"""

from twinseq.jax_backend.checkpoint import load_pretrained, save_pretrained
from twinseq.jax_backend.dpo import compute_sequence_logps, dpo_loss_and_grads
from twinseq.jax_backend.generation import complete_prompts, generate
from twinseq.jax_backend.model import (
    CausalLM,
    batch_inputs,
    build_model,
    export_weights,
    grads_jit,
    logits,
    loss_and_grads,
    loss_fn,
    loss_grads_and_metrics,
    token_losses,
)
from twinseq.jax_backend.peft import add_adapters, export_adapters, merge_adapters
from twinseq.jax_backend.recipes import train

__all__ = [
    "build_model",
    "export_weights",
    "logits",
    "loss_and_grads",
    "train",
    "load_pretrained",
    "save_pretrained",
    "compute_sequence_logps",
    "dpo_loss_and_grads",
    "add_adapters",
    "export_adapters",
    "merge_adapters",
    "complete_prompts",
    "CausalLM",
    "batch_inputs",
    "grads_jit",
    "loss_fn",
    "loss_grads_and_metrics",
    "token_losses",
    "generate",
]
