"""The PyTorch backend: the same public names as ``twinseq.jax_backend``.

A plain re-export of the backend protocol (``twinseq.common.backend.Backend``) and the other
public names. Importing it imports torch and transformers.

Importing it also bounds oneDNN's and ideep's kernel caches (``torch_backend.memory``) unless the user set them.
"""

from twinseq.torch_backend.attention import check_attention_supported, forward_hidden
from twinseq.torch_backend.checkpoint import load_pretrained, save_pretrained
from twinseq.torch_backend.dpo import compute_sequence_logps, dpo_loss_and_grads
from twinseq.torch_backend.generation import complete_prompts, generate
from twinseq.torch_backend.grpo import completion_logps, grpo_loss_torch
from twinseq.torch_backend.memory import ActivationOffloader, offload_activations
from twinseq.torch_backend.model import build_model, compute_loss, export_weights, logits, loss_and_grads
from twinseq.torch_backend.peft import add_adapters, export_adapters, merge_adapters
from twinseq.torch_backend.recipes import train

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
    "compute_loss",
    "forward_hidden",
    "check_attention_supported",
    "ActivationOffloader",
    "offload_activations",
    "generate",
    "completion_logps",
    "grpo_loss_torch",
]
