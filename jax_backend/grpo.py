"""GRPO on the JAX backend: completion log-probs from hidden states, the loss family, and the step trainer.

The mirror of ``torch_backend/grpo.py``. One optimizer step (``GRPOTrainer``, on ``common.run.runner``'s loop):

1. every ``num_iterations`` steps, sample ``num_generations`` completions per prompt with the KV-cache
   sampler (``generation.generate``), score them with the reward functions and turn the rewards into
   group advantages (``common.objectives.grpo``); with ``num_iterations > 1`` keep the sampling policy's
   log-probs, with ``grpo_beta > 0`` the reference's (the initial parameters, or under PEFT the same
   model with its adapters switched off);
2. split the completions into micro-batches of ``per_device_train_batch_size``, collate each padded or
   padding-free (``common.objectives.grpo.collate_completions``), compute its completion-token log-probs chunk by
   chunk from hidden states (``logprobs.token_logps``: the token-loss kernel ``loss_type``;
   ``fused_linear`` never holds a ``[tokens, V]`` tensor) and its share of the step loss; the shared
   ``trainer.Trainer.step`` adds the gradients, clips and steps AdamW.

The loss is ``common.objectives.grpo_loss.grpo_loss`` written with jnp ops (``grpo_loss_jax``), tested equal within
1e-6.
Logits are divided by the sampling ``temperature`` before the softmax, as TRL does, so that the ratio
compares the distribution the completions were drawn from.

Static shapes: a micro-batch is padded to a multiple of the trainer's bucket in tokens, and its
completion matrix is ``[N, max_completion_length]``; the token positions are gathered through an
``[N, C]`` index map (``-1``: no token), so one micro-batch shape compiles once.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from twinseq.common.config import DEFAULT_CHUNK_SIZE, TrainConfig
from twinseq.common.data.batching import pad_batch
from twinseq.common.data.prefix_sharing import shares_prefix
from twinseq.common.data.prepare import run_tokenizer
from twinseq.common.data.prompts import prepare_grpo_prompts, resolve_reward_funcs
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.grpo import CompletionBatch, collate_completions, reward_func_name
from twinseq.common.objectives.grpo_loss import CLIP_LOSS_TYPES, VESPO_LOG_W_MIN, LossSpec
from twinseq.common.run.inputs import NO_INPUTS, RunInputs
from twinseq.common.run.rollout import GroupRollout, generation_source, loss_description, token_record
from twinseq.common.run.schedule import with_resolved_max_steps
from twinseq.common.run.trainer import reference_description
from twinseq.jax_backend.generation import generate
from twinseq.jax_backend.grpo_context_parallel import CPCompletionInputs, cp_completion_logps_jit, cp_grpo_grads_jit
from twinseq.jax_backend.logprobs import token_logps
from twinseq.jax_backend.losses import check_labels, logits_f32
from twinseq.jax_backend.model import (
    CausalLM,
    batch_inputs,
    cast_floating,
    grads_by_name,
    lora_dropout,
    merge_state,
    split_trainable,
)
from twinseq.jax_backend.parallel import mesh_from_config, parallelize
from twinseq.jax_backend.peft import adapters_disabled
from twinseq.jax_backend.trainer import JaxTrainer, build_causal_lm, compute_dtype, describe, refuse_built_model

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# The loss (common.objectives.grpo_loss.grpo_loss with jnp ops)
# --------------------------------------------------------------------------------------


def loss_norms(
    mask_NC,
    *,
    num_sequences_in_step=None,
    num_tokens_in_step=None,
    num_micro_batches: int = 1,
    entropy_coef: float = 0.0,
):
    """float32 [4]: (sequences in the step, completion tokens in the step, micro-batches, the entropy bonus's
    coefficient) as ``StepShare``; None: this micro-batch's own count (``common.objectives.grpo_loss.LossNorm``'s
    defaults). Traced, not static: the adaptive coefficient changes without a recompile."""
    mask = np.asarray(mask_NC)
    return jnp.asarray(
        [
            mask.shape[0] if num_sequences_in_step is None else num_sequences_in_step,
            mask.sum() if num_tokens_in_step is None else num_tokens_in_step,
            num_micro_batches,
            entropy_coef,
        ],
        jnp.float32,
    )


def vespo_weights_jax(log_ratio_NC, adv_N1, m, spec: LossSpec) -> jax.Array:
    """VESPO's gamma weight per completion [N, 1] (``common.objectives.grpo_loss.vespo_weights_np``)."""
    log_w = jnp.clip((jnp.clip(log_ratio_NC, -20.0, 20.0) * m).sum(-1, keepdims=True), VESPO_LOG_W_MIN, 20.0)
    nonneg = adv_N1 >= 0
    k = jnp.where(nonneg, spec.vespo_k_pos, spec.vespo_k_neg).astype(log_w.dtype)
    lam = jnp.maximum(jnp.where(nonneg, spec.vespo_lambda_pos, spec.vespo_lambda_neg), 1e-4).astype(log_w.dtype)
    return jnp.nan_to_num(jnp.exp(lam + k * log_w - lam * jnp.exp(log_w)), nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss_jax(
    logps_NC, advantages_N, mask_NC, norms, spec: LossSpec, *, old_logps_NC=None, ref_logps_NC=None, entropy_NC=None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(this micro-batch's share of the step loss, metrics as token means): ``common.objectives.grpo_loss.grpo_loss``
    in jnp; traceable. ``norms`` as ``loss_norms`` returns; ``old_logps_NC`` None: the detached policy (ratio 1).
    With ``spec.entropy_bonus`` the entropy's gradient flows through the bonus ``-norms[3] x`` its token mean, and
    the metrics add ``common.run.rollout.STEP_SUMS`` (step sums, not token means)."""
    m = mask_NC.astype(logps_NC.dtype)
    old = jax.lax.stop_gradient(logps_NC) if old_logps_NC is None else old_logps_NC.astype(logps_NC.dtype)
    adv = advantages_N.astype(logps_NC.dtype)[:, None]
    log_ratio = logps_NC - old
    if spec.loss_type == "rloo":  # one ratio per completion, of its summed log-ratio
        log_ratio = (log_ratio * m).sum(-1, keepdims=True)
    elif spec.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    ratio = jnp.exp(log_ratio)
    count = jnp.maximum(m.sum(), 1.0)
    metrics: dict[str, jax.Array] = {}
    kl = None
    if spec.beta > 0:
        if ref_logps_NC is None:
            raise ConfigError(
                f"grpo_beta={spec.beta} > 0 needs the reference model's log-probs: pass ref_logps_NC, or set "
                f"grpo_beta=0."
            )
        delta = ref_logps_NC.astype(logps_NC.dtype) - logps_NC
        kl = jnp.exp(delta) - delta - 1
        if spec.use_bias_correction_kl:  # times the (differentiable) ratio: the unbiased reverse-KL gradient
            kl = kl * ratio
        metrics["kl"] = jax.lax.stop_gradient((kl * m).sum() / count)
    if spec.loss_type == "cispo":
        per_token = -jax.lax.stop_gradient(jnp.minimum(ratio, spec.eps_high)) * adv * logps_NC
    elif spec.loss_type == "sapo":
        tau = jnp.where(adv > 0, spec.sapo_temperature_pos, spec.sapo_temperature_neg).astype(logps_NC.dtype)
        per_token = -jax.nn.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    elif spec.loss_type == "vespo":
        phi = jax.lax.stop_gradient(vespo_weights_jax(logps_NC - old, adv, m, spec))
        metrics["vespo/phi_seq_mean"] = phi.mean()
        per_token = -phi * adv * logps_NC
    else:
        clipped = jnp.clip(ratio, 1 - spec.epsilon, 1 + spec.eps_high)
        if spec.delta is not None:
            ratio = jnp.minimum(ratio, spec.delta)
        per_token = -jnp.minimum(ratio * adv, clipped * adv)
    if spec.off_policy_mask_threshold is not None:  # TRL's get_off_policy_mask, on the sampling policy's log-probs
        gap = jnp.nan_to_num(jax.lax.stop_gradient(old - logps_NC), nan=0.0)
        mean_gap = (gap * m).sum(-1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
        per_token = per_token * ((adv >= 0) | (mean_gap <= spec.off_policy_mask_threshold)).astype(per_token.dtype)
    if spec.top_entropy_quantile < 1.0:  # TRL's get_high_entropy_mask; the arrays are the global batch
        if entropy_NC is None:
            raise ConfigError(
                f"top_entropy_quantile={spec.top_entropy_quantile} masks tokens by entropy and needs entropy_NC: "
                f"pass the completion tokens' entropies, or set top_entropy_quantile=1.0."
            )
        valid = m > 0
        e = jax.lax.stop_gradient(entropy_NC).astype(per_token.dtype)
        # the quantile of the valid tokens: NaN-out the others (traceable, no boolean indexing)
        threshold = jnp.nanquantile(jnp.where(valid, e, jnp.nan), 1.0 - spec.top_entropy_quantile)
        high = ((e * m >= threshold) & valid).astype(per_token.dtype)
        per_token = per_token * high
        bonus_mask = m * high
    else:
        bonus_mask = m
    if kl is not None:
        per_token = per_token + spec.beta * kl
    summed = per_token * m
    num_sequences, num_tokens, num_micro = norms[0], norms[1], norms[2]
    if spec.loss_type in ("grpo", "sapo"):
        loss = (summed.sum(-1) / jnp.maximum(m.sum(-1), 1.0)).sum() / num_sequences
    elif spec.loss_type == "luspo":
        loss = summed.sum() / num_sequences
    elif spec.loss_type == "rloo":  # one loss per completion, masked or not
        loss = per_token[:, 0].sum() / num_sequences
    elif spec.loss_type == "bnpo":
        loss = summed.sum() / count / num_micro
    elif spec.loss_type == "dr_grpo":
        loss = summed.sum() / (num_sequences * spec.max_completion_length)
    else:  # dapo, cispo, vespo
        loss = summed.sum() / jnp.maximum(num_tokens, 1.0)
    if spec.entropy_bonus:  # TRL's: a token mean of this micro-batch, divided for accumulation only
        if entropy_NC is None:
            raise ConfigError(
                "the entropy bonus (entropy_coef != 0 or use_adaptive_entropy) needs entropy_NC: pass the completion "
                "tokens' entropies, or set entropy_coef=0."
            )
        ent = entropy_NC.astype(loss.dtype) * bonus_mask
        count = bonus_mask.sum()
        metrics["policy_loss"] = jax.lax.stop_gradient(loss)
        metrics["bonus_entropy"], metrics["bonus_tokens"] = jax.lax.stop_gradient(ent.sum()), count
        loss = loss - norms[3] * ent.sum() / jnp.maximum(count, 1.0) / num_micro
    r = jax.lax.stop_gradient(ratio)
    mm = (m > 0) if r.shape[1] > 1 else jnp.ones(r.shape, bool)
    seen = jnp.maximum(mm.sum(), 1)
    if spec.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = ((r > spec.eps_high) & (adv > 0) & mm).sum() / seen
    elif spec.loss_type in CLIP_LOSS_TYPES:
        low = (r < 1 - spec.epsilon) & (adv < 0) & mm
        high = (r > 1 + spec.eps_high) & (adv > 0) & mm
        metrics["clip_ratio/low_mean"] = low.sum() / seen
        metrics["clip_ratio/high_mean"] = high.sum() / seen
        metrics["clip_ratio/region_mean"] = (low | high).sum() / seen
    return loss, metrics


# --------------------------------------------------------------------------------------
# Log-probs and entropy of completion tokens
# --------------------------------------------------------------------------------------


@partial(jax.tree_util.register_dataclass, data_fields=["inputs", "flat_NC", "parent_ids_BT"], meta_fields=[])
@dataclasses.dataclass
class CompletionInputs:
    """A ``CompletionBatch`` as device arrays: ``batch_inputs`` of its (bucketed) batch, ``flat_NC``, the
    flattened ``[B*T]`` position whose target is completion i's token j (-1: none), and ``parent_ids_BT``
    (int32 [B, T] of a batch with shared prompts, else None: the program without them, as ``model.batch_parents``)."""

    inputs: tuple
    flat_NC: jax.Array
    parent_ids_BT: Optional[jax.Array] = None

    @classmethod
    def of(
        cls, cb: CompletionBatch, vocab_size: int, rows: Optional[int] = None, multiple: int = 1
    ) -> "CompletionInputs":
        batch = pad_batch(cb.batch, rows or cb.batch.shape[0], multiple)
        b, t = cb.batch.shape
        target_doc = np.pad(cb.target_doc_ids, ((0, batch.shape[0] - b), (0, batch.shape[1] - t)), constant_values=-1)
        flat_n = np.flatnonzero(target_doc.reshape(-1) >= 0)  # flattened order = the order of token_row/col_n
        flat_NC = np.full((cb.num_docs, cb.num_columns), -1, np.int32)
        flat_NC[cb.token_row_n, cb.token_col_n] = flat_n
        check_labels(batch.labels, vocab_size, max(int((batch.labels != -100).sum()), 1))
        parents = jnp.asarray(batch.parent_ids, jnp.int32) if batch.shares_prefix else None
        return cls(batch_inputs(batch, vocab_size), jnp.asarray(flat_NC), parents)


def _gather_NC(values_n: jax.Array, flat_NC: jax.Array) -> jax.Array:
    return jnp.where(flat_NC >= 0, values_n[jnp.maximum(flat_NC, 0)], 0.0)


def chunked_entropy(
    hidden_nH: jax.Array,
    lm_head_VH: jax.Array,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    logit_softcap: Optional[float] = None,
    grad: bool = False,
) -> jax.Array:
    """float32 [n] entropy of ``softmax(hidden @ W.T)`` per row, ``chunk_size`` rows of logits at a time; no
    gradient, or with ``grad`` its gradient (each chunk rematerialised in the backward pass, so no ``[n, V]``
    tensor is kept). Naive equivalent: ``-(softmax(l) * log_softmax(l)).sum(-1)`` with ``l = logits_f32(h, W)``."""
    if not grad:
        hidden_nH, lm_head_VH = jax.lax.stop_gradient(hidden_nH), jax.lax.stop_gradient(lm_head_VH)
    n = hidden_nH.shape[0]
    pad = -n % chunk_size
    hidden_CSH = jnp.pad(hidden_nH, ((0, pad), (0, 0))).reshape(-1, chunk_size, hidden_nH.shape[-1])

    def chunk(h_SH, w_VH):
        logp_SV = jax.nn.log_softmax(logits_f32(h_SH, w_VH, logit_softcap), axis=-1)
        return -(jnp.exp(logp_SV) * logp_SV).sum(-1)

    body = jax.checkpoint(chunk) if grad else chunk
    return jax.lax.map(lambda h_SH: body(h_SH, lm_head_VH), hidden_CSH).reshape(-1)[:n]


def completion_logps(
    model: CausalLM,
    ci: CompletionInputs,
    *,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[jax.Array, Optional[jax.Array]]:
    """(log-probs [N, C], entropy [N, C] or None) of each completion token; 0 past a completion. Traceable.
    ``entropy_grad``: the entropy keeps its gradient (the entropy bonus), else it is a constant.

    Naive equivalent, for completion i and its token j, the target of flattened position t::

        logp[i, j] = log_softmax(logits_f32(hidden[t], W) / temperature)[input_ids[t + 1]]
    """
    cap = model.final_logit_softcapping
    check_temperature(temperature, cap)
    input_ids, position_ids, segment_ids, labels = ci.inputs
    hidden_BTH = model(input_ids, position_ids, segment_ids, parent_ids_BT=ci.parent_ids_BT)
    if temperature != 1.0:
        hidden_BTH = hidden_BTH / jnp.asarray(temperature, hidden_BTH.dtype)  # (h / T) @ W.T = logits / T
    logps_n = token_logps(hidden_BTH, model.lm_head_VH(), labels, loss_type, chunk_size, logit_softcap=cap)
    entropy_NC = None
    if with_entropy:
        hidden_nH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])[jnp.maximum(ci.flat_NC, 0).reshape(-1)]
        entropy_n = chunked_entropy(hidden_nH, model.lm_head_VH(), chunk_size, cap, grad=entropy_grad)
        entropy_NC = jnp.where(ci.flat_NC >= 0, entropy_n.reshape(ci.flat_NC.shape), 0.0)
    return _gather_NC(logps_n, ci.flat_NC), entropy_NC


def check_temperature(temperature: float, cap: Optional[float]) -> None:
    if cap is not None and temperature != 1.0:
        raise ConfigError(
            f"temperature={temperature} with a model that soft-caps its logits (final_logit_softcapping="
            f"{cap}): the temperature would have to divide the capped logits, which the chunked "
            f"kernels do not do; use --temperature 1.0 with this model."
        )


# --------------------------------------------------------------------------------------
# Jitted functions and the model-level API
# --------------------------------------------------------------------------------------

_STATIC = ("spec", "loss_type", "chunk_size", "temperature", "compute_dtype")


@partial(jax.jit, static_argnums=(0,), static_argnames=_STATIC)
def grpo_grads_jit(
    graphdef,
    state,
    ci: CompletionInputs,
    mask_NC,
    advantages_N,
    norms,
    old_logps_NC=None,
    ref_logps_NC=None,
    *,
    spec: LossSpec,
    loss_type: str,
    chunk_size: int,
    temperature: float,
    compute_dtype: Optional[str] = None,
    frozen=None,
    dropout_key=None,
):
    """((loss, metrics), grads as an NNX state) of one micro-batch; ``frozen`` and ``dropout_key`` as
    ``model.grads_jit``."""

    def scalar_loss(s):
        model = merge_state(graphdef, cast_floating(s, compute_dtype), cast_floating(frozen, compute_dtype))
        with lora_dropout(dropout_key):
            logps_NC, entropy_NC = completion_logps(
                model,
                ci,
                loss_type=loss_type,
                chunk_size=chunk_size,
                temperature=temperature,
                with_entropy=True,
                entropy_grad=spec.entropy_bonus,
            )
        loss, metrics = grpo_loss_jax(
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


@partial(jax.jit, static_argnums=(0,), static_argnames=("loss_type", "chunk_size", "temperature", "compute_dtype"))
def completion_logps_jit(
    graphdef,
    state,
    ci: CompletionInputs,
    *,
    loss_type: str,
    chunk_size: int,
    temperature: float,
    compute_dtype: Optional[str] = None,
    frozen=None,
    dropout_key=None,
) -> jax.Array:
    """float32 [N, C] log-probs, no gradient: the sampling policy's (``dropout_key``: in train mode, as torch's) and
    the reference's passes."""
    model = merge_state(graphdef, cast_floating(state, compute_dtype), cast_floating(frozen, compute_dtype))
    with lora_dropout(dropout_key):
        logps_NC = completion_logps(model, ci, loss_type=loss_type, chunk_size=chunk_size, temperature=temperature)[0]
    return logps_NC.astype(jnp.float32)


def grpo_loss_and_grads(
    model: CausalLM,
    cb: CompletionBatch,
    mask_NC: np.ndarray,
    advantages_N: np.ndarray,
    spec: LossSpec,
    *,
    old_logps_NC: Optional[np.ndarray] = None,
    ref_logps_NC: Optional[np.ndarray] = None,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    num_sequences_in_step: Optional[int] = None,
    num_tokens_in_step: Optional[int] = None,
    num_micro_batches: int = 1,
    entropy_coef: float = 0.0,
) -> tuple[float, dict[str, np.ndarray], dict[str, float]]:
    """(loss, float32 numpy gradients in HF names and layout, metrics) of one micro-batch of completions; the
    mirror of the torch backend's GRPO step (``parity_tests/test_grpo_parity.py``). ``cb`` may share its prompts
    (``collate_completions(..., share_prefix=True)``): the same loss and gradients."""
    graphdef, state, frozen = split_trainable(model)
    ci = CompletionInputs.of(cb, model.config.vocab_size)

    def as_f32(a):
        return None if a is None else jnp.asarray(np.asarray(a, np.float32))

    (loss, metrics), grads = grpo_grads_jit(
        graphdef,
        state,
        ci,
        as_f32(mask_NC),
        as_f32(advantages_N),
        loss_norms(
            mask_NC,
            num_sequences_in_step=num_sequences_in_step,
            num_tokens_in_step=num_tokens_in_step,
            num_micro_batches=num_micro_batches,
            entropy_coef=entropy_coef,
        ),
        as_f32(old_logps_NC),
        as_f32(ref_logps_NC),
        spec=spec,
        loss_type=loss_type,
        chunk_size=int(chunk_size),
        temperature=float(temperature),
        frozen=frozen,
    )
    return float(loss), grads_by_name(model, grads), {k: float(v) for k, v in metrics.items()}


def compute_completion_logps(
    model: CausalLM,
    cb: CompletionBatch,
    *,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> np.ndarray:
    """float64 numpy [N, C] completion-token log-probs of ``model`` (0 past each completion); a ``cb`` with shared
    prompts gives those of the unshared one."""
    graphdef, state, frozen = split_trainable(model)
    out = completion_logps_jit(
        graphdef,
        state,
        CompletionInputs.of(cb, model.config.vocab_size),
        loss_type=loss_type,
        chunk_size=int(chunk_size),
        temperature=float(temperature),
        frozen=frozen,
    )
    return np.asarray(out, np.float64)


# --------------------------------------------------------------------------------------
# The generated batch and its micro-batches
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class GRPOMicroBatch:
    """One micro-batch of completions on device: inputs, loss mask, advantages and the kept log-probs."""

    ci: Union[CompletionInputs, CPCompletionInputs]
    mask_NC: jax.Array
    advantages_N: jax.Array
    num_tokens: int
    old_logps_NC: Optional[jax.Array] = None
    ref_logps_NC: Optional[jax.Array] = None


# --------------------------------------------------------------------------------------
# The step trainer
# --------------------------------------------------------------------------------------


class GRPOTrainer(GroupRollout, JaxTrainer):
    """GRPO's JAX trainer: ``common.run.rollout.GroupRollout`` (generation every ``num_iterations`` steps, rewards,
    advantages, the step's metrics) on ``JaxTrainer``'s hooks; here only what is JAX: sampling with the KV-cache
    sampler, the kept log-probs, and the jitted micro-step.

    On a (data=1, cp) ``mesh`` the parameters are replicated, sampling runs on them as on one device (the same key:
    the same completions), and every log-prob pass takes the micro-batch sharded over cp (``grpo_context_parallel``).
    """

    def __init__(
        self,
        model: CausalLM,
        cfg: TrainConfig,
        *,
        tokenizer: Any,
        reward_funcs: Sequence[Any],
        mesh: Optional[Any] = None,
    ) -> None:
        super().__init__(model, cfg, mesh)
        self.init_rollout(cfg, tokenizer, reward_funcs)
        check_temperature(cfg.grpo.temperature, model.final_logit_softcapping)
        self.ref_graphdef, self.ref_params = None, None
        if cfg.reference_kl_beta > 0 and self.peft:  # the reference is the same parameters, adapters off: no copy
            with adapters_disabled(model):
                self.ref_graphdef = split_trainable(model)[0]
        elif cfg.reference_kl_beta > 0:
            self.ref_params = jax.tree.map(jnp.copy, self.params)
        self._norms = jnp.zeros(4, jnp.float32)

    def _logps_kwargs(self) -> dict[str, Any]:
        c = self.cfg
        return dict(
            loss_type=c.loss.loss_type,
            chunk_size=c.loss.loss_chunk_size,
            temperature=c.grpo.temperature,
            compute_dtype=compute_dtype(c),
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.rollout_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.load_rollout_state(state)

    # -- GroupRollout's backend hooks ----------------------------------------------------------

    def sample(self, prompt_ids: list[list[int]]) -> np.ndarray:
        g, tok = self.cfg.grpo, self.tokenizer
        dtype = compute_dtype(self.cfg)
        policy = merge_state(self.graphdef, cast_floating(self.params, dtype), cast_floating(self.frozen, dtype))
        # a key per generation, from the seed: a resumed run samples what the uninterrupted one would have
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), self.num_generations_done)
        return generate(
            policy,
            prompt_ids,
            max_completion_length=self.max_completion_length,
            key=key,
            do_sample=not g.generation_greedy,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            pad_to_multiple_of=self.cfg.data.pad_to_multiple_of or 16,
            min_new_tokens=1,
        ).completion_ids  # as torch: a completion is never a bare EOS

    def build_micro_batches(
        self,
        prompt_ids: list[list[int]],
        completions: list[np.ndarray],
        loss_mask_NC: np.ndarray,
        advantages_N: np.ndarray,
        num_columns: int,
    ) -> list[GRPOMicroBatch]:
        """Collated and bucketed to ``[N, max_completion_length]`` (static shapes: one compile per bucket)."""
        d = self.cfg.data
        size, out = d.per_device_train_batch_size, []
        for s in range(0, len(completions), size):
            sl = slice(s, s + size)
            cb = collate_completions(
                prompt_ids[sl],
                completions[sl],
                padding_free=d.padding_free,
                pad_token_id=self.tokenizer.pad_token_id,
                num_columns=self.max_completion_length,
                share_prefix=shares_prefix(self.cfg),
            )
            rows = 1 if d.padding_free else size
            ci = (
                CompletionInputs.of(cb, self.vocab_size, rows=rows, multiple=self.bucket)
                if self.mesh is None
                else CPCompletionInputs.of(cb, self.vocab_size, self.mesh, rows, self.bucket)
            )
            mb = GRPOMicroBatch(
                ci,
                jnp.asarray(loss_mask_NC[sl], jnp.float32),
                jnp.asarray(advantages_N[sl], jnp.float32),
                cb.batch.num_tokens,
            )
            if self.keeps_old_logps:
                mb.old_logps_NC = self._logps_jit(
                    self.graphdef,
                    self.params,
                    ci,
                    frozen=self.frozen,
                    dropout_key=self.next_dropout_key(),
                    **self._logps_kwargs(),
                )
            if self.kl_beta > 0:
                graphdef, state, frozen = (
                    (self.ref_graphdef, self.params, self.frozen)
                    if self.peft
                    else (self.graphdef, self.ref_params, None)
                )
                mb.ref_logps_NC = self._logps_jit(graphdef, state, ci, frozen=frozen, **self._logps_kwargs())
            out.append(mb)
        return out

    def _logps_jit(self, *args: Any, **kwargs: Any) -> jax.Array:
        """``completion_logps_jit``, or on a mesh its sharded mirror with the cp attention."""
        if self.mesh is None:
            return completion_logps_jit(*args, **kwargs)
        return cp_completion_logps_jit(*args, entropy_fn=chunked_entropy, attend=self.attend, **kwargs)

    def kl_sums(self, micro: list[GRPOMicroBatch]) -> np.ndarray:
        out = []
        for mb in micro:
            assert mb.old_logps_NC is not None and mb.ref_logps_NC is not None  # kept when kl_beta > 0
            old, ref, m = (np.asarray(a, np.float64) for a in (mb.old_logps_NC, mb.ref_logps_NC, mb.mask_NC))
            out.append(((old - ref) * m).sum(-1))
        return np.concatenate(out)

    def set_advantages(self, micro: list[GRPOMicroBatch], advantages_N: np.ndarray) -> None:
        s = 0
        for mb in micro:
            n = mb.mask_NC.shape[0]
            mb.advantages_N = jnp.asarray(advantages_N[s : s + n], jnp.float32)
            s += n

    # -- the micro-step --------------------------------------------------------------------

    def prepare(self, micro_batches: list[Any]) -> list[Any]:
        micro = super().prepare(micro_batches)
        self._norms = jnp.asarray(list(self.share), jnp.float32)
        return micro

    def micro_step(self, mb: GRPOMicroBatch) -> tuple[dict[str, float], Any]:
        grads_jit = (
            grpo_grads_jit
            if self.mesh is None
            else partial(cp_grpo_grads_jit, loss_fn=grpo_loss_jax, entropy_fn=chunked_entropy, attend=self.attend)
        )
        (loss, metrics), grads = grads_jit(
            self.graphdef,
            self.params,
            mb.ci,
            mb.mask_NC,
            mb.advantages_N,
            self._norms,
            mb.old_logps_NC,
            mb.ref_logps_NC,
            spec=self.loss_spec,
            frozen=self.frozen,
            dropout_key=self.next_dropout_key(),
            **self._logps_kwargs(),
        )
        entropy_sum = float(metrics.pop("entropy_sum"))
        record = token_record(float(loss), float(mb.mask_NC.sum()), mb.num_tokens, metrics)
        record["entropy_sum"] = entropy_sum
        return record, grads


# --------------------------------------------------------------------------------------
# `twinseq train --task grpo --backend jax`
# --------------------------------------------------------------------------------------


def build_grpo(cfg: TrainConfig, reward_funcs: Optional[Sequence[Any]] = None, inputs: RunInputs = NO_INPUTS):
    """(trainer, source, tokenizer, announce lines) of a GRPO run; ``reward_funcs`` (names or callables)
    overrides ``cfg.grpo.reward_funcs``."""
    g = cfg.grpo
    if g.use_vllm:
        raise ConfigError(
            "use_vllm=True: vLLM generation is a torch/CUDA integration; the jax backend samples with "
            "its own KV-cache sampler (jax_backend.generation); drop --use-vllm or use --backend torch."
        )
    if cfg.loss.loss_type == "liger" or cfg.loss.use_liger_kernel:
        raise ConfigError(
            "loss_type='liger' (Liger's fused GRPO loss) is a torch/CUDA kernel; on the jax backend use "
            "--loss-type fused_linear, the same chunked log-probs without a [tokens, vocab] tensor."
        )
    refuse_built_model(inputs)
    tokenizer = run_tokenizer(cfg, inputs.tokenizer)
    funcs = resolve_reward_funcs(reward_funcs or inputs.reward_funcs or g.reward_funcs)
    rows = prepare_grpo_prompts(cfg, tokenizer, inputs.train_dataset)
    mesh = mesh_from_config(cfg)  # None unless context_parallel_size > 1 (then data=1: capabilities' rule)
    model = parallelize(build_causal_lm(cfg, tokenizer.vocab_size), mesh, cfg)
    source, generation_batch = generation_source(cfg, rows)
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: num_train_epochs passes over the source
    trainer = GRPOTrainer(model, cfg, tokenizer=tokenizer, reward_funcs=funcs, mesh=mesh)
    announce = [
        describe(cfg, trainer),
        f"{cfg.task}: {len(rows)} prompts, {source.prompts_per_step} prompts x {g.num_generations} generations = "
        f"{generation_batch} completions per generation, {trainer.generation_parts} optimizer step(s) each, "
        f"max_completion_length={trainer.max_completion_length}, "
        f"{loss_description(cfg)}, reference={reference_description(cfg)}, num_iterations="
        f"{g.num_iterations}, rewards={[reward_func_name(f) for f in funcs]}",
    ]
    return trainer, source, tokenizer, announce
