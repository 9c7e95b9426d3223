"""PEFT on the jax backend: LoRA/DoRA/rsLoRA adapters, QLoRA's 4-bit base and trainable tokens.

The rules (targets, initial values, scaling, key names, merge) are twinseq.common.models.peft's; this module
reproduces peft 0.21's forward passes op for op, in float32 adapters:

- LoRA (``peft.tuners.lora.layer.Linear.forward``): ``y = base(x) + lora_B(lora_A(dropout(x))) * scaling``,
  i.e. ``((x @ A.T) @ B.T) * scaling`` with ``A`` [r, in] and ``B`` [out, r] kept in PEFT's layout (so their
  gradients come out in it), ``x`` cast to the adapters' dtype first and the sum cast back to the base's;
- DoRA (``peft.tuners.lora.dora.DoraLinearLayer.forward``): ``y = base(x) + (m / n - 1) * (x W^T) +
  (m / n) * lora(x) * scaling`` with ``n = ||W + scaling * B A||_row`` *detached* (no gradient flows
  through the norm: DoRA paper 4.3, as PEFT does), and ``x W^T`` the base output without its bias;
- LoRA on the experts (``peft.tuners.lora.layer.ParamWrapper``, ``lora_target_parameters``): expert ``e``'s
  weight is ``W[e] + scaling * B_e @ A_e`` with ``A`` [E * r, in] and ``B`` [out, r * E] in PEFT's layout;
  ``model.SparseMoeBlock`` runs it as a second pair of grouped matmuls (``grouped.grouped_matmul``) beside the
  base one;
- trainable tokens (``peft.tuners.trainable_tokens.layer``): the selected embedding rows are *replaced* by
  the trainable values (``index_copy``), in the lookup and in a tied LM head; Gemma's embedding scale is
  applied after the lookup, as PEFT does;
- QLoRA (``load_in_4bit``): every decoder linear layer's weight is stored as 4-bit NF4 codes with a
  float32 absmax scale per block of (up to) 64 input features per output row (bitsandbytes' blocksize 64),
  quantised and dequantised by ``qwix``; the LoRA above runs on the dequantised weight. A MoE model's fused expert
  tensors become NF4 too (``model.SparseMoeBlock.quantize_experts_nf4``: ``common.models.nf4``, bitsandbytes'
  numbers, one float32 absmax per 64 numbers of the flattened tensor, as the torch backend stores them), run by
  ``moe.grouped_experts`` one dequantised expert per scan step; LoRA on them (``lora_target_parameters``) is
  folded into each dequantised expert (``moe.NF4Experts``), under PEFT's ``ParamWrapper`` keys as without NF4.

Only ``model.AdapterParam`` tensors train (``model.split_trainable``); a switch on every adapted module
(``adapters_disabled``) gives the base model back without a second copy of it (DPO's reference).

Dropout (``lora_dropout``): PEFT's ``nn.Dropout`` on the LoRA input in train mode, ``lora_B(lora_A(dropout(x)))``
(and, for DoRA, the base term ``x W^T`` of the dropped input, as PEFT's DoRA path): each element of ``x`` is kept
with probability ``1 - p`` and scaled by ``1 / (1 - p)``, a mask per adapted layer per call. It applies only while a
step is traced inside ``with lora_dropout(key)`` (the trainers' micro-steps, a key from the seed, the step and the
micro-batch: ``dropout_key``); everywhere else (the protocol functions ``logits``, ``loss_and_grads``, ..., and
the references) the adapters are deterministic, as PEFT in eval mode or with ``lora_dropout=0``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from functools import partial
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twinseq.common.backend import Model
from twinseq.common.errors import ConfigError, MissingDependencyError
from twinseq.common.models import peft as common_peft
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.peft import (
    TOKENS_KEY,
    PeftConfig,
    adapter_key,
    check_adapters,
    check_peft_config,
    init_adapters,
    lora_targets,
)
from twinseq.jax_backend.model import (
    NF4_EXPERT_TENSORS,
    AdapterParam,
    CausalLM,
    Embedding,
    Linear,
    SparseMoeBlock,
    active_dropout_key,
    adapter_key_of_path,
    adapters_by_key,
    base_weights,
    export_weights,
    has_adapters,
    in_hf_order,
    lora_dropout,
    peft_config,
    state_to_hf,
)

logger = logging.getLogger(__name__)

NF4_BLOCK = 64
"""bitsandbytes' default 4-bit blocksize: one absmax scale per 64 consecutive weights of a row."""

