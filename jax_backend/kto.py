"""KTO on the JAX backend: the loss of an unpaired micro-batch, jitted, its reference, the trainer and its builder.

The mirror of ``torch_backend/kto.py``. A micro-batch (``common.data.unpaired.KTOBatch``) holds N completions then
M mismatched pairs (M = N, or 0 for ``apo_zero_unpaired``), padded or padding-free; their sequence log-probs come
from ``logprobs.sequence_logps`` (DPO's kernels). The loss family is ``common.objectives.kto.kto_family`` run with
DPO's jnp ops (``dpo.JAX_OPS``); the KL estimate ``z`` is held constant (``jax.lax.stop_gradient``). A
micro-batch's loss is its rows' summed losses over the rows of the whole optimizer step. N is the length of the
labels array, so every shape depends on (B, T, N, M) only and the loss configuration is a static argument. The
reference is a frozen copy of the initial parameters, the same parameters with the adapters switched off (PEFT),
or precomputed columns: ``trainer.DPOTrainer``'s.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twinseq.common.backend import Model
from twinseq.common.config import DEFAULT_CHUNK_SIZE, TrainConfig
from twinseq.common.data.unpaired import (
    KTOBatch,
    build_kto_iterator,
    iter_unpaired_batches,
    prepare_kto_dataset,
    with_kto_ref_logps,
)
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.kto import KTOLossConfig, kto_family, kto_step_metrics, validate_kto_config
from twinseq.common.run.inputs import NO_INPUTS, RunInputs
from twinseq.common.run.schedule import with_resolved_max_steps
from twinseq.common.run.trainer import reference_description
from twinseq.jax_backend.dpo import (
    JAX_OPS,
    _model_sequence_logps,
    _ref_arrays,
    pad_preference_batch,
    preference_inputs,
    sequence_logps_jit,
)
from twinseq.jax_backend.model import (
    CausalLM,
    cast_floating,
    grads_by_name,
    has_adapters,
    lora_dropout,
    merge_state,
    split_trainable,
)
from twinseq.jax_backend.parallel import parallelize
from twinseq.jax_backend.peft import set_adapters_enabled
from twinseq.jax_backend.trainer import (
    DEFAULT_BUCKET,
    DPOTrainer,
    build_causal_lm,
    compute_dtype,
    describe,
    refuse_built_model,
)

logger = logging.getLogger(__name__)

PER_ROW = ("losses", "logps", "rewards")


def kl_estimate(policy_kl_logps, ref_kl_logps):
    """``z = max(0, mean(log π(y'|x) - log π_ref(y'|x)))`` over the M mismatched pairs, held constant (no gradient
    flows through it); 0 when M = 0."""
    if policy_kl_logps.shape[0] == 0:
        return jnp.zeros((), policy_kl_logps.dtype)
    return jax.lax.stop_gradient(jnp.maximum(0.0, jnp.mean(policy_kl_logps - ref_kl_logps)))


def kto_from_logps(logps_D, ref_logps_D, labels_N, num_examples_in_step, *, config: KTOLossConfig):
    """(loss, per-row dict with ``kl``) from the policy's and the reference's [N + M] sequence log-probs
    (completions, then mismatched pairs) and the boolean labels [N]; traceable."""
    n = labels_N.shape[0]
    ref_logps_D = ref_logps_D.astype(logps_D.dtype)
    uses_kl = config.uses_kl and logps_D.shape[0] > n
    kl = kl_estimate(logps_D[n:], ref_logps_D[n:]) if uses_kl else jnp.zeros((), logps_D.dtype)
    losses, rewards = kto_family(logps_D[:n] - ref_logps_D[:n], labels_N.astype(logps_D.dtype), kl, config, JAX_OPS)
    loss = losses.sum() / jnp.asarray(num_examples_in_step, logps_D.dtype)
    per_row = dict(zip(PER_ROW, (losses, logps_D[:n], jax.lax.stop_gradient(rewards))))
    return loss, {**per_row, "kl": kl}


def policy_logps(model: CausalLM, inputs, *, loss_type: str, chunk_size: int):
    """[N + M] sequence log-probs of ``model`` on ``preference_inputs``' arrays (DPO's, one device); traceable."""
    return _model_sequence_logps(model, inputs, loss_type, chunk_size, None, False)


@partial(jax.jit, static_argnums=(0,), static_argnames=("config", "loss_type", "chunk_size", "compute_dtype"))
def kto_grads_jit(
    graphdef,
    state,
    inputs,
    ref_logps_D,
    labels_N,
    num_examples_in_step,
    *,
    config: KTOLossConfig,
    loss_type: str,
    chunk_size: int,
    compute_dtype: Optional[str] = None,
    frozen=None,
    dropout_key=None,
):
    """((loss, per-row dict), grads as an NNX state) of one micro-batch; ``frozen`` and ``dropout_key`` as
    ``dpo.dpo_grads_jit``."""

    def scalar_loss(s):
        model = merge_state(graphdef, cast_floating(s, compute_dtype), cast_floating(frozen, compute_dtype))
        with lora_dropout(dropout_key):
            logps_D = policy_logps(model, inputs, loss_type=loss_type, chunk_size=chunk_size)
        return kto_from_logps(logps_D, ref_logps_D, labels_N, num_examples_in_step, config=config)

    return jax.value_and_grad(scalar_loss, has_aux=True)(state)


def reference_of_batch(kbatch: KTOBatch) -> jax.Array:
    """The precomputed [N + M] reference log-probs of ``kbatch`` (``ref_logps`` then ``ref_KL_logps``), float32."""
    return jnp.concatenate(_ref_arrays(kbatch, None, None if kbatch.num_kl else np.zeros(0)))


def kto_loss_and_grads(
    model: Model,
    kbatch: KTOBatch,
    config: KTOLossConfig,
    *,
    ref_logps_D: Any = None,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_examples_in_step: Optional[int] = None,
) -> tuple[float, dict[str, np.ndarray], dict[str, Any]]:
    """(loss, float32 numpy gradients by HF name or PEFT key, per-row float64 outputs with the float ``kl``) of one
    micro-batch; the reference's [N + M] log-probs come from ``ref_logps_D``, else the batch's precomputed columns."""
    n = kbatch.num_examples
    denom = n if num_examples_in_step is None else int(num_examples_in_step)
    if denom < n:
        raise ConfigError(
            f"num_examples_in_step={denom} is smaller than this micro-batch's {n} rows; pass the count of rows of "
            f"the whole optimizer step."
        )
    ref = reference_of_batch(kbatch) if ref_logps_D is None else jnp.asarray(np.asarray(ref_logps_D, np.float32))
    graphdef, state, frozen = split_trainable(model)
    (loss, per_row), grads = kto_grads_jit(
        graphdef,
        state,
        preference_inputs(kbatch, model.config.vocab_size),
        ref.reshape(-1),
        jnp.asarray(kbatch.labels, bool),
        jnp.asarray(denom, jnp.float32),
        config=config,
        loss_type=loss_type,
        chunk_size=int(chunk_size),
        frozen=frozen,
    )
    out: dict[str, Any] = {k: np.asarray(per_row[k], np.float64) for k in PER_ROW}
    return float(loss), grads_by_name(model, grads), {**out, "kl": float(per_row["kl"])}


# --------------------------------------------------------------------------------------
# The reference, precomputed
# --------------------------------------------------------------------------------------


def reference_model(model: CausalLM) -> CausalLM:
    """The initial model as the reference: itself, or under PEFT a shallow copy with the adapters switched off."""
    if not has_adapters(model):
        return model
    reference = nnx.merge(*nnx.split(model))
    set_adapters_enabled(reference, False)
    return reference


def precompute_kto_ref_logps(model: CausalLM, rows: Any, cfg: TrainConfig, pad_token_id: int, bucket: int) -> Any:
    """``rows`` plus ``ref_logps`` (and ``ref_KL_logps`` with the KL term) from one pass of ``model``."""
    with_kl = cfg.kto.kto_loss_type == "kto"
    graphdef, state = nnx.split(model)
    main, mismatched = [], []
    for _, kbatch in iter_unpaired_batches(
        rows, cfg.data.per_device_train_batch_size, with_kl=with_kl, cfg=cfg, pad_token_id=pad_token_id
    ):
        logps_D = sequence_logps_jit(
            graphdef,
            state,
            preference_inputs(pad_preference_batch(kbatch, bucket), model.config.vocab_size),
            loss_type=cfg.loss.loss_type,
            chunk_size=cfg.loss.loss_chunk_size,
            compute_dtype=compute_dtype(cfg),
        )
        logps_D = np.asarray(logps_D, np.float64)
        main.append(logps_D[: kbatch.num_examples])
        mismatched.append(logps_D[kbatch.num_examples :])
    return with_kto_ref_logps(rows, np.concatenate(main), np.concatenate(mismatched) if with_kl else None)


# --------------------------------------------------------------------------------------
# The trainer and `twinseq train --task kto --backend jax`
# --------------------------------------------------------------------------------------


class KTOTrainer(DPOTrainer):
    """One KTO optimizer step per ``step(kbatches)``, with ``DPOTrainer``'s reference: a frozen copy of the initial
    parameters, the adapter-free base under PEFT, or the batches' precomputed log-probs."""

    def micro_step(self, kbatch: KTOBatch):
        padded = pad_preference_batch(kbatch, self.bucket)
        inputs = preference_inputs(padded, self.vocab_size)
        loss = self.cfg.loss
        (value, per_row), grads = kto_grads_jit(
            self.graphdef,
            self.params,
            inputs,
            jnp.concatenate(self._reference(padded, inputs)),
            jnp.asarray(kbatch.labels, bool),
            jnp.asarray(kbatch.num_examples_in_step or self.examples_per_step, jnp.float32),  # an epoch's last step
            config=self.config,
            frozen=self.frozen,
            loss_type=loss.loss_type,
            chunk_size=loss.loss_chunk_size,
            compute_dtype=compute_dtype(self.cfg),
            dropout_key=self.next_dropout_key(),
        )
        return (float(value), per_row), grads

    def summarize(self, records: list[Any], micro_batches: list[Any]) -> dict[str, Any]:
        per_row = {
            "labels": [kb.labels for kb in micro_batches],
            "rewards": [np.asarray(rows["rewards"], np.float64) for _, rows in records],
            "logps": [np.asarray(rows["logps"], np.float64) for _, rows in records],
        }
        return kto_step_metrics(
            self.micro_losses(records),
            per_row,
            [float(rows["kl"]) for (_, rows), kb in zip(records, micro_batches) if kb.num_examples],
            num_tokens=sum(kb.batch.num_tokens for kb in micro_batches),
            num_label_tokens=sum(kb.batch.num_label_tokens for kb in micro_batches),
        )


