"""A Flax NNX Llama that mirrors Hugging Face transformers' ``LlamaForCausalLM`` op for op, and the
protocol functions ``build_model``, ``export_weights``, ``logits`` and ``loss_and_grads``
(``common.backend.Backend``).

Every jitted function takes the model as ``(graphdef, state)`` (``nnx.split``), so it compiles
once per (B, T) bucket, loss type and chunk size; ``num_items_in_batch`` is traced.

The module tree and attribute names follow HF's parameter names, so a parameter's NNX path
*is* its HF name: ``model.layers.0.self_attn.q_proj.kernel`` <-> ``model.layers.0.self_attn.
q_proj.weight``. Linear layers keep Flax's ``kernel`` layout ``[in, out]`` (the transpose of
torch's ``[out, in]``); embeddings and RMSNorm scales keep HF's layout under the name ``weight``.

HF details reproduced on purpose (transformers 5.x ``modeling_llama.py``):

- RMSNorm: variance in float32, ``x * rsqrt(var + eps)``, cast back, *then* times the weight;
- RoPE: default (unscaled) ``inv_freq = 1 / theta ** (arange(0, d, 2) / d)`` in float32, the
  half-split ``rotate_half`` layout, angles from ``position_ids`` (so they restart per document);
- attention: grouped-query (kv heads repeated in place), scaling ``head_dim ** -0.5``,
  softmax in float32 (see ``attention.py``); pluggable: ``model(..., attend=fn)`` runs ``fn``
  (e.g. ``parallel.ring_attention_fn(mesh)``, context parallel) instead of the dense path;
- MLP: ``down(silu(gate(x)) * up(x))``; no biases anywhere;
- tied embeddings: the LM head is ``embed_tokens.weight`` itself.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twinseq.common.batching import Batch, check_batch
from twinseq.common.config import DEFAULT_CHUNK_SIZE, ModelConfig
from twinseq.common.errors import ConfigError
from twinseq.common.init import check_weights, parameter_shapes
from twinseq.common.backend import Model
from twinseq.jax_backend.attention import document_causal_mask, dot_product_attention
from twinseq.jax_backend.losses import LOSS_TYPES, causal_lm_loss, check_labels, token_nll
from twinseq.jax_backend.memory import remat

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

AttendFn = Callable[..., jax.Array]
"""``attend(q_BNTD, k_BKTD, v_BKTD, segment_ids_BT, position_ids_BT, scaling) -> out_BNTD``."""


def _param(array: np.ndarray, dtype: str) -> nnx.Param:
    return nnx.Param(jnp.asarray(np.asarray(array, dtype=np.float32), dtype=DTYPES[dtype]))


class Linear(nnx.Module):
    """``y = x @ kernel`` with ``kernel = W.T`` for a torch ``nn.Linear(bias=False)`` weight ``W``."""

    def __init__(self, weight_OI: np.ndarray, dtype: str):
        self.kernel = _param(np.asarray(weight_OI).T, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...]


class Embedding(nnx.Module):
    def __init__(self, weight_VH: np.ndarray, dtype: str):
        self.weight = _param(weight_VH, dtype)

    def __call__(self, input_ids_BT: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], input_ids_BT, axis=0)


class RMSNorm(nnx.Module):
    def __init__(self, weight_H: np.ndarray, eps: float, dtype: str):
        self.weight = _param(weight_H, dtype)
        self.eps = float(eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return self.weight[...] * normed


def rope_inv_freq(head_dim: int, rope_theta: float) -> np.ndarray:
    """float32 [head_dim / 2]: HF's default RoPE inverse frequencies ``1 / theta ** (arange(0, d, 2) / d)``.

    The exponent is float32 as in torch; the power is taken in float64 and rounded, which
    reproduces torch's float32 ``pow`` bit for bit on almost every entry (1 ulp otherwise).
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    power = np.power(np.float64(rope_theta), exponent.astype(np.float64)).astype(np.float32)
    return (np.float32(1.0) / power).astype(np.float32)