__all__ = [
    "add_adapters",
    "export_adapters",
    "lora_dropout",
    "dropout_key",
    "merge_adapters",
    "adapters_disabled",
    "peft_config",
    "base_weights",
    "adapters_by_key",
    "AdapterParam",
    "NF4Codes",
    "NF4Scale",
]


def dropout_key(seed: int, step: int, micro: int) -> jax.Array:
    """The dropout key of micro-batch ``micro`` of optimizer step ``step`` (0-based) of a run with ``seed``: a
    resumed run draws the masks an uninterrupted one would."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), micro)


class NF4Codes(nnx.Variable):
    """A frozen 4-bit NF4 weight, ``uint4`` codes in the kernel layout [in, out]."""


class NF4Scale(nnx.Variable):
    """The absmax scale of every NF4 block, float32 [in / block, out]."""


def _nf4_block(fan_in: int) -> int:
    """The largest block (at most ``NF4_BLOCK``) that divides ``fan_in`` (qwix tiles must divide the axis)."""
    return math.gcd(fan_in, NF4_BLOCK)


def _require_qwix():
    try:
        import qwix  # optional dependency
    except ImportError:  # pragma: no cover - qwix is in the [jax] extra
        raise MissingDependencyError(
            "load_in_4bit=True on the jax backend quantises the base with qwix's NF4, "
            "and qwix is not installed; `pip install -e '.[jax]'` or drop "
            "--load-in-4bit."
        ) from None
    return qwix


def _dequantize_nf4(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """[in, out] NF4 ``codes`` times their absmax ``scale``, in ``scale``'s dtype (qwix's dequantisation)."""
    from qwix._src.core.qarray import QArray, dequantize  # optional dependency

    return dequantize(QArray(codes, scale, None, "nf4")).astype(scale.dtype)


def _codes_after(codes: jax.Array, t: jax.Array) -> jax.Array:
    """``codes`` unchanged, but computed from ``t`` at run time, so nothing that reads them can run before ``t``.

    ``(t_0 != t_0) & (t_0 == t_0)`` is false for every float (NaN included), so the select always gives
    ``codes``; XLA does not fold it, so the dequantisation downstream gets a data dependency on ``t``. (An
    ``optimization_barrier`` would say the same, but XLA:CPU removes barriers before common-subexpression
    elimination and scheduling; XLA folds ``|t_0| < 0``.)
    """
    t0 = t.reshape(-1)[0]
    never = (t0 != t0) & (t0 == t0)
    return jnp.where(never, jnp.zeros_like(codes), codes)


@jax.custom_vjp
def _nf4_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array) -> jax.Array:
    """``x @ dequantize(codes, scale)``, holding the float weight only while this matmul (or its transpose) runs.

    Why (measured on XLA:CPU, ``small``, 4 x 512 tokens, gradient checkpointing, LoRA vs QLoRA step:
    arguments 49 -> 18 MiB but temp 942 -> 977 MiB, i.e. no saving): written plainly, the dequantisation
    depends on frozen parameters only, so XLA's common-subexpression elimination merges the forward
    pass's, the rematerialised forward's and the backward pass's dequantisation of a weight into one
    value, alive from the forward pass to the backward pass: every layer's float weight at once. Here

    - the backward pass (``custom_vjp``) keeps no float weight: its residuals are the 4-bit codes and
      scales (parameters, alive anyway); it dequantises again for ``dx = dy @ W.T``;
    - each dequantisation is tied (``_codes_after``) to the tensor its matmul reads (``x`` forward,
      ``dy`` backward), so the copies are distinct values that cannot be merged, nor scheduled before
      their layer runs. ``jax.checkpoint`` + ``optimization_barrier`` was tried first and changed
      nothing: XLA:CPU drops the barriers before CSE.

    The values are exactly those of ``x @ dequantize(codes, scale)`` and ``dy @ dequantize(codes, scale).T``
    (the same operations; the tie selects ``codes`` themselves). ``codes`` and ``scale`` are frozen: their
    cotangents are zero.
    """
    return x @ _dequantize_nf4(_codes_after(codes, x), scale)


def _nf4_matmul_fwd(x, codes, scale):
    return x @ _dequantize_nf4(_codes_after(codes, x), scale), (codes, scale)


def _nf4_matmul_bwd(residuals, dy):
    codes, scale = residuals
    w = _dequantize_nf4(_codes_after(codes, dy), scale)
    return dy @ w.T, np.zeros(codes.shape, jax.dtypes.float0), jnp.zeros_like(scale)


_nf4_matmul.defvjp(_nf4_matmul_fwd, _nf4_matmul_bwd)


def _key_after(key: jax.Array, t: jax.Array) -> jax.Array:
    """``key`` unchanged, but computed from ``t`` at run time (``_codes_after``'s select): the mask drawn from it is
    a value of its own, which XLA cannot merge with another draw of the same key nor compute before ``t``."""
    data = jax.random.key_data(key)
    t0 = t.reshape(-1)[0]
    never = (t0 != t0) & (t0 == t0)
    return jax.random.wrap_key_data(jnp.where(never, jnp.zeros_like(data), data), impl=jax.random.key_impl(key))


def _kept(t: jax.Array, mask: jax.Array, keep: float) -> jax.Array:
    """``t / keep`` where ``mask``, 0 elsewhere: dropout's output, and its gradient."""
    return jnp.where(mask, t / jnp.asarray(keep, t.dtype), jnp.zeros((), t.dtype))


def _dropout(x: jax.Array, key: jax.Array, keep: float) -> jax.Array:
    """PEFT's ``nn.Dropout(1 - keep)`` in train mode: each element kept with probability ``keep``, scaled by
    ``1 / keep``; the mask is ``key``'s, drawn once ``x`` exists."""
    return _kept(x, jax.random.bernoulli(_key_after(key, x), keep, x.shape), keep)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dropped_matmul(x: jax.Array, a_RI: jax.Array, key: jax.Array, keep: float) -> jax.Array:
    """``dropout(x) @ A.T``, whose backward draws the mask again from ``key`` instead of keeping it.

    Written plainly, the step kept each adapted layer's mask and dropped input from the forward pass to the
    backward one, a [tokens, in_features] copy per layer (measured on ``small``, 4 x 512 tokens, all-linear: 348
    MiB more than without dropout, with or without gradient checkpointing). Here the residuals are ``x`` itself
    (shared by the layers that read the same input) and the key; the backward pass draws the mask again, tied to
    its gradient (``_key_after``) so that XLA cannot merge that draw with the forward pass's one (which would keep
    the mask alive in between, as it did for QLoRA's dequantised weights). The values are the same.
    """
    return _dropout(x, key, keep) @ a_RI.T


def _dropped_matmul_fwd(x, a_RI, key, keep):
    return _dropout(x, key, keep) @ a_RI.T, (x, a_RI, key)


def _dropped_matmul_bwd(keep, residuals, g):
    x, a_RI, key = residuals
    mask = jax.random.bernoulli(_key_after(key, g), keep, x.shape)  # the forward's mask, drawn again
    dx = _kept(g @ a_RI, mask, keep)
    da = g.reshape(-1, g.shape[-1]).T @ _kept(x, mask, keep).reshape(-1, x.shape[-1])
    return dx.astype(x.dtype), da.astype(a_RI.dtype), None


_dropped_matmul.defvjp(_dropped_matmul_fwd, _dropped_matmul_bwd)


class PeftLinear(nnx.Module):
    """A linear layer ``y = x @ W.T (+ bias)`` with a frozen (optionally NF4) base and, when it is a target,
    LoRA/DoRA adapters (``lora_A`` [r, in], ``lora_B`` [out, r], ``lora_magnitude_vector`` [out]).

    The base keeps ``Linear``'s names (``kernel`` [in, out], ``bias``); a 4-bit base is ``kernel_nf4`` +
    ``kernel_scale`` instead of ``kernel``.
    """

    def __init__(
        self,
        base: Linear,
        *,
        lora_A: Optional[np.ndarray] = None,
        lora_B: Optional[np.ndarray] = None,
        magnitude: Optional[np.ndarray] = None,
        scaling: float = 1.0,
        load_in_4bit: bool = False,
        dropout: float = 0.0,
        index: int = 0,
    ):
        kernel = base.kernel[...]
        self.dtype = str(kernel.dtype)
        if load_in_4bit:
            qwix = _require_qwix()
            q = qwix.quantize(
                kernel.astype(jnp.float32), "nf4", tiled_axes={0: _nf4_block(kernel.shape[0])}, channelwise_axes=(1,)
            )
            self.kernel = None
            self.kernel_nf4, self.kernel_scale = NF4Codes(q.qvalue), NF4Scale(q.scale)
        else:
            self.kernel = base.kernel
            self.kernel_nf4 = self.kernel_scale = None
        self.bias = base.bias
        self.lora_A = None if lora_A is None else AdapterParam(jnp.asarray(lora_A, jnp.float32))
        self.lora_B = None if lora_B is None else AdapterParam(jnp.asarray(lora_B, jnp.float32))
        self.lora_magnitude_vector = None if magnitude is None else AdapterParam(jnp.asarray(magnitude, jnp.float32))
        self.scaling = float(scaling)
        self.lora_dropout = float(dropout)
        self.dropout_index = int(index)  # this layer's mask: fold_in(key, index)
        self.adapters_enabled = True

    def dropout_key(self) -> Optional[jax.Array]:
        """This layer's dropout key inside ``lora_dropout(key)`` with ``lora_dropout > 0`` (else None: no dropout)."""
        key = active_dropout_key()
        if key is None or self.lora_dropout == 0.0:
            return None
        return jax.random.fold_in(key, self.dropout_index)

    def base_kernel(self, after: Optional[jax.Array] = None) -> jax.Array:
        """[in, out] in the compute dtype: the weight, or the NF4 codes dequantised (once ``after`` exists, if
        given: see ``_codes_after``)."""
        if self.kernel is not None:
            return self.kernel[...]
        codes = self.kernel_nf4[...]
        return _dequantize_nf4(codes if after is None else _codes_after(codes, after), self.kernel_scale[...])

    def base_matmul(self, x: jax.Array) -> jax.Array:
        """``x @ base_kernel()`` (no bias); for an NF4 base, see ``_nf4_matmul``."""
        if self.kernel is not None:
            return x @ self.kernel[...]
        return _nf4_matmul(x, self.kernel_nf4[...], self.kernel_scale[...])

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.base_matmul(x)
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora_A is None or not self.adapters_enabled:
            return y
        a_RI, b_OR = self.lora_A[...], self.lora_B[...]
        x = x.astype(a_RI.dtype)  # PEFT: x = self._cast_input_dtype(x, lora_A.weight.dtype)
        key, keep = self.dropout_key(), 1.0 - self.lora_dropout
        lora = (x @ a_RI.T if key is None else _dropped_matmul(x, a_RI, key, keep)) @ b_OR.T
        if self.lora_magnitude_vector is None:
            return (y + lora * self.scaling).astype(y.dtype)
        # DoRA: the weight norm is a constant of the backward pass (PEFT detaches it).
        lora_weight_OI = jax.lax.stop_gradient(b_OR @ a_RI)
        weight_OI = self.base_kernel(after=x).T.astype(x.dtype)
        norm_O = jax.lax.stop_gradient(jnp.linalg.norm(weight_OI + self.scaling * lora_weight_OI, axis=1))
        mag_norm_scale_O = self.lora_magnitude_vector[...] / norm_O
        if key is not None:  # PEFT's DoRA with dropout: the base term of the dropped input (no bias), same mask
            base_result = _dropout(x, key, keep) @ weight_OI.T
        else:
            base_result = y if self.bias is None else y - self.bias[...]
        result_dora = (mag_norm_scale_O - 1) * base_result + mag_norm_scale_O * lora * self.scaling
        return (y + result_dora).astype(y.dtype)


class TokenEmbedding(Embedding):
    """An embedding whose rows ``token_indices`` are replaced by the trainable ``token_values`` (PEFT's
    ``trainable_tokens_delta``), in the lookup and, tied, in the LM head."""

    def __init__(self, base: Embedding, token_indices: list[int], token_values: np.ndarray):
        self.weight = base.weight
        self.scale = base.scale
        self.token_indices = tuple(int(i) for i in token_indices)
        self.token_values = AdapterParam(jnp.asarray(token_values, jnp.float32))
        self.adapters_enabled = True

    def table(self) -> jax.Array:
        weight_VH = self.weight[...]
        if not self.adapters_enabled:
            return weight_VH
        rows = np.asarray(self.token_indices, np.int32)
        return weight_VH.at[rows].set(self.token_values[...].astype(weight_VH.dtype))


# ---------------------------------------------------------------------------------------
# Protocol functions
# ---------------------------------------------------------------------------------------


def _locate(model: Model, path: str) -> tuple[Any, str]:
    """(parent module, attribute name) of a dotted HF module path such as ``model.layers.0.self_attn.q_proj``."""
    *parents, name = path.split(".")
    node = model
    for part in parents:
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node, name


def add_adapters(
    model: Model, cfg: ModelConfig, peft: PeftConfig, adapters: Optional[dict[str, np.ndarray]] = None
) -> Model:
    """A copy of ``model`` with adapters on ``common.models.peft.lora_targets(cfg, peft)`` (and trainable tokens, and
    an NF4 base with ``load_in_4bit``); ``adapters`` (PEFT keys) None: ``init_adapters(cfg, peft, seed=0)``."""
    check_peft_config(peft)
    if not peft.use_peft:
        raise ConfigError("add_adapters with use_peft=False adds nothing; set use_peft=True (--use-peft).")
    if has_adapters(model):
        raise ConfigError(
            f"this {type(model).__name__} already has adapters; pass a plain model to add_adapters (merge_adapters "
            "gives one)."
        )
    if model.config.to_dict() != cfg.to_dict():
        raise ConfigError(
            f"add_adapters: cfg (model_type={cfg.model_type}) is not the config of this model "
            f"({model.config.model_type}); pass model.config."
        )
    if peft.load_in_4bit:
        _require_qwix()
    if adapters is None:
        needs_base = peft.use_dora or bool(peft.trainable_token_indices)
        adapters = init_adapters(cfg, peft, seed=0, base_weights=export_weights(model) if needs_base else None)
    else:
        common_peft.check_token_indices(cfg, peft)
    check_adapters(cfg, peft, adapters, "add_adapters")
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, state)  # a new module tree: the caller's model keeps no adapters
    targets = lora_targets(cfg, peft)
    linear_paths = [
        name[: -len(".weight")]
        for name in in_hf_order(cfg, state_to_hf(nnx.state(model, nnx.Param)))
        if name.startswith("model.layers.") and name.endswith("_proj.weight")
    ]
    for index, path in enumerate(linear_paths):
        parent, name = _locate(model, path)
        base = getattr(parent, name)
        if path in targets:
            magnitude = adapters.get(adapter_key(path, "lora_magnitude_vector"))
            setattr(
                parent,
                name,
                PeftLinear(
                    base,
                    lora_A=adapters[adapter_key(path, "lora_A")],
                    lora_B=adapters[adapter_key(path, "lora_B")],
                    magnitude=magnitude,
                    scaling=peft.scaling,
                    load_in_4bit=peft.load_in_4bit,
                    dropout=peft.lora_dropout,
                    index=index,
                ),
            )
        elif peft.load_in_4bit:  # QLoRA quantises every decoder linear layer, adapted or not (bitsandbytes)
            setattr(parent, name, PeftLinear(base, load_in_4bit=True))
    if peft.load_in_4bit:
        _quantize_experts_nf4(model)
    _add_expert_adapters(model, cfg, peft, adapters)
    if peft.trainable_token_indices:
        model.model.embed_tokens = TokenEmbedding(
            model.model.embed_tokens, peft.trainable_token_indices, adapters[TOKENS_KEY]
        )
    model.peft_json = json.dumps(dataclasses.asdict(peft), sort_keys=True)
    return model


