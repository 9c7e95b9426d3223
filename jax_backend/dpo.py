"""DPO for the JAX backend: the same log-probs, loss family and trainer as ``torch_backend/dpo.py``.

The sequence log-prob of document d is ``Σ log softmax(hidden[t] @ W.T)[labels[t + 1]]`` over
the positions t with ``target_doc_ids[t] == d`` (``common.dpo_batching``), chosen documents
first. ``loss_type`` picks the per-token kernel, as for SFT:

``nll``           full logits ``[B*T, V]`` (the baseline);
``chunked_nll``   ``jax.lax.scan`` over token chunks, each under ``jax.checkpoint``;
``fused_linear``  a ``jax.custom_vjp``: forward scans token chunks and keeps only the
                  per-token logsumexp; backward scans *vocabulary* chunks, recomputes
                  ``logits[:, rows]`` and forms ``g_t (onehot - softmax)`` by hand, writing
                  ``dW[rows]`` in place. Nothing of size ``[tokens, V]`` and no second ``[V, H]``.

Every shape depends on (B, T, N) only, so a jitted step compiles once per bucket; the DPO
loss configuration (a frozen ``common.dpo.DPOLossConfig``) is a static argument.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twinseq.common.batching import IGNORE_INDEX
from twinseq.common.config import TrainConfig
from twinseq.common.dpo import DPOLossConfig, reward_metrics, validate_dpo_config
from twinseq.common.dpo_batching import PreferenceBatch
from twinseq.jax_backend.losses import shift_labels
from twinseq.jax_backend.model import DTYPES, LlamaForCausalLM, in_hf_order, state_to_hf

logger = logging.getLogger(__name__)

LOGPS_LOSS_TYPES = ("nll", "chunked_nll", "fused_linear")
DEFAULT_CHUNK_SIZE = 256
PER_PAIR = ("losses", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards")


# --------------------------------------------------------------------------------------
# Per-token log-probs of the targets
# --------------------------------------------------------------------------------------


def _logits_f32(hidden_NH: jax.Array, lm_head_VH: jax.Array) -> jax.Array:
    return (hidden_NH @ lm_head_VH.T).astype(jnp.float32)


def _picked_logps(logits_NV: jax.Array, targets_N: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(target log-prob, logsumexp) in torch's ``log_softmax`` order ``(x_t - max) - log Σ exp(x - max)``;
    0 where the target is -100."""
    valid_N = targets_N != IGNORE_INDEX
    safe_N = jnp.where(valid_N, targets_N, 0)
    max_N = jax.lax.stop_gradient(jnp.max(logits_NV, axis=-1))
    log_sum_N = jnp.log(jnp.sum(jnp.exp(logits_NV - max_N[:, None]), axis=-1))
    picked_N = jnp.take_along_axis(logits_NV, safe_N[:, None], axis=-1)[:, 0] - max_N
    return jnp.where(valid_N, picked_N - log_sum_N, 0.0), jax.lax.stop_gradient(log_sum_N + max_N)