def rope_cos_sin(position_ids_BT: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, 1, T, head_dim] (the frequencies repeated twice, HF layout)."""
    freqs_BTF = position_ids_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb_BTD = jnp.concatenate([freqs_BTF, freqs_BTF], axis=-1)
    return jnp.cos(emb_BTD)[:, None].astype(dtype), jnp.sin(emb_BTD)[:, None].astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x_BNTD: jax.Array, cos_B1TD: jax.Array, sin_B1TD: jax.Array) -> jax.Array:
    return x_BNTD * cos_B1TD + rotate_half(x_BNTD) * sin_B1TD


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], prefix: str, dtype: str):
        self.q_proj = Linear(w[prefix + "q_proj.weight"], dtype)
        self.k_proj = Linear(w[prefix + "k_proj.weight"], dtype)
        self.v_proj = Linear(w[prefix + "v_proj.weight"], dtype)
        self.o_proj = Linear(w[prefix + "o_proj.weight"], dtype)
        self.head_dim = int(cfg.head_dim)
        self.scaling = float(cfg.head_dim) ** -0.5

    def _heads(self, x_BTX: jax.Array) -> jax.Array:
        b, t, _ = x_BTX.shape
        return x_BTX.reshape(b, t, -1, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x_BTH, cos, sin, attn_args: tuple, attend: Callable[..., jax.Array]) -> jax.Array:
        """``attend(q, k, v, *attn_args, scaling)``: ``attn_args`` is ``(allowed_B1TT,)`` for the dense
        path (``dot_product_attention``) or ``(segment_ids_BT, position_ids_BT)`` for an ``AttendFn``."""
        q_BNTD = apply_rope(self._heads(self.q_proj(x_BTH)), cos, sin)
        k_BKTD = apply_rope(self._heads(self.k_proj(x_BTH)), cos, sin)
        v_BKTD = self._heads(self.v_proj(x_BTH))
        out_BNTD = attend(q_BNTD, k_BKTD, v_BKTD, *attn_args, self.scaling)
        b, _, t, _ = out_BNTD.shape
        return self.o_proj(out_BNTD.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MLP(nnx.Module):
    def __init__(self, w: dict[str, np.ndarray], prefix: str, dtype: str):
        self.gate_proj = Linear(w[prefix + "gate_proj.weight"], dtype)
        self.up_proj = Linear(w[prefix + "up_proj.weight"], dtype)
        self.down_proj = Linear(w[prefix + "down_proj.weight"], dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], layer: int, dtype: str):
        p = f"model.layers.{layer}."
        self.self_attn = Attention(cfg, w, p + "self_attn.", dtype)
        self.mlp = MLP(w, p + "mlp.", dtype)
        self.input_layernorm = RMSNorm(w[p + "input_layernorm.weight"], cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps, dtype)

    def __call__(self, x_BTH, cos, sin, attn_args: tuple, attend: Callable[..., jax.Array]) -> jax.Array:
        x_BTH = x_BTH + self.self_attn(self.input_layernorm(x_BTH), cos, sin, attn_args, attend)
        return x_BTH + self.mlp(self.post_attention_layernorm(x_BTH))


def _layer_apply(graphdef, attend, state, x_BTH, cos, sin, attn_args):
    """A decoder layer as a pure function of its parameters, so ``jax.checkpoint`` sees them as inputs.

    ``graphdef`` and ``attend`` are static (hashable; ``attend`` may close over a mesh).
    """
    return nnx.merge(graphdef, state)(x_BTH, cos, sin, attn_args, attend)


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], dtype: str, remat_policy: str):
        self.embed_tokens = Embedding(w["model.embed_tokens.weight"], dtype)
        self.layers = nnx.List([DecoderLayer(cfg, w, i, dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(w["model.norm.weight"], cfg.rms_norm_eps, dtype)
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(cfg.head_dim, cfg.rope_theta))
        self.remat_policy = remat_policy
        remat(_layer_apply, remat_policy, static_argnums=(0, 1))  # validate the policy at build time

    def __call__(self, input_ids_BT, position_ids_BT, segment_ids_BT, attend: Optional[AttendFn] = None) -> jax.Array:
        x_BTH = self.embed_tokens(input_ids_BT)
        cos, sin = rope_cos_sin(position_ids_BT, np.asarray(self.inv_freq, np.float32), x_BTH.dtype)
        if attend is None:
            # The dense mask is built once and shared by every layer.
            attend, attn_args = dot_product_attention, (document_causal_mask(segment_ids_BT, position_ids_BT),)
        else:
            attn_args = (segment_ids_BT, position_ids_BT)
        layer_fn = remat(_layer_apply, self.remat_policy, static_argnums=(0, 1))
        for layer in self.layers:
            graphdef, state = nnx.split(layer)
            x_BTH = layer_fn(graphdef, attend, state, x_BTH, cos, sin, attn_args)
        return self.norm(x_BTH)


class LlamaForCausalLM(nnx.Module):
    """``model(input_ids, position_ids, segment_ids, attend=None) -> hidden_BTH`` (after the final norm).

    ``attend`` (an ``AttendFn``, static under ``jit``) replaces the dense document-causal
    attention of every layer, e.g. ``parallel.ring_attention_fn(mesh)`` on a batch placed by
    ``parallel.shard_batch``. ``logits(...)`` adds the LM head; losses take ``hidden_BTH`` and
    ``lm_head_VH()`` so that a chunked or fused loss never needs the full logits.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], *, dtype: str = "float32",
                 remat_policy: str = "none"):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not valid; choose one of {tuple(DTYPES)}.")
        check_weights(cfg, weights)
        self.model = LlamaModel(cfg, weights, dtype, remat_policy)
        self.lm_head: Optional[Linear] = None if cfg.tie_word_embeddings else Linear(weights["lm_head.weight"], dtype)
        self.config_items = tuple(sorted(cfg.to_dict().items()))  # hashable: lives in the static graphdef
        self.dtype = dtype

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_dict(dict(self.config_items))

    def lm_head_VH(self) -> jax.Array:
        if self.lm_head is None:
            return self.model.embed_tokens.weight[...]
        return self.lm_head.kernel[...].T

    def __call__(self, input_ids_BT, position_ids_BT, segment_ids_BT, attend: Optional[AttendFn] = None) -> jax.Array:
        return self.model(input_ids_BT, position_ids_BT, segment_ids_BT, attend)

    def logits(self, input_ids_BT, position_ids_BT, segment_ids_BT, attend: Optional[AttendFn] = None) -> jax.Array:
        """[B, T, V] in the model dtype, as HF's ``lm_head(hidden_states)``."""
        hidden_BTH = self(input_ids_BT, position_ids_BT, segment_ids_BT, attend)
        return hidden_BTH @ self.lm_head_VH().T