def _quantize_experts_nf4(model: Model) -> int:
    """Every MoE block's ``gate_up_proj`` and ``down_proj`` to NF4 (``SparseMoeBlock.quantize_experts_nf4``), in place;
    returns how many tensors. ``ConfigError`` where an expert is not a whole number of NF4 blocks."""
    modules = nnx.iter_modules(model)
    blocks = [(".".join(str(p) for p in path), m) for path, m in modules if isinstance(m, SparseMoeBlock)]
    for path, block in blocks:
        for name in NF4_EXPERT_TENSORS:
            numbers = math.prod(block.experts[name].shape[1:])
            if numbers % common_peft.NF4_BLOCKSIZE:
                raise ConfigError(
                    f"load_in_4bit=True: {path}.experts.{name} has {numbers} numbers per expert, not a multiple of the "
                    f"NF4 block ({common_peft.NF4_BLOCKSIZE}), so an expert would not dequantise alone; drop "
                    "--load-in-4bit for this model, or use hidden and intermediate sizes whose product is a multiple "
                    "of 64."
                )
    count = sum(block.quantize_experts_nf4() for _, block in blocks)
    if count:
        logger.info("load_in_4bit: %d expert tensors quantised to NF4 (blocks of 64, float32 absmax)", count)
    return count


def _add_expert_adapters(model: Model, cfg: ModelConfig, peft: PeftConfig, adapters: dict[str, np.ndarray]) -> None:
    """LoRA on the expert tensors of ``peft.lora_target_parameters`` (``SparseMoeBlock.add_expert_adapters``), each
    pair under PEFT's module path of it (``common.models.peft.expert_adapter_keys``)."""
    by_block: dict[str, dict[str, tuple[tuple[str, ...], np.ndarray, np.ndarray]]] = {}
    for path, module in common_peft.expert_adapter_keys(cfg, peft).items():
        block, _, tensor = path.partition(".experts.")  # model.layers.0.mlp, gate_up_proj
        place = tuple(module[len(block + ".experts") :].split(".")[1:])  # () or ("base_layer", ...)
        pair = (adapters[adapter_key(module, "lora_A")], adapters[adapter_key(module, "lora_B")])
        by_block.setdefault(block, {})[tensor] = (place, *pair)
    for block, entries in by_block.items():
        parent, name = _locate(model, block)
        getattr(parent, name).add_expert_adapters(entries, peft.scaling)


