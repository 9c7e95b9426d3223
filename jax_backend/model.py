"""Flax NNX causal LMs that mirror Hugging Face transformers' ``*ForCausalLM`` op for op (Llama 3.x,
Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral, Mixtral, Gemma 2, Gemma 3 text, gpt-oss: ``common.models.configs``), and the
protocol functions ``build_model``, ``export_weights``, ``logits`` and ``loss_and_grads`` (``common.backend.Backend``).

Every jitted function takes the model as ``(graphdef, state)`` (``nnx.split``), so it compiles
once per (B, T) bucket, loss type and chunk size; ``num_items_in_batch`` is traced.

The module tree and attribute names follow HF's parameter names, so a parameter's NNX path
*is* its HF name: ``model.layers.0.self_attn.q_proj.kernel`` <-> ``model.layers.0.self_attn.
q_proj.weight``. Linear layers keep Flax's ``kernel`` layout ``[in, out]`` (the transpose of
torch's ``[out, in]``) and their ``bias`` as is; embeddings and RMSNorm scales keep HF's layout
under the name ``weight``. One ``CausalLM`` class builds every family: the config decides which
parameters exist (``common.models.configs.parameter_shapes``) and which of the branches below run.

HF details reproduced on purpose (transformers 5.x ``modeling_{llama,qwen2,qwen3,mistral,gemma2,gemma3}.py``):

- RMSNorm: variance in float32, ``x * rsqrt(var + eps)``, cast back, *then* times the weight;
  Gemma's instead multiplies by ``1 + w`` in float32 and casts last;
- RoPE: ``inv_freq`` of ``common.models.rope`` (every ``rope_type``; ``dynamic`` recomputed from the
  batch's largest position id, under ``jit``), the half-split ``rotate_half`` layout, angles from
  ``position_ids`` (so they restart per document); Gemma 3's sliding layers rotate with their own base
  (``common.models.rope.sliding_rope_inv_freq``), its global layers with ``rope_theta`` and its scaling;
  YaRN's cos and sin scaled by ``common.models.rope.rope_attention_factor`` (float32, before the cast);
- attention: q/k/v biases where the family has them; Qwen3's per-head RMSNorm of q and k before
  RoPE (Gemma 3's in the ``1 + w`` form); grouped-query (kv heads repeated in place); scaling
  ``cfg.attention_scale``; Gemma 2's score soft-cap after scaling and before the mask; sliding windows on
  the layers that have them; softmax in float32 (``attention.py``); by default the blocked online-softmax kernel
  (``attn_implementation="sdpa"``, O(T x block) memory), the dense T x T reference with ``"eager"``;
  pluggable: ``model(..., attend=fn)`` runs ``fn`` (e.g. ``parallel.ring_attention_fn(mesh)``, context
  parallel) instead;
- MLP: ``down(act(gate(x)) * up(x))``, SiLU or GELU (tanh), biases with ``mlp_bias``; optionally tiled over
  token chunks (``tiled_mlp_chunk_size``, ALST's tiled MLP), each chunk recomputed in backward;
- Qwen3-MoE and Mixtral: on their sparse layers a router (softmax in float32, top-k, optional renormalisation)
  and the experts as a grouped matmul over the tokens sorted by expert (``SparseMoeBlock``,
  ``moe.grouped_experts`` on CPU and GPU, ``grouped.grouped_matmul``'s ``ragged_dot`` on TPU); with
  ``output_router_logits`` the loss adds transformers' load-balancing loss
  (``loss_fn``); gpt-oss's biased router and biased, clamped-SwiGLU experts (``GptOssMoeBlock``), the same way;
- gpt-oss's attention sinks: a ``sinks`` parameter ``[N]`` per layer, passed to the attention as ``sinks=``
  (``attention.py``: every path carries it);
- Gemma 2 and 3: embeddings times ``sqrt(hidden_size)`` (a float32 constant cast to the compute dtype),
  norms on the attention and MLP *outputs* before each residual add, final logits soft-capped
  (``losses.logits_f32``);
- tied embeddings: the LM head is ``embed_tokens.weight`` itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from functools import partial
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twinseq.common.backend import Model
from twinseq.common.config import ATTN_IMPLEMENTATIONS, DEFAULT_CHUNK_SIZE, ModelConfig
from twinseq.common.data.batching import Batch, check_batch
from twinseq.common.errors import ConfigError
from twinseq.common.models.configs import layer_norm_names
from twinseq.common.models.init import check_weights, init_weights, parameter_shapes
from twinseq.common.models.nf4 import dequantize_nf4, quantize_nf4
from twinseq.common.models.peft import NF4_BLOCKSIZE, TOKENS_KEY, PeftConfig, adapter_key, adapter_shapes
from twinseq.common.models.rope import rope_attention_factor, rope_inv_freq, sliding_rope_inv_freq
from twinseq.common.models.safetensors_stream import LazyArray
from twinseq.jax_backend import moe
from twinseq.jax_backend.attention import attention_for, document_causal_mask, dot_product_attention
from twinseq.jax_backend.grouped import default_block_rows, grouped_matmul, ragged_dot_is_grouped
from twinseq.jax_backend.losses import (
    LOSS_TYPES,
    causal_lm_loss,
    check_labels,
    load_balancing_loss,
    logits_f32,
    router_counts,
    token_nll,
)
from twinseq.jax_backend.memory import StepMemory, remat

T = TypeVar("T")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

AttendFn = Callable[..., jax.Array]
"""``attend(q_BNTD, k_BKTD, v_BKTD, segment_ids_BT, position_ids_BT, scaling, **options) -> out_BNTD``.

