"""GRPO under context parallelism on the JAX backend: the per-token log-probs of a completion micro-batch with every
row sharded over the mesh's ``cp`` axis.

The micro-batch's [B, T] arrays are reordered in the zigzag order and placed with ``parallel.batch_sharding``
(``parallel.shard_batch``: the targets shifted before the reorder), attention is the mesh's cp attention
(``parallel.ring_attention_fn``), and the ``[N, C]`` map from completion tokens to flattened positions points into
the reordered layout (``CPCompletionInputs.of``). The gather of the per-token log-probs into ``[N, C]`` then reads
each device's shard (XLA moves what it needs): the loss and gradients of one device. The GRPO loss and the entropy
kernel are passed in (``loss_fn``, ``entropy_fn``: ``grpo.grpo_loss_jax`` and ``grpo.chunked_entropy``), static.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twinseq.common.data.batching import pad_batch
from twinseq.common.data.context_parallel import cp_permutation, inverse_permutation
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.grpo import CompletionBatch
from twinseq.common.objectives.grpo_loss import LossSpec
from twinseq.jax_backend.logprobs import token_logps
from twinseq.jax_backend.losses import check_labels
from twinseq.jax_backend.model import CausalLM, cast_floating, lora_dropout, merge_state
from twinseq.jax_backend.parallel import CP_AXIS, shard_batch


@partial(jax.tree_util.register_dataclass, data_fields=["inputs", "flat_NC"], meta_fields=[])
@dataclasses.dataclass
class CPCompletionInputs:
    """A ``CompletionBatch`` sharded over ``cp``: (input_ids, position_ids, segment_ids, targets) in the zigzag order
    (targets shifted before the reorder), and ``flat_NC``, the flattened ``[B*T]`` position in that order whose
    target is completion i's token j (-1: none), replicated."""

    inputs: tuple
    flat_NC: jax.Array

    @classmethod
    def of(cls, cb: CompletionBatch, vocab_size: int, mesh: Mesh, rows: int, multiple: int) -> "CPCompletionInputs":
        """``rows`` x a multiple of ``multiple`` columns (a multiple of ``2 * cp``: ``parallel.sequence_multiple``)."""
        cp = mesh.shape[CP_AXIS]
        if multiple % (2 * cp):
            raise ConfigError(
                f"multiple={multiple} is not a multiple of 2 * cp = {2 * cp}; pass parallel.sequence_multiple's "
                f"column multiple."
            )
        batch = pad_batch(cb.batch, rows, multiple)
        check_labels(batch.labels, vocab_size, max(int((batch.labels != -100).sum()), 1))
        arrays = shard_batch(batch, mesh)
        return cls(
            tuple(arrays[k] for k in ("input_ids", "position_ids", "segment_ids", "targets")),
            jax.device_put(reordered_flat_NC(cb, batch.shape, cp), NamedSharding(mesh, P())),
        )


def reordered_flat_NC(cb: CompletionBatch, shape: tuple[int, int], cp: int) -> np.ndarray:
    """int32 [N, C]: the flattened position, in the zigzag order of a ``shape`` [B, T] batch, whose target is
    completion i's token j (-1: none)."""
    b, t = cb.target_doc_ids.shape
    target_doc = np.pad(cb.target_doc_ids, ((0, shape[0] - b), (0, shape[1] - t)), constant_values=-1)
    flat_n = np.flatnonzero(target_doc.reshape(-1) >= 0)  # token order = the order of token_row/col_n
    inv_T = inverse_permutation(cp_permutation(shape[1], cp))
    row_n, col_n = np.divmod(flat_n, shape[1])
    flat_NC = np.full((cb.num_docs, cb.num_columns), -1, np.int32)
    flat_NC[cb.token_row_n, cb.token_col_n] = row_n * shape[1] + inv_T[col_n]
    return flat_NC


