"""The JAX backend (Flax NNX + optax): the same public names as ``twinseq.torch_backend``.

>>> from twinseq.common.config import ModelConfig
>>> from twinseq.common.init import init_weights
>>> from twinseq.common.batching import collate
>>> cfg = ModelConfig.preset("tiny")
>>> model = build_model(cfg, init_weights(cfg, seed=0))
>>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}], padding_free=True)
>>> logits(model, batch).shape
(1, 5, 8192)

``train`` is both a protocol function and a submodule (``jax_backend/train.py``); importing
the submodule would make Python bind it over the function, so ``_BackendModule`` keeps the
function (the same guard as ``twinseq.torch_backend``).

Every jitted function takes the model as ``(graphdef, state)`` (``nnx.split``), so it compiles
once per (B, T) bucket, loss type and chunk size; ``num_items_in_batch`` is traced.
"""

from __future__ import annotations

import sys
import types
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twinseq.common.batching import Batch
from twinseq.common.config import ModelConfig
from twinseq.jax_backend.losses import LOSS_TYPES, causal_lm_loss, check_labels, token_nll
from twinseq.jax_backend.model import DTYPES, LlamaForCausalLM, export_weights, in_hf_order, state_to_hf

__all__ = ["build_model", "export_weights", "logits", "loss_and_grads", "train",  # the backend protocol
           "token_losses", "loss_grads_and_metrics", "batch_inputs", "grads_jit", "loss_fn",
           "LlamaForCausalLM", "LOSS_TYPES"]


def build_model(cfg: ModelConfig, weights: dict[str, np.ndarray], *, dtype: str = "float32",
                remat_policy: str = "none") -> LlamaForCausalLM:
    """An NNX ``LlamaForCausalLM`` holding ``weights`` (HF names, torch layout, see ``init_weights``).

    ``dtype`` is the parameter and compute dtype (``float32`` or ``bfloat16``, as HF's
    ``torch_dtype``); ``remat_policy`` is one of ``remat.REMAT_POLICIES``.
    """
    return LlamaForCausalLM(cfg, weights, dtype=dtype, remat_policy=remat_policy)