def refuse_distributed(cfg: TrainConfig) -> None:
    """KTO runs on one device, as DPO (``common.run.capabilities``' rule for task='dpo')."""
    if cfg.parallel.fsdp or cfg.parallel.context_parallel_size > 1 or jax.process_count() > 1:
        raise ConfigError(
            "task='kto' runs in one process on one device: FSDP, context parallelism and multi-process "
            "launches are not implemented for KTO; drop --fsdp / --context-parallel-size and launch "
            "with python."
        )


def build_kto(cfg: TrainConfig, inputs: RunInputs = NO_INPUTS):
    """(trainer, step source, tokenizer, announce lines) of a KTO run, on one device."""
    refuse_built_model(inputs)
    refuse_distributed(cfg)
    config = validate_kto_config(
        cfg.kto.kto_loss_type, cfg.dpo.beta, cfg.kto.desirable_weight, cfg.kto.undesirable_weight
    )
    rows, tokenizer, stats = prepare_kto_dataset(cfg, inputs.train_dataset, inputs.tokenizer)
    model = parallelize(build_causal_lm(cfg, tokenizer.vocab_size), None, cfg)
    precompute = cfg.dpo.precompute_ref_log_probs
    if precompute:  # the initial model, before any checkpoint is loaded
        t0 = time.perf_counter()
        bucket = cfg.data.pad_to_multiple_of or DEFAULT_BUCKET
        rows = precompute_kto_ref_logps(reference_model(model), rows, cfg, tokenizer.pad_token_id, bucket)
        logger.info("precomputed reference log-probs of %d rows in %.1fs", len(rows), time.perf_counter() - t0)
    source = build_kto_iterator(cfg, rows, tokenizer.pad_token_id, with_kl=config.uses_kl)
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: num_train_epochs passes over the source
    trainer = KTOTrainer(
        model, cfg, config=config, examples_per_step=source.examples_per_step, live_reference=not precompute
    )
    announce = [
        describe(cfg, trainer),
        f"kto_loss_type={config.loss_type}, beta={config.beta}, desirable_weight={config.desirable_weight}, "
        f"undesirable_weight={config.undesirable_weight}, reference="
        f"{reference_description(cfg, precomputed=precompute)}, {source.examples_per_step} rows per step; "
        f"data: {stats}",
    ]
    return trainer, source, tokenizer, announce