def cp_completion_logps(
    model: CausalLM,
    ci: CPCompletionInputs,
    attend: Callable,
    entropy_fn: Callable,
    *,
    loss_type: str,
    chunk_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[jax.Array, Optional[jax.Array]]:
    """(log-probs [N, C], entropy [N, C] or None) of each completion token of a sharded micro-batch: the mirror of
    ``grpo.completion_logps`` (its naive equivalent) with the cp attention ``attend`` and pre-shifted targets;
    ``entropy_fn``: ``grpo.chunked_entropy``. Traceable."""
    cap = model.final_logit_softcapping
    input_ids, position_ids, segment_ids, targets = ci.inputs
    hidden_BTH = model(input_ids, position_ids, segment_ids, attend)
    if temperature != 1.0:
        hidden_BTH = hidden_BTH / jnp.asarray(temperature, hidden_BTH.dtype)  # (h / T) @ W.T = logits / T
    logps_n = token_logps(
        hidden_BTH, model.lm_head_VH(), targets, loss_type, chunk_size, logit_softcap=cap, targets_are_shifted=True
    )
    flat = jnp.maximum(ci.flat_NC, 0)
    logps_NC = jnp.where(ci.flat_NC >= 0, logps_n[flat], 0.0)
    if not with_entropy:
        return logps_NC, None
    hidden_nH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])[flat.reshape(-1)]
    entropy_n = entropy_fn(hidden_nH, model.lm_head_VH(), chunk_size, cap, grad=entropy_grad)
    return logps_NC, jnp.where(ci.flat_NC >= 0, entropy_n.reshape(ci.flat_NC.shape), 0.0)


_STATIC = ("loss_fn", "entropy_fn", "attend", "spec", "loss_type", "chunk_size", "temperature", "compute_dtype")


@partial(jax.jit, static_argnums=(0,), static_argnames=_STATIC)
def cp_grpo_grads_jit(
    graphdef,
    state,
    ci: CPCompletionInputs,
    mask_NC,
    advantages_N,
    norms,
    old_logps_NC=None,
    ref_logps_NC=None,
    *,
    loss_fn: Callable,
    entropy_fn: Callable,
    attend: Callable,
    spec: LossSpec,
    loss_type: str,
    chunk_size: int,
    temperature: float,
    compute_dtype: Optional[str] = None,
    frozen=None,
    dropout_key=None,
):
    """((loss, metrics), grads) of one sharded micro-batch: ``grpo.grpo_grads_jit`` with ``cp_completion_logps``;
    ``loss_fn``: ``grpo.grpo_loss_jax``."""

    def scalar_loss(s):
        model = merge_state(graphdef, cast_floating(s, compute_dtype), cast_floating(frozen, compute_dtype))
        with lora_dropout(dropout_key):
            logps_NC, entropy_NC = cp_completion_logps(
                model,
                ci,
                attend,
                entropy_fn,
                loss_type=loss_type,
                chunk_size=chunk_size,
                temperature=temperature,
                with_entropy=True,
                entropy_grad=spec.entropy_bonus,
            )
        assert entropy_NC is not None
        loss, metrics = loss_fn(
            logps_NC.astype(jnp.float32),
            advantages_N,
            mask_NC,
            norms,
            spec,
            old_logps_NC=old_logps_NC,
            ref_logps_NC=ref_logps_NC,
            entropy_NC=entropy_NC,
        )
        metrics["entropy_sum"] = jax.lax.stop_gradient(entropy_NC * mask_NC).sum()
        return loss, metrics

    return jax.value_and_grad(scalar_loss, has_aux=True)(state)


@partial(
    jax.jit,
    static_argnums=(0,),
    static_argnames=("entropy_fn", "attend", "loss_type", "chunk_size", "temperature", "compute_dtype"),
)
def cp_completion_logps_jit(
    graphdef,
    state,
    ci: CPCompletionInputs,
    *,
    entropy_fn: Callable,
    attend: Callable,
    loss_type: str,
    chunk_size: int,
    temperature: float,
    compute_dtype: Optional[str] = None,
    frozen=None,
    dropout_key=None,
) -> jax.Array:
    """float32 [N, C] log-probs of a sharded micro-batch, no gradient: ``grpo.completion_logps_jit``'s mirror."""
    model = merge_state(graphdef, cast_floating(state, compute_dtype), cast_floating(frozen, compute_dtype))
    with lora_dropout(dropout_key):
        logps_NC = cp_completion_logps(
            model, ci, attend, entropy_fn, loss_type=loss_type, chunk_size=chunk_size, temperature=temperature
        )[0]
    return logps_NC.astype(jnp.float32)