def export_adapters(model: Model) -> dict[str, np.ndarray]:
    """float32 numpy adapter tensors by PEFT key (what ``common.models.peft.save_adapters`` writes)."""
    return adapters_by_key(model, nnx.state(model, AdapterParam))


def load_adapter_values(model: Model, adapters: dict[str, np.ndarray]) -> None:
    """Write ``adapters`` (PEFT keys, checked) into ``model``'s adapter parameters, in place."""
    check_adapters(model.config, peft_config(model), adapters, "load_adapter_values")
    for path, variable in nnx.to_flat_state(nnx.state(model, AdapterParam)):
        del variable
        parent, name = _locate(model, ".".join(str(p) for p in path))
        getattr(parent, name).set_value(jnp.asarray(adapters[adapter_key_of_path(path)], jnp.float32))


def merge_adapters(model: Model) -> Model:
    """A plain ``CausalLM`` whose weights have the adapters folded in (``common.models.peft.merge_adapters``; a 4-bit
    base is dequantised first), in the model's dtype."""
    peft = peft_config(model)
    merged = common_peft.merge_adapters(model.config, peft, base_weights(model), export_adapters(model))
    return CausalLM(model.config, merged, dtype=model.dtype, remat_policy=model.model.remat_policy)


def _adapted_modules(model: Model) -> Iterator[Any]:
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (PeftLinear, TokenEmbedding)) or (
            isinstance(module, SparseMoeBlock) and getattr(module, "expert_lora", ())
        ):
            yield module


def set_adapters_enabled(model: Model, enabled: bool) -> None:
    """Switch every adapter of ``model`` on or off, in place (a static switch: it lives in the graphdef)."""
    peft_config(model)
    for module in _adapted_modules(model):
        module.adapters_enabled = bool(enabled)


@contextlib.contextmanager
def adapters_disabled(model: Model) -> Iterator[Model]:
    """``with adapters_disabled(model):`` ``model`` computes its base (the NF4 base with QLoRA)."""
    set_adapters_enabled(model, False)
    try:
        yield model
    finally:
        set_adapters_enabled(model, True)