def hf_name(path: tuple) -> str:
    """NNX state path -> HF parameter name (``kernel`` becomes ``weight``; the caller transposes)."""
    *head, leaf = (str(p) for p in path)
    return ".".join([*head, "weight" if leaf == "kernel" else leaf])


def state_to_hf(state: nnx.State) -> dict[str, np.ndarray]:
    """Flatten an NNX parameter state (or a gradient of one) into HF names, HF ``[out, in]`` layout,
    float32 numpy."""
    out: dict[str, np.ndarray] = {}
    for path, variable in nnx.to_flat_state(state):
        value = np.asarray(jnp.asarray(variable.get_value(), dtype=jnp.float32))
        out[hf_name(path)] = value.T if str(path[-1]) == "kernel" else value
    return out


def in_hf_order(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tensors`` reordered as ``parameter_shapes(cfg)`` (the order of ``init_weights``)."""
    order = parameter_shapes(cfg)
    assert set(order) == set(tensors), sorted(set(order) ^ set(tensors))
    return {name: tensors[name] for name in order}


def export_weights(model: Model) -> dict[str, np.ndarray]:
    """HF-named float32 numpy weights, in the order of ``parameter_shapes`` (``init_weights`` order)."""
    return in_hf_order(model.config, state_to_hf(nnx.state(model, nnx.Param)))


def cast_floating(state: Any, compute_dtype: Optional[str]) -> Any:
    """``state`` with its floating leaves cast to ``compute_dtype`` (None: unchanged): mixed precision,
    float32 master weights with a bfloat16 forward, like torch autocast."""
    if compute_dtype is None:
        return state
    return jax.tree.map(lambda x: x.astype(DTYPES[compute_dtype]) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        state)


# --------------------------------------------------------------------------------------
# Backend protocol
# --------------------------------------------------------------------------------------


def build_model(cfg: ModelConfig, weights: Optional[dict[str, np.ndarray]] = None, *, dtype: str = "float32",
                attn_implementation: str = "sdpa", device: Any = None) -> Model:
    """An NNX ``LlamaForCausalLM`` holding ``weights`` (HF names, torch layout), on ``device``.

    ``weights`` None draws ``common.init.init_weights(cfg, seed=0)``, the same model the torch
    backend builds. ``dtype`` is the parameter and compute dtype (``float32`` or ``bfloat16``, as
    HF's ``torch_dtype``). ``attn_implementation``: the JAX backend has one attention path (the
    dense document mask); every value is accepted so that one config runs on both backends.
    ``device`` (a ``jax.Device``) places the parameters; None uses JAX's default device.
    """
    from twinseq.common.init import init_weights

    model = LlamaForCausalLM(cfg, init_weights(cfg, seed=0) if weights is None else weights, dtype=dtype)
    if device is not None:
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, jax.device_put(state, device))
    return model


def batch_inputs(batch: Batch, vocab_size: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(input_ids, position_ids, segment_ids, labels) as int32 device arrays, after range checks."""
    check_batch(batch, vocab_size)
    return tuple(jnp.asarray(a, jnp.int32) for a in  # type: ignore[return-value]
                 (batch.input_ids, batch.position_ids, batch.segment_ids, batch.labels))


@partial(jax.jit, static_argnums=(0,))
def _forward_jit(graphdef, state, input_ids_BT, position_ids_BT, segment_ids_BT, labels_BT):
    """(float32 logits [B, T, V], per-token NLL [B, T]) from one compiled forward pass."""
    model = nnx.merge(graphdef, state)
    hidden_BTH = model(input_ids_BT, position_ids_BT, segment_ids_BT)
    logits_BTV = (hidden_BTH @ model.lm_head_VH().T).astype(jnp.float32)
    return logits_BTV, token_nll(hidden_BTH, model.lm_head_VH(), labels_BT)


def logits(model: Model, batch: Batch) -> np.ndarray:
    """np.float32 [B, T, V]. Padding positions hold finite values that mean nothing."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward_jit(graphdef, state, *batch_inputs(batch, model.config.vocab_size))[0])


def token_losses(model: LlamaForCausalLM, batch: Batch) -> np.ndarray:
    """np.float32 [B, T]: the NLL of ``labels[:, t + 1]`` predicted at t; 0 where ignored."""
    check_labels(batch.labels, model.config.vocab_size, batch.num_items_in_batch)
    graphdef, state = nnx.split(model)
    return np.asarray(_forward_jit(graphdef, state, *batch_inputs(batch, model.config.vocab_size))[1])


def loss_fn(model: LlamaForCausalLM, input_ids_BT, position_ids_BT, segment_ids_BT, labels_BT,
            num_items_in_batch, loss_type: str = "nll", chunk_size: int = DEFAULT_CHUNK_SIZE, *, attend=None,
            targets_are_shifted: bool = False):
    """(loss, metrics) of one micro-batch; traceable, used by ``loss_and_grads`` and the trainer.

    ``attend``: the model's attention function (None: dense; see ``LlamaForCausalLM``);
    ``targets_are_shifted``: ``labels_BT`` are already the targets (context-parallel batches).
    """
    hidden_BTH = model(input_ids_BT, position_ids_BT, segment_ids_BT, attend)
    return causal_lm_loss(hidden_BTH, model.lm_head_VH(), labels_BT, num_items_in_batch, loss_type,
                          chunk_size=chunk_size, return_metrics=True, targets_are_shifted=targets_are_shifted)


@partial(jax.jit, static_argnums=(0,),
         static_argnames=("loss_type", "chunk_size", "compute_dtype", "attend", "targets_are_shifted"))
def grads_jit(graphdef, state, inputs, num_items, *, loss_type: str, chunk_size: int,
              compute_dtype: Optional[str] = None, attend=None, targets_are_shifted: bool = False):
    """((loss, metrics), grads as an NNX state) of one micro-batch; ``inputs`` as ``batch_inputs`` returns.

    ``attend`` and ``targets_are_shifted`` as ``loss_fn`` (the trainer's context-parallel step passes
    ``parallel.ring_attention_fn(mesh)`` and the pre-shifted targets of ``parallel.shard_batch``).

    ``compute_dtype="bfloat16"`` runs the forward pass on bfloat16 copies of float32 ``state``
    (mixed precision, like torch autocast); the gradients stay float32, w.r.t. ``state``.
    """
    def scalar_loss(s):
        return loss_fn(nnx.merge(graphdef, cast_floating(s, compute_dtype)), *inputs, num_items, loss_type,
                       chunk_size, attend=attend, targets_are_shifted=targets_are_shifted)

    return jax.value_and_grad(scalar_loss, has_aux=True)(state)


def loss_grads_and_metrics(model: LlamaForCausalLM, batch: Batch, loss_type: str = "nll",
                           chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[float, dict[str, np.ndarray], dict[str, float]]:
    """``loss_and_grads`` plus the loss metrics of ``twinseq.common.loss.metrics`` (as floats)."""
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type={loss_type!r} is not supported by the JAX backend; choose one of {LOSS_TYPES}.")
    check_labels(batch.labels, model.config.vocab_size, batch.num_items_in_batch)
    graphdef, state = nnx.split(model)
    (loss, metrics), grads = grads_jit(graphdef, state, batch_inputs(batch, model.config.vocab_size),
                                       jnp.asarray(batch.num_items_in_batch, jnp.int32),
                                       loss_type=loss_type, chunk_size=int(chunk_size))
    grads_hf = in_hf_order(model.config, state_to_hf(grads))
    return float(loss), grads_hf, {k: float(v) for k, v in metrics.items()}


def loss_and_grads(model: Model, batch: Batch, loss_type: str = "nll", *,
                   chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, grads): grads are float32 numpy in HF names and HF ``[out, in]`` layout.

    The loss is normalised by ``batch.num_items_in_batch`` (the whole step's label count). With
    tied embeddings ``model.embed_tokens.weight`` carries both the embedding and the LM-head
    gradient, and there is no ``lm_head.weight`` entry (as torch's ``named_parameters``).
    """
    loss, grads, _ = loss_grads_and_metrics(model, batch, loss_type, chunk_size)
    return loss, grads
