"""``parallelize``: the plain model turned into what a trainer steps: context parallelism, activation
checkpointing, compile and FSDP2, in that order (torchtitan's split: the model code, ``model.py`` and
``attention.py``, has no distributed imports). The process group, the mesh and the reductions over ranks are
``distributed.py``'s; the module a step runs (body + lm_head + loss in one forward) is ``losses.CausalLMLoss``.

FSDP2. Parameters, gradients and optimizer state are sharded with ``fully_shard`` over the
flattened ``dp x cp`` mesh (as torchtitan's ``dp_shard_cp``): cp ranks hold different tokens
of the same rows, so their gradients are partial sums exactly like dp ranks', and one
reduce-scatter over all ranks adds both. Each decoder layer is its own FSDP unit; the root is
``CausalLMLoss`` (so the tied embedding is gathered once and its gradient reduced once). Gradients are
SUMMED over ranks (the divide factor is 1): every loss is already normalised by the whole step. Mixed
precision (bf16 params, fp32 reduce) is used on CUDA with ``dtype=bfloat16`` only.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from twinseq.common.config import TrainConfig
from twinseq.torch_backend import context_parallel as cpmod
from twinseq.torch_backend.distributed import Runtime
from twinseq.torch_backend.losses import CausalLMLoss
from twinseq.torch_backend.memory import apply_activation_checkpointing, apply_long_context
from twinseq.torch_backend.unwrap import causal_lm_of

logger = logging.getLogger(__name__)


def use_cp_attention(model: torch.nn.Module, strategy: str) -> None:
    """Switch an HF model's attention to the registered CP function of ``strategy`` (logged); the ring
    refuses models with sliding windows or soft-capped scores (``context_parallel.check_ring_model``)."""
    if strategy == "ring":
        cpmod.check_ring_model(model.config)
    cpmod.register_cp_attention()
    name = cpmod.HF_NAMES[strategy]
    logger.info("context parallelism: attention runs %r (replaces %r)", name, model.config._attn_implementation)
    model.set_attn_implementation(name)


def apply_fsdp(module: CausalLMLoss, runtime: Runtime, cfg: TrainConfig) -> CausalLMLoss:
    """``fully_shard`` every decoder layer, then the root; gradients summed over ranks (factor 1)."""
    kwargs: dict[str, Any] = {"mesh": runtime.fsdp_mesh}
    if runtime.device.type == "cuda" and cfg.model.dtype == "bfloat16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    for layer in causal_lm_of(module.causal_lm).model.layers:  # an adapter model: inside PEFT's wrapper
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            # a plain SUM: the losses are already normalised by the whole step (gloo has no PREMUL_SUM)
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)
    return module


def apply_compile(causal_lm: torch.nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (dynamic shapes: batches vary in length), as
    torchtitan does: per-layer graphs compose with checkpointing and FSDP2's per-layer hooks."""
    for layer in causal_lm_of(causal_lm).model.layers:
        layer.compile(dynamic=True)


def parallelize(causal_lm: torch.nn.Module, runtime: Optional[Runtime], cfg: TrainConfig) -> CausalLMLoss:
    """The module a trainer steps, from the plain model, in a stated order:

    1. context parallelism: the attention of every layer becomes the cp strategy's (``cp > 1``);
    2. activation checkpointing of every decoder layer (``gradient_checkpointing``);
    3. ``torch.compile`` of every decoder layer (``torch_compile``);
    4. FSDP2 over the flattened dp x cp mesh (any multi-process or ``fsdp`` run).

    ``runtime`` is None for a plain one-process run (steps 1 and 4 are skipped).
    """
    if runtime is not None and runtime.mesh_cfg.cp > 1:
        use_cp_attention(causal_lm, cfg.parallel.context_parallel_strategy)
    apply_long_context(causal_lm, cfg.memory)  # blocked attention's block size; tiled MLP (tiled_mlp)
    if cfg.memory.gradient_checkpointing:
        apply_activation_checkpointing(causal_lm)
    if cfg.memory.torch_compile:
        apply_compile(causal_lm)
    if runtime is None:
        return CausalLMLoss(causal_lm, cfg)
    return apply_fsdp(CausalLMLoss(causal_lm.to(runtime.device), cfg, runtime.cp_group), runtime, cfg)