def _to_chunks(hidden_NH, targets_N, chunk_size: int):
    """[N, H], [N] -> [C, S, H], [C, S]; the tail is padded with ignored targets."""
    n, h = hidden_NH.shape
    num_chunks = max(1, -(-n // chunk_size))
    pad = num_chunks * chunk_size - n
    hidden_NH = jnp.concatenate([hidden_NH, jnp.zeros((pad, h), hidden_NH.dtype)])
    targets_N = jnp.concatenate([targets_N, jnp.full((pad,), IGNORE_INDEX, targets_N.dtype)])
    return hidden_NH.reshape(num_chunks, chunk_size, h), targets_N.reshape(num_chunks, chunk_size)


def _scan_logps(hidden_NH, lm_head_VH, targets_N, chunk_size: int, remat: bool):
    """(logp [N], lse [N]) over token chunks; one chunk's logits at a time."""
    n = hidden_NH.shape[0]
    hidden_CSH, targets_CS = _to_chunks(hidden_NH, targets_N, chunk_size)

    def chunk(h_SH, w_VH, t_S):
        return _picked_logps(_logits_f32(h_SH, w_VH), t_S)

    chunk_fn = jax.checkpoint(chunk) if remat else chunk
    _, (logp_CS, lse_CS) = jax.lax.scan(lambda carry, xs: (carry, chunk_fn(xs[0], lm_head_VH, xs[1])), None,
                                        (hidden_CSH, targets_CS))
    return logp_CS.reshape(-1)[:n], lse_CS.reshape(-1)[:n]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_logps(hidden_NH, lm_head_VH, targets_N, chunk_size: int) -> jax.Array:
    return _scan_logps(hidden_NH, lm_head_VH, targets_N, chunk_size, remat=False)[0]


def _fused_fwd(hidden_NH, lm_head_VH, targets_N, chunk_size: int):
    logp_N, lse_N = _scan_logps(hidden_NH, lm_head_VH, targets_N, chunk_size, remat=False)
    return logp_N, (hidden_NH, lm_head_VH, targets_N, lse_N)


def _fused_bwd(chunk_size: int, residuals, g_N):
    """``dlogits = g_t (onehot - softmax)`` over vocabulary chunks of as many rows as a forward chunk
    holds tokens; the last chunk overlaps the previous one (dW is overwritten, dh counts once)."""
    hidden_NH, lm_head_VH, targets_N, lse_N = residuals
    (n, h), v = hidden_NH.shape, lm_head_VH.shape[0]
    num_chunks = min(v, max(1, -(-n // chunk_size)))
    rows = -(-v // num_chunks)
    scale_N = jnp.where(targets_N != IGNORE_INDEX, g_N, 0.0).astype(jnp.float32)

    def step(carry, c):
        dh_NH, dw_VH = carry
        nominal = c * rows
        start = jnp.minimum(nominal, v - rows)
        w_RH = jax.lax.dynamic_slice_in_dim(lm_head_VH, start, rows, axis=0)
        cols_R = start + jnp.arange(rows)
        probs_NR = jnp.exp(_logits_f32(hidden_NH, w_RH) - lse_N[:, None])
        dlogits_NR = ((targets_N[:, None] == cols_R[None, :]) - probs_NR) * scale_N[:, None]
        dlogits_NR = dlogits_NR.astype(hidden_NH.dtype)
        dw_VH = jax.lax.dynamic_update_slice_in_dim(dw_VH, (dlogits_NR.T @ hidden_NH).astype(dw_VH.dtype),
                                                    start, axis=0)
        fresh_NR = jnp.where((cols_R >= nominal)[None, :], dlogits_NR, 0)
        return (dh_NH + (fresh_NR @ w_RH).astype(jnp.float32), dw_VH), None

    init = (jnp.zeros((n, h), jnp.float32), jnp.zeros(lm_head_VH.shape, lm_head_VH.dtype))
    (dh_NH, dw_VH), _ = jax.lax.scan(step, init, jnp.arange(num_chunks))
    return dh_NH.astype(hidden_NH.dtype), dw_VH, None


_fused_logps.defvjp(_fused_fwd, _fused_bwd)


def token_logps(hidden_BTH: jax.Array, lm_head_VH: jax.Array, labels_BT: jax.Array,
                loss_type: str = "fused_linear", chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
    """float32 [B*T]: log-prob of ``labels[t + 1]`` at t (flattened), 0 where the target is -100.

    Naive equivalent: ``log_softmax(hidden @ W.T)[..., shift_labels(labels)]``.
    """
    if loss_type not in LOGPS_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported by the JAX DPO log-probs; choose one of "
                         f"{LOGPS_LOSS_TYPES}.")
    if int(chunk_size) <= 0:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer (tokens per chunk).")
    hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
    targets_N = shift_labels(labels_BT).reshape(-1)
    if loss_type == "nll":
        return _picked_logps(_logits_f32(hidden_NH, lm_head_VH), targets_N)[0]
    if loss_type == "chunked_nll":
        return _scan_logps(hidden_NH, lm_head_VH, targets_N, int(chunk_size), remat=True)[0]
    return _fused_logps(hidden_NH, lm_head_VH, targets_N, int(chunk_size))


def sequence_logps(hidden_BTH, lm_head_VH, labels_BT, target_doc_ids_BT, num_docs: int,
                   loss_type: str = "fused_linear", chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
    """float32 [2N]: per-document sums of the target log-probs (``common.dpo_batching``'s rule)."""
    logp_N = token_logps(hidden_BTH, lm_head_VH, labels_BT, loss_type, chunk_size)
    doc_N = target_doc_ids_BT.reshape(-1)
    # -1 (no target) goes to an extra segment that is dropped
    seg_N = jnp.where(doc_N >= 0, doc_N, num_docs)
    return jax.ops.segment_sum(jnp.where(doc_N >= 0, logp_N, 0.0), seg_N, num_segments=num_docs + 1)[:num_docs]


# --------------------------------------------------------------------------------------
# The DPO loss family (common.dpo in jnp)
# --------------------------------------------------------------------------------------


def _family(c, r, beta: float, eps: float, n_c, n_r) -> dict[str, Any]:
    ls = jax.nn.log_sigmoid
    x = beta * (c - r)
    half = 0.5 / beta

    def exo():
        log_qw, log_ql = ls(x), ls(-x)
        return jnp.exp(log_qw) * (log_qw - math.log1p(-eps)) + jnp.exp(log_ql) * (log_ql - math.log(eps))

    return {
        "sigmoid": lambda: -ls(x),
        "hinge": lambda: jnp.maximum(0.0, 1.0 - x),
        "ipo": lambda: (c / n_c - r / n_r - half) ** 2,
        "exo_pair": exo,
        "nca_pair": lambda: -ls(beta * c) - 0.5 * ls(-beta * c) - 0.5 * ls(-beta * r),
        "robust": lambda: (-(1.0 - eps) * ls(x) + eps * ls(-x)) / (1.0 - 2.0 * eps),
        "bco_pair": lambda: -ls(beta * c) - ls(-beta * r),
        "sppo_hard": lambda: (c - half) ** 2 + (r + half) ** 2,
        "apo_zero": lambda: jnp.exp(ls(-beta * c)) + jnp.exp(ls(beta * r)),
        "apo_down": lambda: jnp.exp(ls(beta * c)) + jnp.exp(ls(-x)),
    }


def dpo_losses(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
               config: DPOLossConfig, *, chosen_num_tokens=None, rejected_num_tokens=None):
    """(per-pair ``Σ_k w_k L_k`` [N], ``β c`` [N], ``β r`` [N]): the jnp mirror of ``common.dpo.dpo_loss``."""
    c, r = policy_chosen_logps - ref_chosen_logps, policy_rejected_logps - ref_rejected_logps
    if "ipo" in config.loss_type and (chosen_num_tokens is None or rejected_num_tokens is None):
        raise ValueError("loss_type 'ipo' normalises by completion length and needs chosen_num_tokens and "
                         "rejected_num_tokens (PreferenceBatch.chosen_num_tokens / rejected_num_tokens).")
    family = _family(c, r, config.beta, config.label_smoothing, chosen_num_tokens, rejected_num_tokens)
    by_type = {t: family[t]() for t in dict.fromkeys(config.loss_type)}
    losses = jnp.zeros_like(c)
    for t, w in zip(config.loss_type, config.loss_weights):
        losses = losses + w * by_type[t]
    return losses, config.beta * c, config.beta * r


def dpo_loss_fn(model: LlamaForCausalLM, inputs, ref_chosen_logps, ref_rejected_logps, num_examples_in_step, *,
                config: DPOLossConfig, loss_type: str, chunk_size: int):
    """(loss, per-pair dict) of one micro-batch; traceable. ``inputs`` as ``preference_inputs`` returns."""
    input_ids, position_ids, segment_ids, labels, target_doc_ids, counts_D = inputs
    num_docs = counts_D.shape[0]
    n = num_docs // 2
    hidden_BTH = model(input_ids, position_ids, segment_ids)
    logps_D = sequence_logps(hidden_BTH, model.lm_head_VH(), labels, target_doc_ids, num_docs, loss_type, chunk_size)
    counts_D = counts_D.astype(jnp.float32)
    losses, cr, rr = dpo_losses(logps_D[:n], logps_D[n:], ref_chosen_logps, ref_rejected_logps, config,
                                chosen_num_tokens=counts_D[:n], rejected_num_tokens=counts_D[n:])
    loss = losses.sum() / jnp.asarray(num_examples_in_step, jnp.float32)
    return loss, dict(zip(PER_PAIR, (losses, logps_D[:n], logps_D[n:], cr, rr)))


# --------------------------------------------------------------------------------------
# Jitted steps and the model-level API
# --------------------------------------------------------------------------------------


def preference_inputs(pbatch: PreferenceBatch, vocab_size: int) -> tuple[jax.Array, ...]:
    """(input_ids, position_ids, segment_ids, labels, target_doc_ids, num_target_tokens) as int32 arrays."""
    from twinseq.jax_backend import batch_inputs
    from twinseq.jax_backend.losses import check_labels

    check_labels(pbatch.batch.labels, vocab_size, pbatch.batch.num_items_in_batch)
    return (*batch_inputs(pbatch.batch, vocab_size), jnp.asarray(pbatch.target_doc_ids, jnp.int32),
            jnp.asarray(pbatch.num_target_tokens, jnp.int32))


def _cast(state, compute_dtype: Optional[str]):
    if compute_dtype is None:
        return state
    return jax.tree.map(lambda x: x.astype(DTYPES[compute_dtype]) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        state)


@partial(jax.jit, static_argnums=(0,), static_argnames=("config", "loss_type", "chunk_size", "compute_dtype"))
def dpo_grads_jit(graphdef, state, inputs, ref_chosen_logps, ref_rejected_logps, num_examples_in_step, *,
                  config: DPOLossConfig, loss_type: str, chunk_size: int, compute_dtype: Optional[str] = None):
    """((loss, per-pair dict), grads as an NNX state) of one micro-batch."""
    def scalar_loss(s):
        return dpo_loss_fn(nnx.merge(graphdef, _cast(s, compute_dtype)), inputs, ref_chosen_logps,
                           ref_rejected_logps, num_examples_in_step, config=config, loss_type=loss_type,
                           chunk_size=chunk_size)

    return jax.value_and_grad(scalar_loss, has_aux=True)(state)


@partial(jax.jit, static_argnums=(0,), static_argnames=("loss_type", "chunk_size", "compute_dtype"))
def sequence_logps_jit(graphdef, state, inputs, *, loss_type: str, chunk_size: int,
                       compute_dtype: Optional[str] = None) -> jax.Array:
    """[2N] sequence log-probs of a model (no gradient): the reference pass."""
    model = nnx.merge(graphdef, _cast(state, compute_dtype))
    input_ids, position_ids, segment_ids, labels, target_doc_ids, counts_D = inputs
    hidden_BTH = model(input_ids, position_ids, segment_ids)
    return sequence_logps(hidden_BTH, model.lm_head_VH(), labels, target_doc_ids, counts_D.shape[0], loss_type,
                          chunk_size)


def compute_sequence_logps(model: LlamaForCausalLM, pbatch: PreferenceBatch, *, loss_type: str = "fused_linear",
                           chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(chosen [N], rejected [N]) float64 numpy sequence log-probs of ``model``."""
    graphdef, state = nnx.split(model)
    logps_D = np.asarray(sequence_logps_jit(graphdef, state, preference_inputs(pbatch, model.config.vocab_size),
                                            loss_type=loss_type, chunk_size=int(chunk_size)), np.float64)
    return logps_D[:pbatch.num_examples], logps_D[pbatch.num_examples:]


def _ref_arrays(pbatch: PreferenceBatch, ref_chosen, ref_rejected):
    ref_chosen = pbatch.ref_chosen_logps if ref_chosen is None else ref_chosen
    ref_rejected = pbatch.ref_rejected_logps if ref_rejected is None else ref_rejected
    if ref_chosen is None or ref_rejected is None:
        raise ValueError("no reference log-probs: pass ref_chosen_logps/ref_rejected_logps (a reference model's "
                         "compute_sequence_logps) or precompute them into the rows (precompute_ref_log_probs=True).")
    return tuple(jnp.asarray(np.asarray(a, np.float32).reshape(-1)) for a in (ref_chosen, ref_rejected))


def dpo_loss_and_grads(model: LlamaForCausalLM, pbatch: PreferenceBatch, config: DPOLossConfig, *,
                       ref_chosen_logps=None, ref_rejected_logps=None, loss_type: str = "fused_linear",
                       chunk_size: int = DEFAULT_CHUNK_SIZE, num_examples_in_step: Optional[int] = None
                       ) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(loss, float32 numpy gradients in HF names and layout, per-pair float64 outputs): the mirror of
    ``twinseq.torch_backend.dpo.dpo_loss_and_grads``."""
    denom = pbatch.num_examples if num_examples_in_step is None else int(num_examples_in_step)
    if denom < pbatch.num_examples:
        raise ValueError(f"num_examples_in_step={denom} is smaller than this micro-batch's {pbatch.num_examples} "
                         f"pairs; it must count the pairs of the whole optimizer step.")
    graphdef, state = nnx.split(model)
    (loss, per_pair), grads = dpo_grads_jit(
        graphdef, state, preference_inputs(pbatch, model.config.vocab_size),
        *_ref_arrays(pbatch, ref_chosen_logps, ref_rejected_logps), jnp.asarray(denom, jnp.float32),
        config=config, loss_type=loss_type, chunk_size=int(chunk_size))
    grads_hf = in_hf_order(model.config, state_to_hf(grads))
    return float(loss), grads_hf, {k: np.asarray(v, np.float64) for k, v in per_pair.items()}


# --------------------------------------------------------------------------------------
# Trainer: `twinseq train --task dpo --backend jax`
# --------------------------------------------------------------------------------------


def validate_dpo_runtime(cfg: TrainConfig) -> DPOLossConfig:
    """Refuse what the JAX DPO trainer cannot do, before any work; returns the loss config."""
    if cfg.loss_type == "liger":
        raise ValueError("loss_type='liger' (or use_liger_kernel=True) is a CUDA kernel of the torch backend; "
                         "with --backend jax use --loss-type fused_linear, which never materialises the logits.")
    if cfg.packing:
        raise ValueError("packing=True does not apply to DPO (it would cut pairs apart); use --padding-free.")
    if cfg.torch_compile:
        raise ValueError("torch_compile=True is a torch option; the jax backend always compiles with jax.jit.")
    if cfg.context_parallel_size > 1:
        raise ValueError(f"context_parallel_size={cfg.context_parallel_size} is not implemented for task='dpo'; "
                         f"use --context-parallel-size 1 (DPO runs on one device).")
    if cfg.activation_offloading and jax.devices()[0].platform == "cpu":
        raise ValueError("activation_offloading=True moves activations from accelerator to host memory and has "
                         "no meaning on a CPU-only run; drop --activation-offloading or run on a GPU/TPU.")
    return validate_dpo_config(list(cfg.dpo_loss_type), cfg.loss_weights, cfg.beta, cfg.label_smoothing)


def pad_preference_batch(pbatch: PreferenceBatch, multiple: int) -> PreferenceBatch:
    """The same pairs with columns padded to a multiple of ``multiple`` (padding: segment 0, label -100,
    target document -1), so that the step compiles once per length bucket."""
    import dataclasses

    from twinseq.jax_backend.train import pad_batch

    b, t = pbatch.batch.shape
    batch = pad_batch(pbatch.batch, b, multiple)
    width = batch.shape[1]
    target_doc_ids = np.pad(pbatch.target_doc_ids, ((0, 0), (0, width - t)), constant_values=-1)
    return dataclasses.replace(pbatch, batch=batch, target_doc_ids=target_doc_ids)


def _dpo_trainer_class():
    """``DPOTrainer`` subclasses the SFT ``Trainer`` (optimizer, apply_updates, save/load), imported lazily
    so that this module's loss and log-prob functions do not need the trainer module."""
    from twinseq.jax_backend.train import Trainer, _add, apply_updates

    class DPOTrainer(Trainer):
        """One DPO optimizer step per ``step(pbatches)``; the live reference is a frozen copy of the
        initial parameters (``ref_params``), unless the batches carry precomputed log-probs."""

        def __init__(self, model, cfg: TrainConfig, config: DPOLossConfig, examples_per_step: int,
                     live_reference: bool) -> None:
            super().__init__(model, cfg)
            self.config, self.examples_per_step = config, examples_per_step
            self.compute_dtype = None if cfg.dtype == "float32" else cfg.dtype
            self.ref_params = jax.tree.map(jnp.copy, self.params) if live_reference else None

        def reference(self, pbatch: PreferenceBatch, inputs):
            if self.ref_params is None:
                return _ref_arrays(pbatch, None, None)
            logps_D = sequence_logps_jit(self.graphdef, self.ref_params, inputs, loss_type=self.cfg.loss_type,
                                         chunk_size=self.cfg.loss_chunk_size, compute_dtype=self.compute_dtype)
            return logps_D[:pbatch.num_examples], logps_D[pbatch.num_examples:]

        def _micro(self, pbatch: PreferenceBatch):
            pbatch = pad_preference_batch(pbatch, self.bucket)
            inputs = preference_inputs(pbatch, self.vocab_size)
            ref_c, ref_r = self.reference(pbatch, inputs)
            return dpo_grads_jit(self.graphdef, self.params, inputs, ref_c, ref_r,
                                 jnp.asarray(self.examples_per_step, jnp.float32), config=self.config,
                                 loss_type=self.cfg.loss_type, chunk_size=self.cfg.loss_chunk_size,
                                 compute_dtype=self.compute_dtype)

        def step(self, pbatches: list[PreferenceBatch]) -> dict[str, Any]:  # type: ignore[override]
            total_loss, grads, per_pair = 0.0, None, {k: [] for k in PER_PAIR}
            for pbatch in pbatches:
                (loss, pairs), micro_grads = self._micro(pbatch)
                grads = micro_grads if grads is None else _add(grads, micro_grads)
                total_loss += float(loss)
                for k in PER_PAIR:
                    per_pair[k].append(np.asarray(pairs[k], np.float64))
            lr = float(self._lr(self.steps_done))
            self.params, self.opt_state, grad_norm = apply_updates(self.optimizer, self.params, self.opt_state,
                                                                   grads)
            self.steps_done += 1
            cat = {k: np.concatenate(v) for k, v in per_pair.items()}
            return {"loss": total_loss, "lr": lr, "num_tokens": sum(pb.batch.num_tokens for pb in pbatches),
                    "num_label_tokens": sum(pb.batch.num_label_tokens for pb in pbatches),
                    "num_pairs": sum(pb.num_examples for pb in pbatches),
                    **reward_metrics(cat["chosen_rewards"], cat["rejected_rewards"]),
                    "logps/chosen": float(cat["chosen_logps"].mean()),
                    "logps/rejected": float(cat["rejected_logps"].mean()), "grad_norm": float(grad_norm)}

    return DPOTrainer


def precompute_ref_logps(model: LlamaForCausalLM, rows: Any, cfg: TrainConfig, pad_token_id: int,
                         bucket: int) -> Any:
    """``rows`` plus ``ref_chosen_logps`` / ``ref_rejected_logps`` columns from one pass of ``model``."""
    from twinseq.common.dpo_loader import iter_preference_batches, with_ref_logps

    graphdef, state = nnx.split(model)
    compute_dtype = None if cfg.dtype == "float32" else cfg.dtype
    chosen, rejected = [], []
    for _, pbatch in iter_preference_batches(rows, cfg.per_device_train_batch_size, padding_free=cfg.padding_free,
                                             pad_token_id=pad_token_id, pad_to_multiple_of=cfg.pad_to_multiple_of):
        pbatch = pad_preference_batch(pbatch, bucket)
        logps_D = np.asarray(sequence_logps_jit(graphdef, state, preference_inputs(pbatch, model.config.vocab_size),
                                                loss_type=cfg.loss_type, chunk_size=cfg.loss_chunk_size,
                                                compute_dtype=compute_dtype), np.float64)
        chosen.append(logps_D[:pbatch.num_examples])
        rejected.append(logps_D[pbatch.num_examples:])
    return with_ref_logps(rows, np.concatenate(chosen), np.concatenate(rejected))


def train_dpo(cfg: TrainConfig) -> Path:
    """Run ``cfg.max_steps`` DPO optimizer steps; returns the path of ``metrics.jsonl``."""
    from twinseq.common.data import prepare_dpo_dataset
    from twinseq.common.dpo_loader import build_preference_iterator
    from twinseq.common.metrics import RunLogger
    from twinseq.jax_backend.train import DEFAULT_BUCKET, build_training_model, run_steps

    config = validate_dpo_runtime(cfg)
    rows, tokenizer, stats = prepare_dpo_dataset(cfg)
    model = build_training_model(cfg, tokenizer.vocab_size)
    if cfg.precompute_ref_log_probs:  # the initial model, before any checkpoint is loaded
        t0 = time.perf_counter()
        rows = precompute_ref_logps(model, rows, cfg, tokenizer.pad_token_id, cfg.pad_to_multiple_of or DEFAULT_BUCKET)
        logger.info("precomputed reference log-probs of %d pairs in %.1fs", len(rows), time.perf_counter() - t0)
    iterator = build_preference_iterator(cfg, rows, tokenizer.pad_token_id)
    trainer = _dpo_trainer_class()(model, cfg, config, iterator.examples_per_step,
                                   live_reference=not cfg.precompute_ref_log_probs)
    if cfg.resume_from_checkpoint:
        iterator.load_state_dict(trainer.load(cfg.resume_from_checkpoint)["data"])
    start = trainer.steps_done
    log = RunLogger(cfg.output_dir, cfg.max_steps, disable_tqdm=cfg.disable_tqdm, desc="dpo[jax]", resume_step=start)
    log.write(f"twinseq jax dpo: {jax.devices()[0]}, dpo_loss_type={list(config.loss_type)}, beta={config.beta}, "
              f"logps kernel={cfg.loss_type}, padding_free={cfg.padding_free}, reference="
              f"{'precomputed' if cfg.precompute_ref_log_probs else 'live copy'}, "
              f"{iterator.examples_per_step} pairs per step; data: {stats}")
    return run_steps(cfg, trainer, iterator, tokenizer, log, start,
                     plot_keys=("loss", "rewards/accuracies", "tokens_per_second"))