def batch_inputs(batch: Batch, vocab_size: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(input_ids, position_ids, segment_ids, labels) as int32 device arrays, after range checks."""
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be a twinseq.common.batching.Batch (from collate), got {type(batch).__name__}.")
    ids = np.asarray(batch.input_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"input_ids hold values in [{ids.min()}, {ids.max()}], outside the vocabulary "
                         f"[0, {vocab_size}); fix the tokenisation or the model's vocab_size.")
    return tuple(jnp.asarray(a, jnp.int32) for a in  # type: ignore[return-value]
                 (batch.input_ids, batch.position_ids, batch.segment_ids, batch.labels))


@partial(jax.jit, static_argnums=(0,))
def _forward_jit(graphdef, state, input_ids_BT, position_ids_BT, segment_ids_BT, labels_BT):
    """(float32 logits [B, T, V], per-token NLL [B, T]) from one compiled forward pass."""
    model = nnx.merge(graphdef, state)
    hidden_BTH = model(input_ids_BT, position_ids_BT, segment_ids_BT)
    logits_BTV = (hidden_BTH @ model.lm_head_VH().T).astype(jnp.float32)
    return logits_BTV, token_nll(hidden_BTH, model.lm_head_VH(), labels_BT)


def logits(model: LlamaForCausalLM, batch: Batch) -> np.ndarray:
    """np.float32 [B, T, V]. Padding positions hold finite values that mean nothing."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward_jit(graphdef, state, *batch_inputs(batch, model.config.vocab_size))[0])


def token_losses(model: LlamaForCausalLM, batch: Batch) -> np.ndarray:
    """np.float32 [B, T]: the NLL of ``labels[:, t + 1]`` predicted at t; 0 where ignored."""
    check_labels(batch.labels, model.config.vocab_size, batch.num_items_in_batch)
    graphdef, state = nnx.split(model)
    return np.asarray(_forward_jit(graphdef, state, *batch_inputs(batch, model.config.vocab_size))[1])


def loss_fn(model: LlamaForCausalLM, input_ids_BT, position_ids_BT, segment_ids_BT, labels_BT,
            num_items_in_batch, loss_type: str = "nll", chunk_size: int = 256, *, attend=None,
            shifted: bool = False):
    """(loss, metrics) of one micro-batch; traceable, used by ``loss_and_grads`` and ``train``.

    ``attend``: the model's attention function (None: dense; see ``LlamaForCausalLM``);
    ``shifted``: ``labels_BT`` are already the targets (context-parallel batches).
    """
    hidden_BTH = model(input_ids_BT, position_ids_BT, segment_ids_BT, attend)
    return causal_lm_loss(hidden_BTH, model.lm_head_VH(), labels_BT, num_items_in_batch, loss_type,
                          chunk_size=chunk_size, return_metrics=True, shifted=shifted)


@partial(jax.jit, static_argnums=(0,),
         static_argnames=("loss_type", "chunk_size", "compute_dtype", "attend", "shifted"))
def grads_jit(graphdef, state, inputs, num_items, *, loss_type: str, chunk_size: int,
              compute_dtype: Optional[str] = None, attend=None, shifted: bool = False):
    """((loss, metrics), grads as an NNX state) of one micro-batch; ``inputs`` as ``batch_inputs`` returns.

    ``attend`` and ``shifted`` as ``loss_fn`` (the JAX trainer's context-parallel step passes
    ``sharding.ring_attention_fn(mesh)`` and the pre-shifted targets of ``sharding.shard_batch``).

    ``compute_dtype="bfloat16"`` runs the forward pass on bfloat16 copies of float32 ``state``
    (mixed precision, like torch autocast); the gradients stay float32, w.r.t. ``state``.
    """
    def scalar_loss(s):
        if compute_dtype is not None:
            s = jax.tree.map(lambda x: x.astype(DTYPES[compute_dtype]) if jnp.issubdtype(x.dtype, jnp.floating)
                             else x, s)
        return loss_fn(nnx.merge(graphdef, s), *inputs, num_items, loss_type, chunk_size, attend=attend,
                       shifted=shifted)

    return jax.value_and_grad(scalar_loss, has_aux=True)(state)


def loss_grads_and_metrics(model: LlamaForCausalLM, batch: Batch, loss_type: str = "nll",
                           chunk_size: int = 256) -> tuple[float, dict[str, np.ndarray], dict[str, float]]:
    """``loss_and_grads`` plus the loss metrics of ``twinseq.common.loss.metrics`` (as floats)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported by the JAX backend; choose one of {LOSS_TYPES}.")
    check_labels(batch.labels, model.config.vocab_size, batch.num_items_in_batch)
    graphdef, state = nnx.split(model)
    (loss, metrics), grads = grads_jit(graphdef, state, batch_inputs(batch, model.config.vocab_size),
                                       jnp.asarray(batch.num_items_in_batch, jnp.int32),
                                       loss_type=loss_type, chunk_size=int(chunk_size))
    grads_hf = in_hf_order(model.config, state_to_hf(grads))
    return float(loss), grads_hf, {k: float(v) for k, v in metrics.items()}


def loss_and_grads(model: LlamaForCausalLM, batch: Batch, loss_type: str = "nll",
                   chunk_size: int = 256) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, grads): grads are float32 numpy in HF names and HF ``[out, in]`` layout.

    The loss is normalised by ``batch.num_items_in_batch`` (the whole step's label count). With
    tied embeddings ``model.embed_tokens.weight`` carries both the embedding and the LM-head
    gradient, and there is no ``lm_head.weight`` entry (as torch's ``named_parameters``).
    """
    loss, grads, _ = loss_grads_and_metrics(model, batch, loss_type, chunk_size)
    return loss, grads


def train(cfg: Any) -> str:
    """Train from a ``TrainConfig``; returns the path of ``metrics.jsonl``."""
    from twinseq.jax_backend.train import train as _train

    return _train(cfg)


class _BackendModule(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return  # the import system binding a submodule over a protocol function of the same name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _BackendModule