``options`` holds ``sliding_window=`` (int), ``softcap=`` (float) and/or ``sinks=`` (the ``[N]`` attention-sink
logits, gpt-oss) on the layers that have a window, an attention soft-cap or sinks, and nothing on the others,
so a hook written for a plain Llama keeps working there and fails loudly (an unexpected keyword) on a layer it
cannot serve. A batch with shared prefixes adds
``parent_ids_BT=`` (int [B, T], ``common.data.prefix_sharing``); without parents it is not passed at all."""

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
}


class AdapterParam(nnx.Param):
    """A PEFT adapter tensor (``lora_A``, ``lora_B``, DoRA's magnitude, trainable-token rows): on a model with
    adapters (``peft.add_adapters``) these are the only parameters that train; every other ``nnx.Param`` is
    frozen (``split_trainable``)."""


_LORA_DROPOUT_KEY: contextvars.ContextVar[Optional[jax.Array]] = contextvars.ContextVar("lora_dropout", default=None)


@contextlib.contextmanager
def lora_dropout(key: Optional[jax.Array]) -> Iterator[None]:
    """While a step is traced inside this block, every adapted layer with ``lora_dropout > 0`` drops its LoRA input
    as PEFT's ``nn.Dropout`` in train mode (``peft.PeftLinear.dropped``: the mask of ``fold_in(key, layer)``);
    ``key`` None (and outside any block): no dropout, PEFT's eval mode."""
    token = _LORA_DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _LORA_DROPOUT_KEY.reset(token)


def active_dropout_key() -> Optional[jax.Array]:
    """The key of the enclosing ``lora_dropout`` block (None: no dropout)."""
    return _LORA_DROPOUT_KEY.get()


def _param(array: np.ndarray, dtype: str) -> nnx.Param:
    return nnx.Param(jnp.asarray(np.asarray(array, dtype=np.float32), dtype=DTYPES[dtype]))


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` with ``kernel = W.T`` for a torch ``nn.Linear`` weight ``W``."""

    def __init__(self, weight_OI: np.ndarray, dtype: str, bias_O: Optional[np.ndarray] = None):
        self.kernel = _param(np.asarray(weight_OI).T, dtype)
        self.bias = None if bias_O is None else _param(bias_O, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...]
        return y if self.bias is None else y + self.bias[...]


def _linear(w: dict[str, np.ndarray], name: str, dtype: str, bias: bool) -> Linear:
    return Linear(w[name + ".weight"], dtype, w[name + ".bias"] if bias else None)


class Embedding(nnx.Module):
    """Token embeddings; ``scale`` (Gemma: ``sqrt(hidden_size)``) multiplies them in the compute dtype,
    as HF's float32 ``embed_scale`` buffer cast to the weight dtype (bfloat16 rounds sqrt(96) = 9.798 to 9.8125)."""

    def __init__(self, weight_VH: np.ndarray, dtype: str, scale: Optional[float] = None):
        self.weight = _param(weight_VH, dtype)
        self.scale = None if scale is None else float(np.float32(scale))

    def table(self) -> jax.Array:
        """[V, H]: the rows looked up (and the tied LM head); trainable tokens replace some of them."""
        return self.weight[...]

    def __call__(self, input_ids_BT: jax.Array) -> jax.Array:
        x_BTH = jnp.take(self.table(), input_ids_BT, axis=0)
        if self.scale is None:
            return x_BTH
        return x_BTH * jnp.asarray(np.float32(self.scale), x_BTH.dtype)


class RMSNorm(nnx.Module):
    """HF's RMSNorm over the last axis. ``unit_offset`` (Gemma): ``(x_normed * (1 + w))`` in float32, cast
    last; otherwise (Llama, Qwen, Mistral) the normed ``x`` is cast to the input dtype first, then times ``w``."""

    def __init__(self, weight_H: np.ndarray, eps: float, dtype: str, unit_offset: bool = False):
        self.weight = _param(weight_H, dtype)
        self.eps = float(eps)
        self.unit_offset = bool(unit_offset)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        if self.unit_offset:
            normed32 = x32 * jax.lax.rsqrt(variance + self.eps)
            return (normed32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return self.weight[...] * normed


def dynamic_rope_inv_freq(
    position_ids_BT: jax.Array,
    inv_freq_F: np.ndarray,
    head_dim: int,
    rope_theta: float,
    factor: float,
    max_position_embeddings: int,
) -> jax.Array:
    """float32 [head_dim / 2] of ``dynamic`` (NTK) RoPE for this batch, traceable:
    ``common.models.rope.dynamic_inv_freq`` with the largest position id read from the traced ``position_ids_BT``.

    ``inv_freq_F`` (the config's unstretched frequencies) is used as is while ``max(position_ids) + 1 <=
    max_position_embeddings``, as HF keeps its initial buffer there; past it the base is stretched with the
    same float32 formula and operation order as ``common.models.rope`` (and transformers). Nothing is remembered
    between calls: a batch's frequencies depend on that batch only.
    """
    f32 = np.float32
    seq_len = jnp.maximum(jnp.max(position_ids_BT) + 1, max_position_embeddings).astype(jnp.float32)
    base = f32(rope_theta) * ((f32(factor) * seq_len / f32(max_position_embeddings)) - f32(factor - 1)) ** f32(
        head_dim / (head_dim - 2)
    )
    exponent_F = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / f32(head_dim)
    stretched_F = f32(1.0) / jnp.power(base, exponent_F)
    return jnp.where(seq_len > max_position_embeddings, stretched_F, jnp.asarray(inv_freq_F))


def rope_cos_sin(
    position_ids_BT: jax.Array, inv_freq: Any, dtype, attention_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, 1, T, head_dim] (the frequencies repeated twice, HF layout), times
    ``attention_factor`` in float32 before the cast (YaRN's ``attention_scaling``; 1.0: no multiply)."""
    freqs_BTF = position_ids_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb_BTD = jnp.concatenate([freqs_BTF, freqs_BTF], axis=-1)
    cos_BTD, sin_BTD = jnp.cos(emb_BTD), jnp.sin(emb_BTD)
    if attention_factor != 1.0:
        cos_BTD, sin_BTD = cos_BTD * np.float32(attention_factor), sin_BTD * np.float32(attention_factor)
    return cos_BTD[:, None].astype(dtype), sin_BTD[:, None].astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x_BNTD: jax.Array, cos_B1TD: jax.Array, sin_B1TD: jax.Array) -> jax.Array:
    return x_BNTD * cos_B1TD + rotate_half(x_BNTD) * sin_B1TD


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], prefix: str, layer: int, dtype: str):
        self.q_proj = _linear(w, prefix + "q_proj", dtype, cfg.qkv_bias)
        self.k_proj = _linear(w, prefix + "k_proj", dtype, cfg.qkv_bias)
        self.v_proj = _linear(w, prefix + "v_proj", dtype, cfg.qkv_bias)
        self.o_proj = _linear(w, prefix + "o_proj", dtype, cfg.o_bias)
        self.q_norm, self.k_norm = (
            RMSNorm(w[f"{prefix}{name}.weight"], cfg.rms_norm_eps, dtype, unit_offset=cfg.gemma)
            if cfg.qk_norm
            else None
            for name in ("q_norm", "k_norm")
        )
        self.head_dim = int(cfg.head_dim)
        self.scaling = cfg.attention_scale
        self.sliding_window = int(cfg.sliding_window) if cfg.layer_is_sliding(layer) else None
        self.softcap = None if cfg.attn_logit_softcapping is None else float(cfg.attn_logit_softcapping)
        self.sinks = _param(w[prefix + "sinks"], dtype) if cfg.has_attention_sinks else None

    def _heads(self, x_BTX: jax.Array) -> jax.Array:
        b, t, _ = x_BTX.shape
        return x_BTX.reshape(b, t, -1, self.head_dim).transpose(0, 2, 1, 3)

    @staticmethod
    def _qk_norm(norm: Optional[RMSNorm], x_BNTD: jax.Array) -> jax.Array:
        """Qwen3's (Gemma 3's) RMSNorm of every head over head_dim, before RoPE (Qwen3 normalises ``[B, T, N, D]``;
        the transpose to ``[B, N, T, D]`` does not change a norm over the last axis)."""
        return x_BNTD if norm is None else norm(x_BNTD)

    def attend_options(self) -> dict[str, Any]:
        """The keywords an ``AttendFn`` gets on this layer (none on a plain Llama layer)."""
        options = {
            "sliding_window": self.sliding_window,
            "softcap": self.softcap,
            "sinks": None if self.sinks is None else self.sinks[...],
        }
        return {k: v for k, v in options.items() if v is not None}

    def __call__(self, x_BTH, cos, sin, attn_args: tuple, attend: Optional[AttendFn]) -> jax.Array:
        """``attend`` None: dense attention, ``attn_args = (allowed_B1TT, allowed_sliding_B1TT or None)``;
        else ``attend(q, k, v, *attn_args[:2], scaling, **attend_options())`` with ``attn_args = (segment_ids_BT,
        position_ids_BT)`` (``()`` for generation's cached attention), or ``(..., parent_ids_BT)`` adding
        ``parent_ids_BT=`` to the options."""
        q_BNTD = apply_rope(self._qk_norm(self.q_norm, self._heads(self.q_proj(x_BTH))), cos, sin)
        k_BKTD = apply_rope(self._qk_norm(self.k_norm, self._heads(self.k_proj(x_BTH))), cos, sin)
        v_BKTD = self._heads(self.v_proj(x_BTH))
        if attend is None:
            allowed_B1TT = attn_args[1] if self.sliding_window is not None else attn_args[0]
            sinks_N = None if self.sinks is None else self.sinks[...]
            out_BNTD = dot_product_attention(
                q_BNTD, k_BKTD, v_BKTD, allowed_B1TT, self.scaling, softcap=self.softcap, sinks_N=sinks_N
            )
        else:
            ids, parents = attn_args[:2], attn_args[2:]  # () for a KV-cache attention (generation)
            options = self.attend_options() | ({"parent_ids_BT": parents[0]} if parents else {})
            out_BNTD = attend(q_BNTD, k_BKTD, v_BKTD, *ids, self.scaling, **options)
        b, _, t, _ = out_BNTD.shape
        return self.o_proj(out_BNTD.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], prefix: str, dtype: str):
        self.gate_proj = _linear(w, prefix + "gate_proj", dtype, cfg.mlp_bias)
        self.up_proj = _linear(w, prefix + "up_proj", dtype, cfg.mlp_bias)
        self.down_proj = _linear(w, prefix + "down_proj", dtype, cfg.mlp_bias)
        self.hidden_act = cfg.hidden_act
        self.tile_size: Optional[int] = None  # tokens per tile (tiled MLP); None: the whole sequence at once

    def dense(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.hidden_act](self.gate_proj(x)) * self.up_proj(x))

    def __call__(self, x_BTH: jax.Array) -> jax.Array:
        b, t, h = x_BTH.shape
        if self.tile_size is None or b * t <= self.tile_size:
            return self.dense(x_BTH)
        return tiled_mlp(self, x_BTH.reshape(b * t, h), self.tile_size).reshape(b, t, h)


def tiled_mlp(mlp: MLP, x_NH: jax.Array, tile_size: int) -> jax.Array:
    """``mlp.dense(x_NH)`` over tiles of ``tile_size`` tokens: ``lax.map`` over the tiles, each under
    ``jax.checkpoint``, so the backward pass recomputes one tile's ``[tile, intermediate]`` gate/up
    activations at a time instead of keeping the sequence's. The tail tile is padded with zero tokens
    (their outputs are dropped; the gradients they would carry are zero because nothing reads them).

    Naive equivalent: ``mlp.dense(x_NH)`` (the same per-token numbers; weight gradients are summed tile
    by tile, so they match up to float32 reassociation).
    """
    n, h = x_NH.shape
    num_tiles = -(-n // tile_size)
    x_CSH = jnp.pad(x_NH, ((0, num_tiles * tile_size - n), (0, 0))).reshape(num_tiles, tile_size, h)
    graphdef, state = nnx.split(mlp)

    @jax.checkpoint
    def tile(state, x_SH):
        return nnx.merge(graphdef, state).dense(x_SH)

    y_CSH = jax.lax.map(lambda x_SH: tile(state, x_SH), x_CSH)
    return y_CSH.reshape(num_tiles * tile_size, -1)[:n]


class NF4ExpertCodes(nnx.Variable):
    """A frozen NF4 expert tensor's codes, uint8 ``[E, a b / 2]`` (``common.models.nf4``, one row per expert)."""


class NF4ExpertAbsmax(nnx.Variable):
    """A frozen NF4 expert tensor's absmax, float32 ``[E, a b / 64]``."""


NF4_EXPERT_TENSORS = ("gate_up_proj", "down_proj")
"""The fused expert tensors QLoRA stores as NF4 (gpt-oss's biases stay float)."""


class SparseMoeBlock(nnx.Module):
    """transformers' ``Qwen3MoeSparseMoeBlock`` and ``MixtralSparseMoeBlock``: a linear router (``gate``, no bias),
    softmax in float32, the top ``num_experts_per_tok`` experts of each token (weights renormalised to sum to 1 where
    ``cfg.renormalise_top_k``; cast to the compute dtype, except Mixtral's, ``cfg.routing_weights_f32``, which weigh
    and sum the experts' outputs in float32), and the sum of those experts' gated MLPs times their weights. The
    experts are transformers 5's fused tensors in its layout: ``gate_up_proj`` ``[E, 2m, h]`` (gate rows, then up
    rows) and ``down_proj`` ``[E, h, m]``.

    The experts run over the token copies sorted by expert: no capacity, no token dropped. On CPU and GPU,
    ``moe.grouped_experts`` (gather and scatter inside, the gate/up pre-activations the only per-copy tensor saved
    for backward); on TPU, with expert LoRA or with ``grouped_experts_kernel = False``, one grouped matmul per
    projection under autodiff (``grouped.grouped_matmul``: ``jax.lax.ragged_dot`` on TPU, block-sparse elsewhere). Naive
    equivalent (what transformers' eager loop computes)::

        y[n] = sum_j w[n, j] * down[e] @ (act(gate[e] @ x[n]) * (up[e] @ x[n]))   with e = top_k(x[n])[j]

    LoRA on the experts (``add_expert_adapters``, PEFT's ``ParamWrapper``): expert ``e``'s weight is
    ``W[e] + scaling * B_e @ A_e``, computed as a second pair of grouped matmuls over the same sorted tokens,
    ``((x @ A_e.T) @ B_e.T) * scaling`` in the adapters' float32, added to the base product and cast back.

    QLoRA (``quantize_experts_nf4``): ``gate_up_proj`` and ``down_proj`` become NF4 storage (``experts.<name>_nf4``
    codes and ``experts.<name>_absmax``, frozen, not ``nnx.Param``s), and the block always runs ``moe.grouped_experts``
    (on every platform, ``grouped_experts_kernel`` notwithstanding), which dequantises one expert per scan step, with
    expert LoRA folded into that expert's weight (``moe.NF4Experts``): at most one expert of each tensor in float at a
    time, never all of them.
    """

    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], prefix: str, dtype: str):
        self.gate = Linear(w[prefix + "gate.weight"], dtype)
        self.experts = nnx.Dict(
            gate_up_proj=_param(w[prefix + "experts.gate_up_proj"], dtype),
            down_proj=_param(w[prefix + "experts.down_proj"], dtype),
        )
        self.num_experts, self.top_k = int(cfg.num_experts), int(cfg.num_experts_per_tok)
        self.renormalise_top_k, self.routing_weights_f32 = cfg.renormalise_top_k, cfg.routing_weights_f32
        self.hidden_act = cfg.hidden_act
        self._init_expert_state()

    def _init_expert_state(self) -> None:
        """The experts' run-time state every MoE block starts with (``GptOssMoeBlock`` and the expert-parallel block
        call this too, so none lacks a field): float experts, no expert LoRA, the kernel where it runs."""
        self.tile_size: Optional[int] = None  # tiled MLP is refused on MoE layers (set_tiled_mlp)
        self.grouped_experts_kernel = True  # moe.grouped_experts but on TPU (False: per-projection grouped matmuls)
        self.expert_lora: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (tensor name, its adapters' place)
        self.lora_scaling = 0.0
        self.adapters_enabled = True
        self.nf4_shapes: tuple[tuple[str, tuple[int, int]], ...] = ()  # (NF4 tensor name, one expert's shape)

    def quantize_experts_nf4(self) -> int:
        """``gate_up_proj`` and ``down_proj`` replaced by their NF4 storage (``common.models.nf4.quantize_nf4`` of each
        expert, float32 absmax), in place; returns how many tensors. ``ValueError`` where an expert is not a whole
        number of NF4 blocks (it would not dequantise alone)."""
        for name in NF4_EXPERT_TENSORS:
            w = np.asarray(jnp.asarray(self.experts[name][...], jnp.float32))
            num_experts, shape = w.shape[0], (int(w.shape[1]), int(w.shape[2]))
            if (shape[0] * shape[1]) % NF4_BLOCKSIZE:
                raise ValueError(f"{name} has {shape[0] * shape[1]} numbers per expert")
            codes, absmax = quantize_nf4(w)
            del self.experts[name]
            self.experts[name + "_nf4"] = NF4ExpertCodes(jnp.asarray(codes.reshape(num_experts, -1)))
            self.experts[name + "_absmax"] = NF4ExpertAbsmax(jnp.asarray(absmax.reshape(num_experts, -1)))
            self.nf4_shapes = (*self.nf4_shapes, (name, shape))
        return len(NF4_EXPERT_TENSORS)

    def dequantized_experts(self) -> dict[str, np.ndarray]:
        """float32 ``{name: [E, a, b]}`` of the NF4 expert tensors (``common.models.nf4.dequantize_nf4``, the numbers
        the kernel multiplies by); empty for float experts."""
        out = {}
        for name, shape in self.nf4_shapes:
            codes = np.asarray(self.experts[name + "_nf4"][...])
            absmax = np.asarray(jnp.asarray(self.experts[name + "_absmax"][...], jnp.float32))
            out[name] = dequantize_nf4(codes, absmax, (codes.shape[0], *shape))
        return out

    def _stored(self, name: str) -> moe.Experts:
        """Expert tensor ``name`` as the kernel takes it: its array, or its ``moe.NF4Experts`` (with its LoRA factors
        while the adapters are on)."""
        shape = dict(self.nf4_shapes).get(name)
        if shape is None:
            return self.experts[name][...]
        place = dict(self.expert_lora).get(name)
        a = b = None
        if place is not None and self.adapters_enabled:
            node = self.experts
            for part in place:
                node = node[part]
            a, b = node["lora_A"][...], node["lora_B"][...]
        codes, absmax = self.experts[name + "_nf4"][...], self.experts[name + "_absmax"][...]
        return moe.NF4Experts(codes, absmax, a, b, shape, self.lora_scaling)

    def add_expert_adapters(
        self, adapters: dict[str, tuple[tuple[str, ...], np.ndarray, np.ndarray]], scaling: float
    ) -> None:
        """LoRA on expert tensors, in place: ``{tensor name (gate_up_proj, down_proj): (place, lora_A [E * r, in],
        lora_B [out, r * E])}`` in PEFT's layout; ``place`` is the path under ``experts`` (PEFT's nesting,
        ``("base_layer",)`` for an inner wrapper), so each ``AdapterParam``'s path is its PEFT key."""
        for place, a, b in adapters.values():
            node = self.experts
            for part in place:
                if part not in node:
                    node[part] = nnx.Dict()
                node = node[part]
            node["lora_A"] = AdapterParam(jnp.asarray(a, jnp.float32))
            node["lora_B"] = AdapterParam(jnp.asarray(b, jnp.float32))
        self.expert_lora = tuple((name, tuple(place)) for name, (place, _, _) in adapters.items())
        self.lora_scaling = float(scaling)

    def _with_lora(self, name: str, y_SO: jax.Array, x_SI: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
        """``y_SO`` plus expert tensor ``name``'s LoRA of ``x_SI`` (per expert ``(x @ A_e.T) @ B_e.T * scaling``)."""
        place = dict(self.expert_lora).get(name)
        if place is None or not self.adapters_enabled:
            return y_SO
        node = self.experts
        for part in place:
            node = node[part]
        a, b = node["lora_A"][...], node["lora_B"][...]
        a_EIR = jnp.swapaxes(a.reshape(self.num_experts, -1, a.shape[-1]), 1, 2)
        b_ERO = b.reshape(b.shape[0], -1, self.num_experts).transpose(2, 1, 0)
        z_SR = grouped_matmul(x_SI.astype(a.dtype), a_EIR, group_sizes_E)
        return (y_SO + grouped_matmul(z_SR, b_ERO, group_sizes_E) * self.lora_scaling).astype(y_SO.dtype)

    def route(self, x_NH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(router_logits_NE in the compute dtype, top-k weights_NK in the compute dtype or float32
        (``routing_weights_f32``), expert ids_NK)."""
        router_logits_NE = self.gate(x_NH)
        probs_NE = jax.nn.softmax(router_logits_NE.astype(jnp.float32), axis=-1)
        weights_NK, experts_NK = jax.lax.top_k(probs_NE, self.top_k)
        if self.renormalise_top_k:
            weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
        weights_dtype = jnp.float32 if self.routing_weights_f32 else router_logits_NE.dtype
        return router_logits_NE, weights_NK.astype(weights_dtype), experts_NK

    def with_router_logits(self, x_BTH: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(y_BTH, router_logits_NE) with N = B * T, the tokens in row-major order: the token copies sorted by
        expert, the experts on them (``moe.grouped_experts`` on CPU, else ``_experts``), each weighted by its
        routing weight and added back to its token."""
        b, t, h = x_BTH.shape
        x_NH = x_BTH.reshape(b * t, h)
        router_logits_NE, weights_NK, experts_NK = self.route(x_NH)
        expert_of_copy = experts_NK.reshape(-1)  # copy i of token i // k
        order = jnp.argsort(expert_of_copy, stable=True)
        token_of_sorted, expert_of_sorted = order // self.top_k, expert_of_copy[order]
        group_sizes_E = jnp.bincount(expert_of_copy, length=self.num_experts).astype(jnp.int32)
        weight_S = weights_NK.reshape(-1)[order]
        if self.nf4_shapes or (
            self.grouped_experts_kernel
            and not ragged_dot_is_grouped()
            and not (self.expert_lora and self.adapters_enabled)
        ):
            tensors = self._expert_tensors()
            compute = jnp.result_type(x_NH, tensors[0].dtype)
            layout = moe.Layout(*self._gate(), sum_dtype=jnp.dtype(self._sum_dtype(compute, weight_S, x_NH)).name)
            y_NH = moe.grouped_experts(
                x_NH,
                weight_S,
                token_of_sorted,
                group_sizes_E,
                *tensors,
                layout=layout,
                block_rows=default_block_rows(),
            )
            return y_NH.astype(x_NH.dtype).reshape(b, t, h), router_logits_NE
        y_SH = self._experts(x_NH[token_of_sorted], expert_of_sorted, group_sizes_E)
        y_SH = y_SH * weight_S[:, None]
        acc = self._sum_dtype(y_SH.dtype, weight_S, x_NH)
        y_NH = jnp.zeros(x_NH.shape, acc).at[token_of_sorted].add(y_SH.astype(acc)).astype(x_NH.dtype)
        return y_NH.reshape(b, t, h), router_logits_NE

    def _experts(self, x_SH: jax.Array, expert_of_sorted: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
        """The experts' gated MLPs over the sorted copies ``x_SH`` (grouped matmuls, expert LoRA beside them)."""
        gate_up_S2 = grouped_matmul(x_SH, self.experts["gate_up_proj"][...], group_sizes_E, transposed=True)
        gate_up_S2 = self._with_lora("gate_up_proj", gate_up_S2, x_SH, group_sizes_E)
        h_SM = self._gate()[1](gate_up_S2)
        y_SH = grouped_matmul(h_SM, self.experts["down_proj"][...], group_sizes_E, transposed=True)
        return self._with_lora("down_proj", y_SH, h_SM, group_sizes_E)

    def _sum_dtype(self, compute: Any, weight_S: jax.Array, x_NH: jax.Array) -> Any:
        """The dtype the weighted copies (experts' outputs in ``compute`` times ``weight_S``) are summed in: their
        product's (float32 for Mixtral's float32 weights, as transformers' grouped experts), cast back to the compute
        dtype after."""
        return jnp.result_type(compute, weight_S)

    def _gate(self) -> tuple[bool, Callable[[jax.Array], jax.Array]]:
        """(output-major storage, the gate of ``gate_up``) for ``moe.grouped_experts``."""
        return True, moe.GluGate(ACTIVATIONS[self.hidden_act])

    def _expert_tensors(self) -> tuple[moe.Experts, moe.Experts, Optional[jax.Array], Optional[jax.Array]]:
        """(gate_up, down, gate_up bias, down bias): the experts' tensors as stored (``_stored``), ``None`` for absent
        biases."""
        return self._stored("gate_up_proj"), self._stored("down_proj"), None, None

    def __call__(self, x_BTH: jax.Array) -> jax.Array:
        return self.with_router_logits(x_BTH)[0]


class GptOssMoeBlock(SparseMoeBlock):
    """transformers' ``GptOssMLP``: a router with a bias (``router``), whose softmax is taken over each token's top-k
    logits only (in the compute dtype), and experts with biases in gpt-oss's layout, input-major: ``gate_up_proj``
    ``[E, h, 2m]`` with gate and up interleaved (gate ``[..., ::2]``, up ``[..., 1::2]``), ``gate_up_proj_bias``
    ``[E, 2m]``, ``down_proj`` ``[E, m, h]``, ``down_proj_bias`` ``[E, h]``; the clamped SwiGLU (``GptOssExperts.
    _apply_gate``). Grouped matmuls over the sorted token copies as ``SparseMoeBlock``. Naive equivalent::

        g, u = (x[n] @ gate_up[e] + b1[e])[::2], [1::2]     with e = top_k(router(x[n]))[j]
        g, u = min(g, limit), clip(u, -limit, limit)
        y[n] = sum_j w[n, j] * (((u + 1) * g * sigmoid(alpha * g)) @ down[e] + b2[e])

    LoRA on these experts is refused (``common.models.peft``): PEFT's expert LoRA assumes the output-major
    ``[E, out, in]`` tensors of Qwen3-MoE and Mixtral.
    """

    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], prefix: str, dtype: str):
        self.router = _linear(w, prefix + "router", dtype, bias=True)
        self.experts = nnx.Dict({name: _param(w[prefix + "experts." + name], dtype) for name in GPT_OSS_EXPERT_TENSORS})
        self.num_experts, self.top_k = int(cfg.num_experts), int(cfg.num_experts_per_tok)
        self.swiglu_limit, self.swiglu_alpha = float(cfg.swiglu_limit), float(cfg.swiglu_alpha)
        self._init_expert_state()

    def route(self, x_NH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(router_logits_NE, top-k weights_NK (softmax of the top-k logits), expert ids_NK), compute dtype."""
        router_logits_NE = self.router(x_NH)
        top_logits_NK, experts_NK = jax.lax.top_k(router_logits_NE, self.top_k)
        weights_NK = jax.nn.softmax(top_logits_NK, axis=-1)
        return router_logits_NE, weights_NK, experts_NK

    def _experts(self, x_SH: jax.Array, expert_of_sorted: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
        gate_up_S2 = grouped_matmul(x_SH, self.experts["gate_up_proj"][...], group_sizes_E)
        h_SM = self._gate()[1](gate_up_S2 + self.experts["gate_up_proj_bias"][...][expert_of_sorted])
        y_SH = grouped_matmul(h_SM, self.experts["down_proj"][...], group_sizes_E)
        return y_SH + self.experts["down_proj_bias"][...][expert_of_sorted]

    def _sum_dtype(self, compute: Any, weight_S: jax.Array, x_NH: jax.Array) -> Any:
        """transformers' gpt-oss casts each weighted copy to the compute dtype before the sum."""
        return x_NH.dtype

    def _gate(self) -> tuple[bool, Callable[[jax.Array], jax.Array]]:
        return False, moe.ClampedSwiGLU(self.swiglu_limit, self.swiglu_alpha)

    def _expert_tensors(self) -> tuple[moe.Experts, moe.Experts, Optional[jax.Array], Optional[jax.Array]]:
        biases = self.experts["gate_up_proj_bias"][...], self.experts["down_proj_bias"][...]
        return self._stored("gate_up_proj"), self._stored("down_proj"), *biases


GPT_OSS_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _moe_block(cfg: ModelConfig, w: dict[str, np.ndarray], prefix: str, dtype: str) -> SparseMoeBlock:
    return GptOssMoeBlock(cfg, w, prefix, dtype) if cfg.expert_biases else SparseMoeBlock(cfg, w, prefix, dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer. Llama-like families: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (HF calls
    the second norm ``post_attention_layernorm``). Gemma 2 ("sandwich"): ``x + post_attn(attn(in(x)))``, then
    ``x + post_ff(mlp(pre_ff(x)))``: its ``post_attention_layernorm`` normalises the attention *output*."""

    def __init__(self, cfg: ModelConfig, w: dict[str, np.ndarray], layer: int, dtype: str):
        p = f"model.layers.{layer}."
        self.self_attn = Attention(cfg, w, p + "self_attn.", layer, dtype)
        self.mlp: Union[MLP, SparseMoeBlock] = (
            _moe_block(cfg, w, p + "mlp.", dtype) if cfg.layer_is_moe(layer) else MLP(cfg, w, p + "mlp.", dtype)
        )
        for name in layer_norm_names(cfg):
            setattr(self, name, RMSNorm(w[f"{p}{name}.weight"], cfg.rms_norm_eps, dtype, unit_offset=cfg.gemma))
        self.sandwich = cfg.gemma

    def __call__(self, x_BTH, cos, sin, attn_args: tuple, attend: Optional[AttendFn]) -> jax.Array:
        return self.forward(x_BTH, cos, sin, attn_args, attend)[0]

    def forward(self, x_BTH, cos, sin, attn_args: tuple, attend: Optional[AttendFn]):
        """(x_BTH, router_logits_NE of a MoE layer or None)."""
        attn_BTH = self.self_attn(self.input_layernorm(x_BTH), cos, sin, attn_args, attend)
        if not self.sandwich:
            x_BTH = x_BTH + attn_BTH
            mlp_BTH, router_logits = self._mlp(self.post_attention_layernorm(x_BTH))
            return x_BTH + mlp_BTH, router_logits
        x_BTH = x_BTH + self.post_attention_layernorm(attn_BTH)
        return x_BTH + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x_BTH))), None

    def _mlp(self, x_BTH):
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp.with_router_logits(x_BTH)
        return self.mlp(x_BTH), None


def _layer_apply(graphdef, attend, state, x_BTH, cos, sin, attn_args):
    """A decoder layer as a pure function of its parameters, so ``jax.checkpoint`` sees them as inputs.

    ``graphdef`` and ``attend`` are static (hashable; ``attend`` may close over a mesh).
    """
    return nnx.merge(graphdef, state).forward(x_BTH, cos, sin, attn_args, attend)


class DecoderModel(nnx.Module):
    """HF's ``model.`` prefix: embeddings, decoder layers, final norm, and the RoPE of the config."""

    def __init__(
        self,
        cfg: ModelConfig,
        w: dict[str, np.ndarray],
        dtype: str,
        remat_policy: str,
        attn_implementation: str = "sdpa",
        attention_block_size: int = 512,
    ):
        embed_scale = cfg.hidden_size**0.5 if cfg.gemma else None
        self.embed_tokens = Embedding(w["model.embed_tokens.weight"], dtype, embed_scale)
        self.layers = nnx.List([DecoderLayer(cfg, w, i, dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(w["model.norm.weight"], cfg.rms_norm_eps, dtype, unit_offset=cfg.gemma)
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(cfg))  # static: floats live in the graphdef
        sliding_inv_freq = sliding_rope_inv_freq(cfg)  # Gemma 3: the sliding layers' own base, else None
        self.sliding_inv_freq = None if sliding_inv_freq is None else tuple(float(f) for f in sliding_inv_freq)
        self.rope_attention_factor = rope_attention_factor(cfg)  # YaRN's scale of cos and sin; 1.0 otherwise
        self.dynamic_rope = (
            None
            if cfg.rope_type != "dynamic"
            else (int(cfg.head_dim), float(cfg.rope_theta), float(cfg.rope_factor), int(cfg.max_position_embeddings))
        )
        windows = {layer.self_attn.sliding_window for layer in self.layers} - {None}
        assert len(windows) <= 1, windows  # one window per model (HF's config has one sliding_window)
        self.sliding_window = windows.pop() if windows else None
        self.remat_policy = remat_policy
        remat(_layer_apply, remat_policy, static_argnums=(0, 1))  # validate the policy at build time
        self.attn_implementation = attn_implementation
        self.attention_block_size = attention_block_size
        attention_for(attn_implementation, attention_block_size)  # validate the block size at build time

    def rope_inv_freq(self, position_ids_BT: jax.Array) -> Any:
        """float32 [head_dim / 2]: the config's constants, or for ``dynamic`` RoPE this batch's frequencies."""
        inv_freq_F = np.asarray(self.inv_freq, np.float32)
        if self.dynamic_rope is None:
            return inv_freq_F
        return dynamic_rope_inv_freq(position_ids_BT, inv_freq_F, *self.dynamic_rope)

    def layer_rope(self, position_ids_BT: jax.Array, dtype) -> list[tuple[jax.Array, jax.Array]]:
        """(cos, sin) of every layer, in order: one pair shared by all, except that Gemma 3's sliding layers take
        the pair of their own base (``sliding_inv_freq``)."""
        rope = rope_cos_sin(position_ids_BT, self.rope_inv_freq(position_ids_BT), dtype, self.rope_attention_factor)
        if self.sliding_inv_freq is None:
            return [rope] * len(self.layers)
        sliding = rope_cos_sin(position_ids_BT, np.asarray(self.sliding_inv_freq, np.float32), dtype)
        return [sliding if layer.self_attn.sliding_window is not None else rope for layer in self.layers]

    def __call__(
        self, input_ids_BT, position_ids_BT, segment_ids_BT, attend: Optional[AttendFn] = None, parent_ids_BT=None
    ) -> jax.Array:
        return self.with_router_logits(input_ids_BT, position_ids_BT, segment_ids_BT, attend, parent_ids_BT)[0]

    def with_router_logits(
        self, input_ids_BT, position_ids_BT, segment_ids_BT, attend: Optional[AttendFn] = None, parent_ids_BT=None
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """(final-norm hidden_BTH, the router logits ``[B * T, E]`` of every MoE layer in order; () without).
        ``parent_ids_BT``: each token's parent segment (shared prefixes); None: none, the program of old."""
        x_BTH = self.embed_tokens(input_ids_BT)
        ropes = self.layer_rope(position_ids_BT, x_BTH.dtype)
        attend = attention_for(self.attn_implementation, self.attention_block_size) if attend is None else attend
        if attend is None:
            # The dense masks are built once and shared by every layer of their kind.
            allowed_B1TT = document_causal_mask(segment_ids_BT, position_ids_BT, parent_ids_BT=parent_ids_BT)
            sliding_B1TT = (
                None
                if self.sliding_window is None
                else document_causal_mask(segment_ids_BT, position_ids_BT, self.sliding_window, parent_ids_BT)
            )
            attn_args = (allowed_B1TT, sliding_B1TT)
        else:
            attn_args = (segment_ids_BT, position_ids_BT)
            attn_args += () if parent_ids_BT is None else (parent_ids_BT,)
        layer_fn = remat(_layer_apply, self.remat_policy, static_argnums=(0, 1))
        router_logits = []
        for layer, (cos, sin) in zip(self.layers, ropes):
            graphdef, state = nnx.split(layer)
            x_BTH, layer_router_logits = layer_fn(graphdef, attend, state, x_BTH, cos, sin, attn_args)
            if layer_router_logits is not None:
                router_logits.append(layer_router_logits)
        return self.norm(x_BTH), tuple(router_logits)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class CausalLM(nnx.Module):
    """``model(input_ids, position_ids, segment_ids, attend=None) -> hidden_BTH`` (after the final norm), for
    every family of ``common.models.configs``.

    ``attn_implementation`` picks the attention of every layer when no ``attend`` is given: ``"eager"``
    the dense document mask (the reference), any other value (default ``"sdpa"``) the blocked kernel
    with ``attention_block_size`` tiles (``attention.attention_for``). ``tiled_mlp_chunk_size`` (None:
    off) runs every MLP over token tiles (``tiled_mlp``). ``attend`` (an ``AttendFn``, static under
    ``jit``) replaces the attention of every layer, e.g. ``parallel.ring_attention_fn(mesh)`` on a batch placed by
    ``parallel.shard_batch``. ``logits(...)`` adds the LM head (and Gemma's final soft-cap); losses
    take ``hidden_BTH``, ``lm_head_VH()`` and ``final_logit_softcapping`` so that a chunked or fused
    loss never needs the full logits.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, np.ndarray],
        *,
        dtype: str = "float32",
        remat_policy: str = "none",
        attn_implementation: str = "sdpa",
        attention_block_size: int = 512,
        tiled_mlp_chunk_size: Optional[int] = None,
    ):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not valid; choose one of {tuple(DTYPES)}.")
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"attn_implementation={attn_implementation!r} is unknown; choose one of "
                f"{ATTN_IMPLEMENTATIONS} ('eager': dense reference, the others: blocked attention)."
            )
        check_weights(cfg, weights)
        self.model = DecoderModel(cfg, weights, dtype, remat_policy, attn_implementation, attention_block_size)
        set_tiled_mlp(self, tiled_mlp_chunk_size)
        self.lm_head: Optional[Linear] = None if cfg.tie_word_embeddings else Linear(weights["lm_head.weight"], dtype)
        # hashable (lists as tuples): it lives in the static graphdef
        self.config_items = tuple(sorted((k, _hashable(v)) for k, v in cfg.to_dict().items()))
        self.final_logit_softcapping = (
            None if cfg.final_logit_softcapping is None else float(cfg.final_logit_softcapping)
        )
        # (router_aux_loss_coef, num_experts, num_experts_per_tok) where the loss adds the MoE aux loss, else None
        self.router_aux = (
            (float(cfg.router_aux_loss_coef), int(cfg.num_experts), int(cfg.num_experts_per_tok))
            if cfg.output_router_logits and cfg.num_experts
            else None
        )
        self.dtype = dtype

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_dict({k: list(v) if isinstance(v, tuple) else v for k, v in self.config_items})

    def options(self) -> dict[str, Any]:
        """The build options beyond config and weights (``CausalLM(cfg, weights, **model.options())`` rebuilds
        a model that runs the same code paths)."""
        tiles = {layer.mlp.tile_size for layer in self.model.layers}
        return dict(
            dtype=self.dtype,
            remat_policy=self.model.remat_policy,
            attn_implementation=self.model.attn_implementation,
            attention_block_size=self.model.attention_block_size,
            tiled_mlp_chunk_size=tiles.pop(),
        )

    def lm_head_VH(self) -> jax.Array:
        if self.lm_head is None:
            return self.model.embed_tokens.table()
        return self.lm_head.kernel[...].T

    def __call__(
        self, input_ids_BT, position_ids_BT, segment_ids_BT, attend: Optional[AttendFn] = None, parent_ids_BT=None
    ) -> jax.Array:
        return self.model(input_ids_BT, position_ids_BT, segment_ids_BT, attend, parent_ids_BT)

    def with_router_logits(
        self, input_ids_BT, position_ids_BT, segment_ids_BT, attend: Optional[AttendFn] = None, parent_ids_BT=None
    ):
        """(hidden_BTH, router logits ``[B * T, E]`` of every MoE layer, in order; () for a dense model)."""
        return self.model.with_router_logits(input_ids_BT, position_ids_BT, segment_ids_BT, attend, parent_ids_BT)

    def logits(
        self, input_ids_BT, position_ids_BT, segment_ids_BT, attend: Optional[AttendFn] = None, parent_ids_BT=None
    ) -> jax.Array:
        """float32 [B, T, V]: HF's ``lm_head(hidden_states)`` upcast, then soft-capped where the family caps."""
        hidden_BTH = self(input_ids_BT, position_ids_BT, segment_ids_BT, attend, parent_ids_BT)
        return logits_f32(hidden_BTH, self.lm_head_VH(), self.final_logit_softcapping)


def set_tiled_mlp(model: CausalLM, chunk_size: Optional[int]) -> None:
    """Run every decoder MLP of ``model`` over tiles of ``chunk_size`` tokens (None: untiled); see ``tiled_mlp``."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ConfigError(
            f"tiled_mlp_chunk_size={chunk_size!r} is not valid; pass a positive integer (tokens per MLP tile) "
            f"or None to run the MLP untiled."
        )
    for i, layer in enumerate(model.model.layers):
        if chunk_size is not None and isinstance(layer.mlp, SparseMoeBlock):
            raise ConfigError(
                f"tiled_mlp_chunk_size={chunk_size} tiles dense MLPs; layer {i} is a mixture of experts (its grouped "
                f"matmul already runs over the routed tokens only): drop tiled_mlp_chunk_size."
            )
        layer.mlp.tile_size = chunk_size


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


def in_hf_order(cfg: ModelConfig, tensors: dict[str, T]) -> dict[str, T]:
    """``tensors`` reordered as ``parameter_shapes(cfg)`` (the order of ``init_weights``)."""
    order = parameter_shapes(cfg)
    assert set(order) == set(tensors), sorted(set(order) ^ set(tensors))
    return {name: tensors[name] for name in order}


def export_weights(model: Model) -> dict[str, np.ndarray]:
    """HF-named float32 numpy weights, in the order of ``parameter_shapes`` (``init_weights`` order).

    On a model with adapters: its base weights (a 4-bit base dequantised), without the adapters
    (``peft.export_adapters``; ``peft.merge_adapters`` folds them in)."""
    if has_adapters(model):
        return base_weights(model)
    return in_hf_order(model.config, state_to_hf(nnx.state(model, nnx.Param)))


def lazy_weights(model: Model) -> dict[str, LazyArray]:
    """``export_weights`` of a plain model, streamed: each tensor converted (float32, HF layout) only when a writer
    asks for it, so a save holds one tensor beyond the live parameters."""
    if has_adapters(model):
        raise ValueError("lazy_weights takes a plain model; a model with adapters saves its adapters")
    lazy: dict[str, LazyArray] = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        transpose = str(path[-1]) == "kernel"

        def produce(value=value, transpose=transpose) -> np.ndarray:
            array = np.asarray(jnp.asarray(value, dtype=jnp.float32))
            return np.ascontiguousarray(array.T) if transpose else array

        shape = tuple(value.shape)
        lazy[hf_name(path)] = LazyArray(shape[::-1] if transpose else shape, "float32", produce)
    return in_hf_order(model.config, lazy)


def has_adapters(model: Model) -> bool:
    """Whether ``peft.add_adapters`` gave ``model`` adapters."""
    return getattr(model, "peft_json", None) is not None


def peft_config(model: Model) -> PeftConfig:
    """The ``PeftConfig`` ``peft.add_adapters`` gave ``model`` (``ConfigError`` on a plain model)."""
    if not has_adapters(model):
        raise ConfigError(
            f"this {type(model).__name__} has no adapters; add them with add_adapters(model, cfg, peft) first."
        )
    return PeftConfig(**json.loads(model.peft_json))


def adapter_key_of_path(path: tuple) -> str:
    """The PEFT saved key of the ``AdapterParam`` at NNX state path ``path``."""
    parts = [str(p) for p in path]
    if parts[-1] == "token_values":
        return TOKENS_KEY
    return adapter_key(".".join(parts[:-1]), parts[-1])


def adapters_by_key(model: Model, state: Any) -> dict[str, np.ndarray]:
    """An adapter state (``nnx.state(model, AdapterParam)``, or a gradient of one) as float32 numpy by PEFT
    key, in ``common.models.peft.adapter_shapes`` order."""
    out = {
        adapter_key_of_path(path): np.asarray(jnp.asarray(v.get_value(), jnp.float32))
        for path, v in nnx.to_flat_state(state)
    }
    order = adapter_shapes(model.config, peft_config(model))
    assert set(order) == set(out), sorted(set(order) ^ set(out))
    return {k: out[k] for k in order}


def base_weights(model: Model) -> dict[str, np.ndarray]:
    """The base's HF-named float32 weights (NF4 weights dequantised), in ``parameter_shapes`` order.

    A linear layer whose weight is not a ``kernel`` parameter (``kernel`` None: ``peft.PeftLinear``'s 4-bit
    base) gives it by its ``base_kernel()`` ([in, out], dequantised); a MoE block's NF4 experts by
    ``SparseMoeBlock.dequantized_experts``."""
    frozen = nnx.state(model, nnx.All(nnx.Param, nnx.Not(AdapterParam)))
    out = state_to_hf(frozen)
    for path, module in nnx.iter_modules(model):
        prefix = ".".join(str(p) for p in path)
        if hasattr(module, "base_kernel") and module.kernel is None:
            out[prefix + ".weight"] = np.asarray(jnp.asarray(module.base_kernel(), jnp.float32)).T
        if isinstance(module, SparseMoeBlock):
            out.update({f"{prefix}.experts.{n}": w for n, w in module.dequantized_experts().items()})
    return in_hf_order(model.config, out)


def split_trainable(model: Model) -> tuple[Any, Any, Any]:
    """(graphdef, trainable state, frozen state or None): a plain model trains every parameter (its whole
    state); a model with adapters trains its ``AdapterParam``s only, the rest (base, 4-bit codes) is frozen.
    ``merge_state`` undoes it."""
    if has_adapters(model):
        return nnx.split(model, AdapterParam, ...)
    graphdef, state = nnx.split(model)
    return graphdef, state, None


def merge_state(graphdef, state, frozen=None) -> Any:
    """The model of ``split_trainable``'s parts (``frozen`` None: a plain model's whole state)."""
    return nnx.merge(graphdef, state) if frozen is None else nnx.merge(graphdef, state, frozen)


def grads_by_name(model: Model, grads: Any) -> dict[str, np.ndarray]:
    """Gradients of ``split_trainable``'s trainable state as float32 numpy: by HF name and layout (a plain
    model), or by PEFT saved key (a model with adapters, in ``common.models.peft.adapter_shapes`` order)."""
    if has_adapters(model):
        return adapters_by_key(model, grads)
    return in_hf_order(model.config, state_to_hf(grads))


def cast_floating(state: Any, compute_dtype: Optional[str]) -> Any:
    """``state`` with its floating leaves cast to ``compute_dtype`` (None: unchanged): mixed precision,
    float32 master weights with a bfloat16 forward, like torch autocast."""
    if compute_dtype is None:
        return state
    return jax.tree.map(
        lambda x: x.astype(DTYPES[compute_dtype]) if jnp.issubdtype(x.dtype, jnp.floating) else x, state
    )


# --------------------------------------------------------------------------------------
# Backend protocol
# --------------------------------------------------------------------------------------


def build_model(
    cfg: ModelConfig,
    weights: Optional[dict[str, np.ndarray]] = None,
    *,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    device: Any = None,
) -> Model:
    """An NNX ``CausalLM`` of ``cfg``'s family holding ``weights`` (HF names, torch layout), on ``device``.

    ``weights`` None draws ``common.models.init.init_weights(cfg, seed=0)``, the same model the torch
    backend builds. ``dtype`` is the parameter and compute dtype (``float32`` or ``bfloat16``, as
    HF's ``torch_dtype``). ``attn_implementation`` (every value of ``common.config`` is accepted, so
    one config runs on both backends) maps to the JAX backend's two attention paths, both masked by
    segment and position ids (``attention.py``):

    - ``"eager"``: the dense reference, a ``[B, 1, T, T]`` document mask and T x T scores in HF's eager
      operation order; what parity tests compare against;
    - ``"sdpa"`` (default), ``"varlen"``, ``"flex_attention"``, ``"flash_attention_2/3"``: blocked
      online-softmax attention (``attention.blocked_document_attention``, the ring's kernel) in tiles
      of 512 tokens (``CausalLM(attention_block_size=...)``; the trainer reads
      ``memory.attention_block_size``), O(T x block) memory in forward and backward. No fused kernel:
      ``jax.nn.dot_product_attention`` (cuDNN) takes no segment ids in jax 0.10, only a dense mask.

    ``device`` (a ``jax.Device``) places the parameters; None uses JAX's default device.
    """
    model = CausalLM(
        cfg,
        init_weights(cfg, seed=0) if weights is None else weights,
        dtype=dtype,
        attn_implementation=attn_implementation,
    )
    if device is not None:
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, jax.device_put(state, device))
    return model


def batch_inputs(batch: Batch, vocab_size: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(input_ids, position_ids, segment_ids, labels) as int32 device arrays, after range checks."""
    check_batch(batch, vocab_size)
    return tuple(
        jnp.asarray(a, jnp.int32)
        for a in (batch.input_ids, batch.position_ids, batch.segment_ids, batch.labels)  # type: ignore[return-value]
    )


def batch_parents(batch: Batch) -> Optional[jax.Array]:
    """int32 ``parent_ids`` of a batch with shared prefixes (``CausalLM``'s ``parent_ids_BT``), else None (no
    parents, so the compiled program is the one without them). Checked by ``batch_inputs``."""
    if not batch.shares_prefix:
        return None
    return jnp.asarray(batch.parent_ids, jnp.int32)


@partial(jax.jit, static_argnums=(0,))
def _forward_jit(graphdef, state, input_ids_BT, position_ids_BT, segment_ids_BT, labels_BT):
    """(float32 logits [B, T, V], per-token NLL [B, T]) from one compiled forward pass (both soft-capped
    where the family caps its logits)."""
    model = nnx.merge(graphdef, state)
    hidden_BTH = model(input_ids_BT, position_ids_BT, segment_ids_BT)
    cap = model.final_logit_softcapping
    logits_BTV = logits_f32(hidden_BTH, model.lm_head_VH(), cap)
    return logits_BTV, token_nll(hidden_BTH, model.lm_head_VH(), labels_BT, logit_softcap=cap)


def logits(model: Model, batch: Batch) -> np.ndarray:
    """np.float32 [B, T, V]. Padding positions hold finite values that mean nothing."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward_jit(graphdef, state, *batch_inputs(batch, model.config.vocab_size))[0])


def token_losses(model: CausalLM, batch: Batch) -> np.ndarray:
    """np.float32 [B, T]: the NLL of ``labels[:, t + 1]`` predicted at t; 0 where ignored."""
    check_labels(batch.labels, model.config.vocab_size, batch.num_items_in_batch)
    graphdef, state = nnx.split(model)
    return np.asarray(_forward_jit(graphdef, state, *batch_inputs(batch, model.config.vocab_size))[1])


def loss_fn(
    model: CausalLM,
    input_ids_BT,
    position_ids_BT,
    segment_ids_BT,
    labels_BT,
    num_items_in_batch,
    loss_type: str = "nll",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    attend=None,
    targets_are_shifted: bool = False,
    num_micro_batches: int = 1,
    parent_ids_BT=None,
):
    """(loss, metrics) of one micro-batch; traceable, used by ``loss_and_grads`` and the trainer.

    ``attend``: the model's attention function (None: dense; see ``CausalLM``); ``parent_ids_BT``: shared
    prefixes (None: none);
    ``targets_are_shifted``: ``labels_BT`` are already the targets (context-parallel batches).

    A MoE model with ``output_router_logits`` adds ``router_aux_loss_coef * aux_loss / num_micro_batches``
    (``losses.load_balancing_loss`` over this micro-batch's real tokens, ``metrics["aux_loss"]``): the aux loss
    is a per-micro-batch mean, so the step's micro-batches, summed, add the coefficient times their mean (TRL's
    rule); the NLL is already normalised by the whole step's ``num_items_in_batch``. A MoE model's metrics also
    hold ``router_counts`` (int32 [L, E], ``losses.router_counts`` over the real tokens; the step adds them up).
    """
    hidden_BTH, router_logits = model.with_router_logits(
        input_ids_BT, position_ids_BT, segment_ids_BT, attend, parent_ids_BT
    )
    loss, metrics = causal_lm_loss(
        hidden_BTH,
        model.lm_head_VH(),
        labels_BT,
        num_items_in_batch,
        loss_type,
        chunk_size=chunk_size,
        return_metrics=True,
        targets_are_shifted=targets_are_shifted,
        logit_softcap=model.final_logit_softcapping,
    )
    if router_logits:
        valid_N = (segment_ids_BT != 0).reshape(-1)
        top_k = model.config.num_experts_per_tok
        metrics = {**metrics, "router_counts": router_counts(router_logits, top_k, valid_N)}
    if model.router_aux is None or not router_logits:
        return loss, metrics
    coef, num_experts, top_k = model.router_aux
    aux = load_balancing_loss(router_logits, num_experts, top_k, (segment_ids_BT != 0).reshape(-1))
    return loss + (coef / num_micro_batches) * aux, {**metrics, "aux_loss": aux}


@partial(
    jax.jit,
    static_argnums=(0,),
    static_argnames=("loss_type", "chunk_size", "compute_dtype", "attend", "targets_are_shifted", "num_micro_batches"),
)
def grads_jit(
    graphdef,
    state,
    inputs,
    num_items,
    *,
    loss_type: str,
    chunk_size: int,
    compute_dtype: Optional[str] = None,
    attend=None,
    targets_are_shifted: bool = False,
    frozen=None,
    dropout_key=None,
    num_micro_batches: int = 1,
):
    """((loss, metrics), grads as an NNX state) of one micro-batch; ``inputs`` as ``batch_inputs`` returns.

    ``attend`` and ``targets_are_shifted`` as ``loss_fn`` (the trainer's context-parallel step passes
    ``parallel.ring_attention_fn(mesh)`` and the pre-shifted targets of ``parallel.shard_batch``).

    ``compute_dtype="bfloat16"`` runs the forward pass on bfloat16 copies of float32 ``state``
    (mixed precision, like torch autocast); the gradients stay float32, w.r.t. ``state``.

    ``frozen``: the state that gets no gradient (``split_trainable``: a model with adapters trains only them).
    ``dropout_key``: LoRA dropout in train mode (``lora_dropout``; None: none, PEFT's eval mode).
    ``num_micro_batches``: the step's micro-batch count, which divides a MoE model's aux loss (``loss_fn``).
    """

    def scalar_loss(s):
        model = merge_state(graphdef, cast_floating(s, compute_dtype), cast_floating(frozen, compute_dtype))
        with lora_dropout(dropout_key):
            return loss_fn(
                model,
                *inputs,
                num_items,
                loss_type,
                chunk_size,
                attend=attend,
                targets_are_shifted=targets_are_shifted,
                num_micro_batches=num_micro_batches,
            )

    return jax.value_and_grad(scalar_loss, has_aux=True)(state)


@partial(
    jax.jit,
    static_argnums=(0,),
    static_argnames=("loss_type", "chunk_size", "compute_dtype", "attend", "targets_are_shifted", "num_micro_batches"),
)
def loss_jit(
    graphdef,
    state,
    inputs,
    num_items,
    *,
    loss_type: str,
    chunk_size: int,
    compute_dtype: Optional[str] = None,
    attend=None,
    targets_are_shifted: bool = False,
    frozen=None,
    num_micro_batches: int = 1,
):
    """(loss, metrics) of one micro-batch without gradients: ``grads_jit``'s forward, same arguments (evaluation)."""
    model = merge_state(graphdef, cast_floating(state, compute_dtype), cast_floating(frozen, compute_dtype))
    return loss_fn(
        model,
        *inputs,
        num_items,
        loss_type,
        chunk_size,
        attend=attend,
        targets_are_shifted=targets_are_shifted,
        num_micro_batches=num_micro_batches,
    )


def loss_grads_and_metrics(
    model: CausalLM, batch: Batch, loss_type: str = "nll", chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[float, dict[str, np.ndarray], dict[str, float]]:
    """``loss_and_grads`` plus the loss metrics of ``twinseq.common.objectives.nll.metrics`` (as floats)."""
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type={loss_type!r} is not supported by the JAX backend; choose one of {LOSS_TYPES}.")
    check_labels(batch.labels, model.config.vocab_size, batch.num_items_in_batch)
    graphdef, state, frozen = split_trainable(model)
    (loss, metrics), grads = grads_jit(
        graphdef,
        state,
        batch_inputs(batch, model.config.vocab_size),
        jnp.asarray(batch.num_items_in_batch, jnp.int32),
        loss_type=loss_type,
        chunk_size=int(chunk_size),
        frozen=frozen,
    )
    # a MoE model's router_counts (an array) are not a loss metric: the trainer's micro-step reads them
    return float(loss), grads_by_name(model, grads), {k: float(v) for k, v in metrics.items() if jnp.ndim(v) == 0}


def loss_and_grads(
    model: Model, batch: Batch, loss_type: str = "nll", *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, grads): grads are float32 numpy in HF names and HF ``[out, in]`` layout.

    The loss is normalised by ``batch.num_items_in_batch`` (the whole step's label count). With
    tied embeddings ``model.embed_tokens.weight`` carries both the embedding and the LM-head
    gradient, and there is no ``lm_head.weight`` entry (as torch's ``named_parameters``).
    On a model with adapters (``peft.add_adapters``) the gradients are the adapters' only, by PEFT
    saved key (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, PEFT's layout).
    """
    loss, grads, _ = loss_grads_and_metrics(model, batch, loss_type, chunk_size)
    return loss, grads


# --------------------------------------------------------------------------------------
# Memory of a compiled step
# --------------------------------------------------------------------------------------


def compiled_step_memory(
    model_cfg: ModelConfig,
    seq_len: int,
    *,
    batch_size: int = 1,
    dtype: str = "float32",
    loss_type: str = "fused_linear",
    chunk_size: Optional[int] = None,
    remat_policy: str = "none",
    attn_implementation: str = "sdpa",
    attention_block_size: int = 512,
    tiled_mlp_chunk_size: Optional[int] = None,
) -> StepMemory:
    """The memory of one JAX training step (loss, metrics and gradients of a ``[batch_size, seq_len]``
    micro-batch: ``grads_jit``) for ``model_cfg`` (a ``ModelConfig``), from compilation alone.

    Nothing runs and no parameter is allocated: the step is lowered on abstract shapes
    (``jax.ShapeDtypeStruct``) and compiled, so a dense ``T x T`` step too large to execute can still be
    measured. The optimizer update is not part of it (its memory is O(parameters), independent of T).
    ``dtype`` is the compute dtype (float32 master weights, like the trainer); the other arguments are
    the trainer's knobs of the same names (``remat_policy`` as ``memory.remat_policy_of``). The model is built
    with ``jax.eval_shape``, so no weights are drawn.
    """

    def build():
        # zero-stride views: only their shapes matter, and eval_shape allocates nothing
        weights = {name: np.broadcast_to(np.float32(0), shape) for name, shape in parameter_shapes(model_cfg).items()}
        return CausalLM(
            model_cfg,
            weights,
            remat_policy=remat_policy,
            attn_implementation=attn_implementation,
            attention_block_size=attention_block_size,
            tiled_mlp_chunk_size=tiled_mlp_chunk_size,
        )

    graphdef, state = nnx.split(nnx.eval_shape(build))
    ids = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    lowered = grads_jit.lower(
        graphdef,
        state,
        (ids, ids, ids, ids),
        jax.ShapeDtypeStruct((), jnp.int32),
        loss_type=loss_type,
        chunk_size=int(chunk_size or DEFAULT_CHUNK_SIZE),
        compute_dtype=None if dtype == "float32" else dtype,
    )
    stats = lowered.compile().memory_analysis()
    return StepMemory(int(stats.temp_size_in_bytes), int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes))
