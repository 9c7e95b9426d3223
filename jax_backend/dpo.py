"""DPO on the JAX backend: the loss of a preference micro-batch and its reference pass, jitted.

The policy's sequence log-probs come from ``logprobs.sequence_logps`` with the token-loss kernel
``loss_type``; the loss family is ``common.objectives.dpo.dpo_family`` (written once, evaluated here with jnp
ops; TRL 1.16 semantics). A micro-batch's loss is ``Σ_n Σ_k w_k L_k[n] / examples_per_step``.
Every shape depends on (B, T, N) only, so a jitted step compiles once per bucket; the DPO loss
configuration (a frozen ``common.objectives.dpo.DPOLossConfig``) is a static argument.

Context parallelism (``mesh=``, a ``parallel.make_mesh`` mesh): the micro-batch's [B, T] arrays are sharded over
``cp`` on T in the zigzag order (targets shifted and their documents reordered first,
``parallel.shard_preference_batch``), attention is ``parallel.ring_attention_fn`` and the per-document sums of
``logprobs.sequence_logps`` add the shards' partial sums: the loss and gradients of one device.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from twinseq.common.backend import Model
from twinseq.common.config import DEFAULT_CHUNK_SIZE
from twinseq.common.data.batching import check_batch, pad_batch
from twinseq.common.data.preference_batching import PreferenceBatch
from twinseq.common.data.preference_steps import iter_preference_batches, with_ref_logps
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.dpo import ArrayOps, DPOLossConfig, dpo_family
from twinseq.jax_backend.logprobs import sequence_logps
from twinseq.jax_backend.losses import check_labels
from twinseq.jax_backend.model import (
    CausalLM,
    batch_inputs,
    batch_parents,
    cast_floating,
    grads_by_name,
    lora_dropout,
    merge_state,
    split_trainable,
)
from twinseq.jax_backend.parallel import (
    BATCH_AXES,
    CP_AXIS,
    ring_attention_fn,
    sequence_multiple,
    shard_params,
    shard_preference_batch,
)

logger = logging.getLogger(__name__)

JAX_OPS = ArrayOps(
    log_sigmoid=jax.nn.log_sigmoid,
    exp=jnp.exp,
    relu=lambda z: jnp.maximum(0.0, z),
    zeros_like=jnp.zeros_like,
    sort=lambda z: jnp.sort(z, axis=0),
)
PER_PAIR = ("losses", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards")


def dpo_losses(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    config: DPOLossConfig,
    *,
    chosen_num_tokens=None,
    rejected_num_tokens=None,
):
    """(per-pair ``Σ_k w_k L_k`` [N], ``β c`` [N], ``β r`` [N]) in jnp."""
    out = dpo_family(
        policy_chosen_logps - ref_chosen_logps,
        policy_rejected_logps - ref_rejected_logps,
        config,
        JAX_OPS,
        chosen_num_tokens=chosen_num_tokens,
        rejected_num_tokens=rejected_num_tokens,
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
    )
    return out.losses, out.chosen_rewards, out.rejected_rewards


def dpo_loss_fn(
    model: CausalLM,
    inputs,
    ref_chosen_logps,
    ref_rejected_logps,
    num_examples_in_step,
    *,
    config: DPOLossConfig,
    loss_type: str,
    chunk_size: int,
    attend=None,
    targets_are_shifted: bool = False,
):
    """(loss, per-pair dict) of one micro-batch; traceable. ``inputs`` as ``preference_inputs`` returns (or
    ``parallel.shard_preference_batch`` with ``attend=ring_attention_fn(mesh)`` and ``targets_are_shifted``)."""
    num_docs = inputs[-1].shape[0]
    n = num_docs // 2
    logps_D = _model_sequence_logps(model, inputs, loss_type, chunk_size, attend, targets_are_shifted)
    counts_D = inputs[-1]
    counts_D = counts_D.astype(jnp.float32)
    losses, cr, rr = dpo_losses(
        logps_D[:n],
        logps_D[n:],
        ref_chosen_logps,
        ref_rejected_logps,
        config,
        chosen_num_tokens=counts_D[:n],
        rejected_num_tokens=counts_D[n:],
    )
    loss = losses.sum() / jnp.asarray(num_examples_in_step, jnp.float32)
    return loss, dict(zip(PER_PAIR, (losses, logps_D[:n], logps_D[n:], cr, rr)))


def _model_sequence_logps(model: CausalLM, inputs, loss_type: str, chunk_size: int, attend, targets_are_shifted):
    """float32 [2N] sequence log-probs of ``model`` on ``inputs`` (``dpo_loss_fn``'s arguments); traceable."""
    input_ids, position_ids, segment_ids, labels, target_doc_ids, *parents, counts_D = inputs
    hidden_BTH = model(input_ids, position_ids, segment_ids, attend, *parents)
    return sequence_logps(
        hidden_BTH,
        model.lm_head_VH(),
        labels,
        target_doc_ids,
        counts_D.shape[0],
        loss_type,
        chunk_size,
        logit_softcap=model.final_logit_softcapping,
        targets_are_shifted=targets_are_shifted,
    )


# --------------------------------------------------------------------------------------
# Jitted steps and the model-level API
# --------------------------------------------------------------------------------------


def preference_inputs(pbatch: PreferenceBatch, vocab_size: int) -> tuple[jax.Array, ...]:
    """(input_ids, position_ids, segment_ids, labels, target_doc_ids, num_target_tokens) as int32 arrays; a
    batch with shared prompts (``collate_preference(..., share_prefix=True)``) has its ``parent_ids`` before
    ``num_target_tokens``."""
    check_labels(pbatch.batch.labels, vocab_size, pbatch.batch.num_items_in_batch)
    parents = batch_parents(pbatch.batch)
    return (
        *batch_inputs(pbatch.batch, vocab_size),
        jnp.asarray(pbatch.target_doc_ids, jnp.int32),
        *(() if parents is None else (parents,)),
        jnp.asarray(pbatch.num_target_tokens, jnp.int32),
    )


@partial(
    jax.jit,
    static_argnums=(0,),
    static_argnames=("config", "loss_type", "chunk_size", "compute_dtype", "attend", "targets_are_shifted"),
)
def dpo_grads_jit(
    graphdef,
    state,
    inputs,
    ref_chosen_logps,
    ref_rejected_logps,
    num_examples_in_step,
    *,
    config: DPOLossConfig,
    loss_type: str,
    chunk_size: int,
    compute_dtype: Optional[str] = None,
    frozen=None,
    dropout_key=None,
    attend=None,
    targets_are_shifted: bool = False,
):
    """((loss, per-pair dict), grads as an NNX state) of one micro-batch; ``frozen``: the state that gets no
    gradient (``model.split_trainable``: adapters train, their base does not); ``dropout_key``: LoRA dropout of
    the policy pass (``model.lora_dropout``; None: none); ``attend``, ``targets_are_shifted``: a context-parallel
    step's (``dpo_loss_fn``)."""

    def scalar_loss(s):
        model = merge_state(graphdef, cast_floating(s, compute_dtype), cast_floating(frozen, compute_dtype))
        with lora_dropout(dropout_key):
            return dpo_loss_fn(
                model,
                inputs,
                ref_chosen_logps,
                ref_rejected_logps,
                num_examples_in_step,
                config=config,
                loss_type=loss_type,
                chunk_size=chunk_size,
                attend=attend,
                targets_are_shifted=targets_are_shifted,
            )

    return jax.value_and_grad(scalar_loss, has_aux=True)(state)


@partial(
    jax.jit,
    static_argnums=(0,),
    static_argnames=("loss_type", "chunk_size", "compute_dtype", "attend", "targets_are_shifted"),
)
def sequence_logps_jit(
    graphdef,
    state,
    inputs,
    *,
    loss_type: str,
    chunk_size: int,
    compute_dtype: Optional[str] = None,
    frozen=None,
    attend=None,
    targets_are_shifted: bool = False,
) -> jax.Array:
    """[2N] sequence log-probs of a model (no gradient): the reference pass. ``frozen`` as ``dpo_grads_jit``
    (the PEFT reference: the graphdef of the same model with its adapters switched off); ``attend``,
    ``targets_are_shifted`` as ``dpo_loss_fn``."""
    model = merge_state(graphdef, cast_floating(state, compute_dtype), cast_floating(frozen, compute_dtype))
    return _model_sequence_logps(model, inputs, loss_type, chunk_size, attend, targets_are_shifted)


def step_inputs(
    pbatch: PreferenceBatch, vocab_size: int, mesh: Optional[Mesh] = None, strategy: str = "ring"
) -> tuple[tuple[jax.Array, ...], dict[str, Any]]:
    """(inputs, keywords) of ``dpo_grads_jit`` / ``sequence_logps_jit`` for one padded micro-batch: on one device
    ``preference_inputs`` and no keywords; on ``mesh`` the arrays of ``parallel.shard_preference_batch`` (T a
    multiple of ``2 * cp``, B of the data x fsdp replicas) with the ring attention and the pre-shifted targets."""
    if mesh is None:
        return preference_inputs(pbatch, vocab_size), {}
    if pbatch.batch.shares_prefix:
        raise ConfigError(
            "a preference batch with shared prompts (parent_ids) under context parallelism: "
            "parallel.shard_preference_batch does not carry parent_ids yet; pass share_prefix=False to "
            "collate_preference when context_parallel_size > 1."
        )
    check_labels(pbatch.batch.labels, vocab_size, pbatch.batch.num_items_in_batch)
    check_batch(pbatch.batch, vocab_size)
    keywords = dict(attend=ring_attention_fn(mesh, strategy), targets_are_shifted=True)
    return shard_preference_batch(pbatch, mesh), keywords


def pad_for_mesh(pbatch: PreferenceBatch, mesh: Optional[Mesh], multiple: int = 1) -> PreferenceBatch:
    """``pbatch`` padded to a multiple of ``multiple`` columns and, on ``mesh``, of ``2 * cp`` columns and of
    the data x fsdp replicas rows (padding rows: segment 0, no target); unchanged without either."""
    if mesh is None:
        return pbatch if multiple == 1 else pad_preference_batch(pbatch, multiple)
    replicas = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
    rows = -(-pbatch.batch.shape[0] // replicas) * replicas
    return pad_preference_batch(pbatch, sequence_multiple(multiple, mesh.shape[CP_AXIS]), rows=rows)


def _state_on(mesh: Optional[Mesh], *trees):
    """Each tree replicated on ``mesh`` (``parallel.shard_params``; fsdp is 1 here), or as is without one."""
    return trees if mesh is None else tuple(None if t is None else shard_params(mesh, t) for t in trees)


def compute_sequence_logps(
    model: Model, pbatch: PreferenceBatch, *, loss_type: str = "fused_linear", chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[np.ndarray, np.ndarray]:
    """(chosen [N], rejected [N]) float64 numpy sequence log-probs of ``model``."""
    return context_parallel_sequence_logps(model, pbatch, None, loss_type=loss_type, chunk_size=chunk_size)


def context_parallel_sequence_logps(
    model: Model,
    pbatch: PreferenceBatch,
    mesh: Optional[Mesh],
    *,
    strategy: str = "ring",
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """``compute_sequence_logps`` on ``mesh`` (a ``parallel.make_mesh`` mesh; None: one device) under context
    parallelism, attention by ``strategy`` (``ring`` or ``allgather``): the same log-probs."""
    graphdef, state = nnx.split(model)
    inputs, keywords = step_inputs(pad_for_mesh(pbatch, mesh), model.config.vocab_size, mesh, strategy)
    logps_D = np.asarray(
        sequence_logps_jit(
            graphdef, *_state_on(mesh, state), inputs, loss_type=loss_type, chunk_size=int(chunk_size), **keywords
        ),
        np.float64,
    )
    return logps_D[: pbatch.num_examples], logps_D[pbatch.num_examples :]


def _ref_arrays(pbatch: PreferenceBatch, ref_chosen, ref_rejected):
    ref_chosen = pbatch.ref_chosen_logps if ref_chosen is None else ref_chosen
    ref_rejected = pbatch.ref_rejected_logps if ref_rejected is None else ref_rejected
    if ref_chosen is None or ref_rejected is None:
        raise ConfigError(
            "no reference log-probs: pass ref_chosen_logps/ref_rejected_logps (a reference model's "
            "compute_sequence_logps) or precompute them into the rows (precompute_ref_log_probs=True)."
        )
    return tuple(jnp.asarray(np.asarray(a, np.float32).reshape(-1)) for a in (ref_chosen, ref_rejected))


def dpo_loss_and_grads(
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
    """(loss, float32 numpy gradients in HF names and layout, per-pair float64 outputs): the mirror of
    ``twinseq.torch_backend.dpo.dpo_loss_and_grads``. On a model with adapters the gradients are the adapters'
    only, by PEFT key; its reference is the same model with them switched off (``peft.adapters_disabled``)."""
    return context_parallel_dpo_loss_and_grads(
        model,
        pbatch,
        config,
        None,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        loss_type=loss_type,
        chunk_size=chunk_size,
        num_examples_in_step=num_examples_in_step,
    )


def context_parallel_dpo_loss_and_grads(
    model: Model,
    pbatch: PreferenceBatch,
    config: DPOLossConfig,
    mesh: Optional[Mesh],
    *,
    strategy: str = "ring",
    ref_chosen_logps: Any = None,
    ref_rejected_logps: Any = None,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_examples_in_step: Optional[int] = None,
) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``dpo_loss_and_grads`` on ``mesh`` (None: one device) under context parallelism, ``strategy`` as
    ``context_parallel_sequence_logps``: the same loss, gradients and per-pair outputs."""
    denom = pbatch.num_examples if num_examples_in_step is None else int(num_examples_in_step)
    if denom < pbatch.num_examples:
        raise ConfigError(
            f"num_examples_in_step={denom} is smaller than this micro-batch's {pbatch.num_examples} "
            f"pairs; pass the count of pairs of the whole optimizer step."
        )
    graphdef, state, frozen = split_trainable(model)
    state, frozen = _state_on(mesh, state, frozen)
    inputs, keywords = step_inputs(pad_for_mesh(pbatch, mesh), model.config.vocab_size, mesh, strategy)
    (loss, per_pair), grads = dpo_grads_jit(
        graphdef,
        state,
        inputs,
        *_ref_arrays(pbatch, ref_chosen_logps, ref_rejected_logps),
        jnp.asarray(denom, jnp.float32),
        config=config,
        loss_type=loss_type,
        chunk_size=int(chunk_size),
        frozen=frozen,
        **keywords,
    )
    return float(loss), grads_by_name(model, grads), {k: np.asarray(v, np.float64) for k, v in per_pair.items()}


def pad_preference_batch(pbatch: PreferenceBatch, multiple: int, rows: Optional[int] = None) -> PreferenceBatch:
    """The same pairs with columns padded to a multiple of ``multiple`` (padding: segment 0, label -100,
    target document -1), so that the step compiles once per length bucket; and to ``rows`` rows if given (a
    mesh's data replicas)."""
    b, t = pbatch.batch.shape
    batch = pad_batch(pbatch.batch, max(b, rows or b), multiple)
    width = batch.shape[1]
    target_doc_ids = np.pad(pbatch.target_doc_ids, ((0, batch.shape[0] - b), (0, width - t)), constant_values=-1)
    return dataclasses.replace(pbatch, batch=batch, target_doc_ids=target_doc_ids)


def precompute_ref_logps(
    model: CausalLM, rows: Any, cfg: Any, pad_token_id: int, bucket: int, mesh: Optional[Mesh] = None
) -> Any:
    """``rows`` plus ``ref_chosen_logps`` / ``ref_rejected_logps`` columns from one pass of ``model`` (on ``mesh``
    under context parallelism, with ``cfg.parallel.context_parallel_strategy``)."""
    d, loss = cfg.data, cfg.loss
    graphdef, state = nnx.split(model)
    (state,) = _state_on(mesh, state)
    compute_dtype = None if cfg.model.dtype == "float32" else cfg.model.dtype
    chosen, rejected = [], []
    for _, pbatch in iter_preference_batches(
        rows,
        d.per_device_train_batch_size,
        padding_free=d.padding_free,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=d.pad_to_multiple_of,
    ):
        pbatch = pad_for_mesh(pbatch, mesh, bucket)
        inputs, keywords = step_inputs(pbatch, model.config.vocab_size, mesh, cfg.parallel.context_parallel_strategy)
        logps_D = np.asarray(
            sequence_logps_jit(
                graphdef,
                state,
                inputs,
                loss_type=loss.loss_type,
                chunk_size=loss.loss_chunk_size,
                compute_dtype=compute_dtype,
                **keywords,
            ),
            np.float64,
        )
        chosen.append(logps_D[: pbatch.num_examples])
        rejected.append(logps_D[pbatch.num_examples :])
    return with_ref_logps(rows, np.concatenate(chosen), np.concatenate(rejected))
