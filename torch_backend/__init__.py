"""The PyTorch backend: the same public names as ``twinseq.jax_backend``.

A plain re-export of the backend protocol (``twinseq.common.backend.Backend``) and the other
public names. Importing it imports torch and transformers.

It also bounds oneDNN's and ideep's kernel caches (``ONEDNN_CACHE_CAPACITY`` entries each) unless the user set them.
"""

import os

from twinseq.common.run.memory_plan import ONEDNN_CACHE_CAPACITY
from twinseq.torch_backend.attention import check_attention_supported, forward_hidden
from twinseq.torch_backend.checkpoint import load_pretrained, save_pretrained
from twinseq.torch_backend.dpo import compute_sequence_logps, dpo_loss_and_grads
from twinseq.torch_backend.generation import complete_prompts, generate
from twinseq.torch_backend.grpo import completion_logps, grpo_loss_torch
from twinseq.torch_backend.memory import ActivationOffloader, offload_activations
from twinseq.torch_backend.model import build_model, compute_loss, export_weights, logits, loss_and_grads
from twinseq.torch_backend.peft import add_adapters, export_adapters, merge_adapters
from twinseq.torch_backend.recipes import train

# CPU bfloat16 compute runs oneDNN kernels, and two caches keep one entry per distinct problem shape: oneDNN's
# primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's (LRU_CACHE_CAPACITY), 1,024 entries each by default.
# With varlen attention every step brings new document lengths, so the heap grew without levelling off (small,
# staircase "+ bf16 state", 8 steps: 191 -> 404 MiB peak). Capped at 16 it levels off at step 5 (175 -> 228 MiB; both
# at 0/1: 197 MiB but twice the step time, every kernel rebuilt), at no measurable step-time cost (median 9.9 s
# against 11.4 s at the default, 2 loaded cores; fixed shapes, 27 kernels: 13 rebuilt a step, ~30 ms a step). Both
# variables are read when the first kernel is built, not at `import torch`, so setting them here, after torch is
# imported, works (measured), but not once bfloat16 compute ran. LRU_CACHE_CAPACITY=0 crashes torch 2.13
# (segfault), hence no zero. A user's own setting wins. memory_plan's cache row is the bound this cap implies.
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, str(ONEDNN_CACHE_CAPACITY))

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
