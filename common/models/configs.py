"""The model families twinseq builds, described once for both backends: ``ModelConfig``.

One dataclass in Hugging Face's names covers Llama (and Llama 3.x RoPE scaling), Qwen2/Qwen2.5,
Qwen3, Qwen3-MoE, Mistral, Mixtral, Gemma 2, Gemma 3 (text) and gpt-oss. ``model_type`` picks the family; the family
decides what the architecture has, and the fields hold its sizes and knobs:

==========  ===================================================================================
family      what differs from Llama
==========  ===================================================================================
llama       ``rope_type`` ``linear``/``dynamic``/``llama3``; optional ``attention_bias``/``mlp_bias``
qwen2       q, k and v projections carry biases (o does not); optional sliding-window layers
qwen3       RMSNorm of every query and key head (``q_norm``, ``k_norm``) before RoPE; ``head_dim``
            independent of ``hidden_size``
qwen3_moe   Qwen3's attention; the MLP of every ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` is a
            mixture of ``num_experts`` gated MLPs (``moe_intermediate_size``): a linear router, softmax in float32,
            the top ``num_experts_per_tok`` experts per token (weights renormalised with ``norm_topk_prob``),
            their outputs summed with those weights; the Switch load-balancing loss (``router_aux_loss_coef``,
            added to the training loss with ``output_router_logits``); optional ``sliding_window`` on every layer
mistral     every layer attends within ``sliding_window`` positions
mixtral     Mistral's attention (optional ``sliding_window`` on every layer); the MLP of every layer is a mixture of
            ``num_experts`` gated MLPs of ``intermediate_size`` routed as Qwen3-MoE's, the top-k weights always
            renormalised and kept in float32 through the weighted sum; the same load-balancing loss
gemma2      embeddings scaled by ``sqrt(hidden_size)``; RMSNorm computes ``x * (1 + w)`` in float32;
            four norms per layer (input, post-attention, pre- and post-feedforward); GELU (tanh);
            sliding and global layers alternate (``layer_types``); attention and final logits are
            soft-capped (``c * tanh(x / c)``); attention scale ``query_pre_attn_scalar ** -0.5``
gemma3_text Gemma 2's embedding scale, norms, GELU and attention scale, plus Gemma-form (``1 + w``) RMSNorm of
            every query and key head (``q_norm``, ``k_norm``) before RoPE; five sliding layers to one global by
            default; two RoPE bases: ``rope_theta`` (and its scaling) on global layers, ``rope_local_base_freq``
            on sliding ones; no attention soft-cap (transformers' Gemma 3 has none), final soft-cap only if set
gpt_oss     attention sinks (a learned logit per head, ``self_attn.sinks``, in every softmax denominator, with no
            value); biases on q, k, v and o; sliding and full layers alternate (``layer_types``); YaRN RoPE; every
            MLP a mixture of ``num_experts`` experts of ``intermediate_size``: a router with a bias, softmax over the
            top-k logits only; experts with biases, gate and up interleaved in ``gate_up_proj`` ``[E, h, 2m]``
            (gate ``[..., ::2]``, up ``[..., 1::2]``), a clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``):
            ``(up.clamp(-l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = gate.clamp(max=l)``; Mixtral's
            load-balancing loss
==========  ===================================================================================

``parameter_shapes`` lists every tensor of a family in Hugging Face's names and layout, which is
what ``init_weights`` draws, checkpoints hold, and both backends load. ``to_hf_config`` and
``from_hf_config`` translate to and from a ``config.json`` (transformers 5 layout).

>>> cfg = ModelConfig.preset("tiny-gemma2")
>>> cfg.model_type, cfg.layer_is_sliding(0), cfg.layer_is_sliding(1), cfg.attention_scale
('gemma2', True, False, 0.0625)
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, Optional, Union

from twinseq.common.errors import ConfigError
from twinseq.common.fields import _check_fields, knob

ModelType = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3_text", "gpt_oss"]
MODEL_TYPES = typing.get_args(ModelType)
RopeType = Literal["default", "linear", "dynamic", "llama3", "yarn"]
LayerType = Literal["full_attention", "sliding_attention"]
Activation = Literal["silu", "gelu_pytorch_tanh"]
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
_ROUTED = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")
_MOE_FIELDS: dict[str, tuple[str, ...]] = {
    "qwen3_moe": (*_ROUTED, "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"),
    "mixtral": _ROUTED,
    "gpt_oss": (*_ROUTED, "swiglu_limit", "swiglu_alpha"),
}
"""Each mixture-of-experts family's own ``ModelConfig`` fields, in transformers' config names (Mixtral's
config.json spells ``num_experts`` ``num_local_experts``). Mixtral has no knob for the rest: its experts are
``intermediate_size`` wide, it always renormalises the top-k weights, and every layer is sparse."""
_HF_MOE_NAMES = {"mixtral": {"num_experts": "num_local_experts"}, "gpt_oss": {"num_experts": "num_local_experts"}}
"""config.json names of ``_MOE_FIELDS`` that differ from ``ModelConfig``'s, per family."""
SLIDES_EVERY_LAYER = ("mistral", "qwen3_moe", "mixtral")
"""Families whose every layer attends within ``sliding_window`` when it is set (one mask for the whole model)."""
GEMMA3_SLIDING_WINDOW_PATTERN = 6
"""transformers' Gemma 3 default: every 6th layer global, the others sliding."""


@dataclass
class ModelConfig:
    """Architecture of a causal LM of one of ``MODEL_TYPES``, in Hugging Face config names.

    Both backends build exactly this architecture: pre-norm decoder layers with RMSNorm,
    grouped-query attention with RoPE on the half-split layout, a gated MLP, and tied or untied
    embeddings, plus the features of its family (see the module docstring).
    """

    model_type: ModelType = "llama"
    vocab_size: int = knob(8192, ge=1)
    hidden_size: int = knob(64, ge=1)
    intermediate_size: int = knob(176, ge=1)
    num_hidden_layers: int = knob(2, ge=1)
    num_attention_heads: int = knob(4, ge=1)
    num_key_value_heads: int = knob(2, ge=1)
    head_dim: Optional[int] = knob(None, ge=1)
    hidden_act: Activation = "silu"
    rms_norm_eps: float = knob(1e-5, gt=0)
    rope_theta: float = knob(10000.0, gt=0)
    rope_local_base_freq: Optional[float] = knob(None, gt=0)
    """gemma3_text: the RoPE base of sliding layers (default RoPE, no scaling; None: 10000, transformers' default);
    ``rope_theta`` and ``rope_type`` are then the global layers'. Other families have one base: leave it None."""
    rope_type: RopeType = "default"
    rope_factor: float = knob(1.0, gt=0)
    """``linear``: positions divided by it; ``dynamic``: NTK base stretch; ``llama3``: low-frequency scale."""
    rope_low_freq_factor: float = knob(1.0, gt=0)
    rope_high_freq_factor: float = knob(4.0, gt=0)
    rope_original_max_position_embeddings: Optional[int] = knob(None, ge=1)
    rope_beta_fast: float = knob(32.0, gt=0)
    """``yarn``: the rotation count below which a frequency is extrapolated (kept)."""
    rope_beta_slow: float = knob(1.0, gt=0)
    """``yarn``: the rotation count above which a frequency is interpolated (divided by ``rope_factor``)."""
    rope_truncate: bool = True
    """``yarn``: round the correction range outwards to whole dimensions (transformers' default; gpt-oss: False)."""
    rope_attention_factor: Optional[float] = knob(None, gt=0)
    """``yarn``: the scale of cos and sin (None: ``0.1 * ln(rope_factor) + 1``, transformers' default)."""
    max_position_embeddings: int = knob(4096, ge=1)
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: Optional[int] = knob(None, ge=1)
    layer_types: Optional[list[LayerType]] = None
    """Per layer; None: every layer ``sliding_attention`` if the family slides everywhere (mistral with a
    ``sliding_window``), else ``full_attention``."""
    attn_logit_softcapping: Optional[float] = knob(None, gt=0)
    final_logit_softcapping: Optional[float] = knob(None, gt=0)
    query_pre_attn_scalar: Optional[int] = knob(None, ge=1)
    tie_word_embeddings: bool = True
    initializer_range: float = knob(0.02, ge=0)
    bos_token_id: Optional[int] = 1
    eos_token_id: Union[int, list[int], None] = 2
    pad_token_id: Optional[int] = 0
    num_experts: int = knob(0, ge=0)
    """qwen3_moe, mixtral, gpt_oss: experts per MoE layer (0 on the other families, which have none; Mixtral's and
    gpt-oss's config.json call it ``num_local_experts``)."""
    num_experts_per_tok: int = knob(1, ge=1)
    """qwen3_moe, mixtral, gpt_oss: experts each token is routed to (top-k of the router's logits)."""
    moe_intermediate_size: Optional[int] = knob(None, ge=1)
    """qwen3_moe: the intermediate size of every expert (``intermediate_size`` is the dense layers'; Mixtral's
    experts are ``intermediate_size`` wide)."""
    norm_topk_prob: bool = False
    """qwen3_moe: renormalise the top-k routing weights of a token to sum to 1 (Mixtral always does)."""
    decoder_sparse_step: int = knob(1, ge=1)
    """qwen3_moe: layer ``i`` is a MoE layer when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
    ``mlp_only_layers``."""
    mlp_only_layers: Optional[list[int]] = None
    """qwen3_moe: indices of layers that keep a dense MLP (None: none)."""
    router_aux_loss_coef: float = knob(0.001, ge=0)
    """qwen3_moe, mixtral, gpt_oss: weight of the load-balancing loss in the training loss (with
    ``output_router_logits``)."""
    output_router_logits: bool = False
    """qwen3_moe, mixtral, gpt_oss: add ``router_aux_loss_coef * aux_loss`` to the training loss (transformers' switch
    of the same name); the logits do not depend on it."""
    swiglu_limit: float = knob(7.0, gt=0)
    """gpt_oss: the experts clamp the gate to ``<= swiglu_limit`` and the up projection to ``[-limit, limit]``."""
    swiglu_alpha: float = knob(1.702, gt=0)
    """gpt_oss: the sigmoid gain of the experts' SwiGLU, ``gate * sigmoid(swiglu_alpha * gate)``."""

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly or "
                    f"change one of them."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention); set num_key_value_heads "
                f"to a divisor of {self.num_attention_heads}."
            )
        if self.model_type in ("gemma2", "gemma3_text", "gpt_oss") and self.layer_types is None:  # HF's default
            every = GEMMA3_SLIDING_WINDOW_PATTERN if self.model_type == "gemma3_text" else 2
            self.layer_types = [
                "sliding_attention" if (i + 1) % every else "full_attention" for i in range(self.num_hidden_layers)
            ]
        self._check_gemma3()
        self._check_moe()
        if self.model_type in SLIDES_EVERY_LAYER and self.layer_types is not None:
            raise ConfigError(
                f"ModelConfig.layer_types (got {len(self.layer_types)} entries) is not used by model_type "
                f"{self.model_type!r} "
                "(every layer slides within sliding_window); drop layer_types, or use model_type 'qwen2' for per-layer "
                "windows."
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}; give one per layer."
            )
        if any(self.layer_is_sliding(i) for i in range(self.num_hidden_layers)) and self.sliding_window is None:
            raise ConfigError(
                f"ModelConfig.layer_types has {sum(map(self.layer_is_sliding, range(self.num_hidden_layers)))} "
                "'sliding_attention' layers but sliding_window is None; set sliding_window (the number of positions "
                "a query attends to)."
            )
        if self.rope_type == "yarn" and self.model_type != "gpt_oss":
            raise ConfigError(
                f"ModelConfig.rope_type='yarn' is built for model_type 'gpt_oss' only (got {self.model_type!r}); use "
                "rope_type 'default', 'linear', 'dynamic' or 'llama3'."
            )
        if self.rope_type in ("llama3", "yarn") and self.rope_original_max_position_embeddings is None:
            raise ConfigError(
                f"ModelConfig.rope_type={self.rope_type!r} needs rope_original_max_position_embeddings: set it to the "
                "context length before scaling (8192 for Llama 3.1/3.2, 4096 for gpt-oss)."
            )

    def _check_gemma3(self) -> None:
        """Gemma 3's own fields: a local RoPE base (default 10000), no attention soft-cap, no dynamic RoPE."""
        if self.model_type != "gemma3_text":
            if self.rope_local_base_freq is not None:
                raise ConfigError(
                    f"ModelConfig.rope_local_base_freq={self.rope_local_base_freq} is only read by model_type "
                    f"'gemma3_text' (got {self.model_type!r}, one RoPE base: rope_theta); drop rope_local_base_freq."
                )
            return
        if self.rope_local_base_freq is None:
            self.rope_local_base_freq = 10000.0
        if self.attn_logit_softcapping is not None:
            raise ConfigError(
                f"ModelConfig.attn_logit_softcapping={self.attn_logit_softcapping} is not applied by transformers' "
                "Gemma3ForCausalLM (its q/k norms replace Gemma 2's attention soft-cap), so twinseq would compute "
                "another model than the checkpoint's; set attn_logit_softcapping=None, or use model_type 'gemma2'."
            )
        if self.rope_type == "dynamic":
            raise ConfigError(
                "ModelConfig.rope_type='dynamic' is not built for model_type 'gemma3_text' (transformers keeps a "
                "per-layer-type state for it that twinseq does not reset per batch); use rope_type 'default', "
                "'linear' or 'llama3'."
            )

    def _check_moe(self) -> None:
        """The MoE fields (``_MOE_FIELDS``): set only on a family that reads them; top-k within the experts; Qwen3-MoE
        needs ``moe_intermediate_size`` and ``mlp_only_layers`` in range."""
        own = _MOE_FIELDS.get(self.model_type, ())
        foreign = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if any(f.name in names for names in _MOE_FIELDS.values())
            and f.name not in own
            and getattr(self, f.name) != f.default
        }
        if foreign:
            readers = [family for family, names in _MOE_FIELDS.items() if set(foreign) <= set(names)]
            why = (  # a MoE family that owns a subset of the fields: Mixtral
                "its experts are intermediate_size wide, its top-k weights always renormalised, every layer sparse"
                if own
                else "which has no experts"
            )
            raise ConfigError(
                f"ModelConfig fields {foreign} are only read by model_type {' or '.join(map(repr, readers))} (got "
                f"{self.model_type!r}, {why}); drop them, or set model_type={readers[0]!r}."
            )
        if not own:
            return
        if self.num_experts < self.num_experts_per_tok:
            raise ConfigError(
                f"ModelConfig.num_experts={self.num_experts} is below num_experts_per_tok={self.num_experts_per_tok} "
                f"(model_type {self.model_type!r} routes every token to num_experts_per_tok distinct experts); set "
                f"num_experts >= num_experts_per_tok."
            )
        if self.model_type != "qwen3_moe":
            return
        if self.moe_intermediate_size is None:
            raise ConfigError(
                "ModelConfig.moe_intermediate_size=None: model_type 'qwen3_moe' needs the experts' intermediate size; "
                "set moe_intermediate_size (768 in transformers' Qwen3MoeConfig)."
            )
        bad = [i for i in self.mlp_only_layers or () if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"ModelConfig.mlp_only_layers={self.mlp_only_layers} has {bad} outside the "
                f"num_hidden_layers={self.num_hidden_layers} layers; give layer indices "
                f"0..{self.num_hidden_layers - 1}."
            )

    # -- what the family has ---------------------------------------------------------------

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def has_attention_sinks(self) -> bool:
        """A learned logit per attention head (``self_attn.sinks`` ``[num_attention_heads]``) joins every softmax
        denominator with no value (gpt-oss): ``softmax([scores, sink])[:-1] @ V``."""
        return self.model_type == "gpt_oss"

    @property
    def expert_biases(self) -> bool:
        """Router and experts carry biases, and the experts' tensors are gpt-oss's: ``gate_up_proj`` ``[E, h, 2m]``
        with gate and up interleaved, ``down_proj`` ``[E, m, h]``, and the clamped SwiGLU (``swiglu_limit``)."""
        return self.model_type == "gpt_oss"

    @property
    def qk_norm(self) -> bool:
        """RMSNorm of every query and key head before RoPE (Qwen3; Gemma 3 in its ``1 + w`` form)."""
        return self.model_type in ("qwen3", "qwen3_moe", "gemma3_text")

    @property
    def gemma(self) -> bool:
        """Gemma's embedding scale, ``1 + w`` norms (q/k norms included) and pre/post feedforward norms."""
        return self.model_type in ("gemma2", "gemma3_text")

    def layer_is_sliding(self, layer: int) -> bool:
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        return self.model_type in SLIDES_EVERY_LAYER and self.sliding_window is not None

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (transformers' ``Qwen3MoeDecoderLayer`` rule; every
        layer of Mixtral, which leaves ``decoder_sparse_step`` and ``mlp_only_layers`` at their defaults)."""
        return (
            self.num_experts > 0
            and layer not in (self.mlp_only_layers or ())
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def expert_intermediate_size(self) -> int:
        """The intermediate size of every expert: ``moe_intermediate_size`` (Qwen3-MoE), else ``intermediate_size``
        (Mixtral, which has no dense layer)."""
        return self.moe_intermediate_size if self.moe_intermediate_size is not None else self.intermediate_size

    @property
    def renormalise_top_k(self) -> bool:
        """A token's top-k routing weights divided by their sum (Mixtral always; Qwen3-MoE with ``norm_topk_prob``)."""
        return self.model_type in ("mixtral", "gpt_oss") or self.norm_topk_prob

    @property
    def routing_weights_f32(self) -> bool:
        """The routing weights stay float32 through the experts' weighted sum (transformers' ``MixtralTopKRouter``
        returns them as the float32 softmax gives them; ``Qwen3MoeTopKRouter`` casts them to the compute dtype)."""
        return self.model_type == "mixtral"

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        assert scalar is not None  # __post_init__ fills head_dim
        return float(scalar) ** -0.5

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """Named architecture presets (``MODEL_PRESETS``): ``tiny`` and ``small`` Llamas, and a tiny model
        of every family for tests and offline runs (``tiny-llama3``, ``tiny-qwen2``, ...)."""
        if name not in MODEL_PRESETS:
            raise ConfigError(
                f"model preset {name!r} is unknown; choose one of {sorted(MODEL_PRESETS)} "
                f"or pass a path to a local Hugging Face checkpoint."
            )
        return cls(**{**MODEL_PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def num_parameters(self) -> int:
        return sum(_numel(shape) for shape in parameter_shapes(self).values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_TINY = dict(
    vocab_size=8192,
    hidden_size=96,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "small": dict(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
    ),
    "tiny-llama3": dict(
        _TINY,
        rope_type="llama3",
        rope_theta=500000.0,
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=64,
    ),
    "tiny-qwen2": dict(_TINY, model_type="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny-qwen3": dict(
        _TINY, model_type="qwen3", head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False
    ),
    "tiny-mistral": dict(_TINY, model_type="mistral", sliding_window=16, tie_word_embeddings=False),
    "tiny-gemma2": dict(
        _TINY,
        model_type="gemma2",
        head_dim=32,
        hidden_act="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=256,
    ),
    # four experts, two per token, both layers sparse
    "tiny-qwen3-moe": dict(
        _TINY,
        model_type="qwen3_moe",
        head_dim=32,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    # four experts, two per token, every layer sparse (Mixtral has no dense layer); no window, as Mixtral 8x7B
    "tiny-mixtral": dict(
        _TINY,
        model_type="mixtral",
        intermediate_size=64,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    # sliding then full (gpt-oss's pattern), four experts top-2, gpt-oss's YaRN (factor 32 of 4096 positions: with
    # head_dim 32, five frequencies kept, seven divided by 32, a ramp between)
    "tiny-gpt-oss": dict(
        _TINY,
        model_type="gpt_oss",
        head_dim=32,
        intermediate_size=64,
        rope_theta=150000.0,
        rope_type="yarn",
        rope_factor=32.0,
        rope_original_max_position_embeddings=4096,
        rope_truncate=False,
        max_position_embeddings=131072,
        attention_bias=True,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    # two layers, one of each kind (Gemma 3's default pattern would make both sliding)
    "tiny-gemma3": dict(
        _TINY,
        model_type="gemma3_text",
        head_dim=32,
        hidden_act="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=256,
    ),
}


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Ordered ``{hf_name: shape}`` for every parameter of the model ``cfg`` describes (HF layout:
    a linear weight is ``[out_features, in_features]``)."""
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    assert d is not None  # __post_init__ fills head_dim
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for name, out, inp in (("q_proj", q_out, h), ("k_proj", kv_out, h), ("v_proj", kv_out, h)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, inp)
            if cfg.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if cfg.has_attention_sinks:
            shapes[p + "self_attn.sinks"] = (cfg.num_attention_heads,)
        if cfg.expert_biases:
            shapes.update(_gpt_oss_moe_shapes(cfg, p + "mlp."))
        elif cfg.layer_is_moe(layer):
            e, m = cfg.num_experts, cfg.expert_intermediate_size
            # transformers 5's fused expert tensors: [gate; up] stacked on the output dim, then down
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * m, h)
            shapes[p + "mlp.experts.down_proj"] = (e, h, m)
        else:
            for name, out, inp in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
                shapes[f"{p}mlp.{name}.weight"] = (out, inp)
                if cfg.mlp_bias:
                    shapes[f"{p}mlp.{name}.bias"] = (out,)
        for norm in layer_norm_names(cfg):
            shapes[f"{p}{norm}.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _gpt_oss_moe_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """gpt-oss's MoE block (transformers' ``GptOssMLP``): a biased router, and experts stored input-major with
    biases, gate and up interleaved on the last dim of ``gate_up_proj``."""
    e, h, m = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    return {
        p + "router.weight": (e, h),
        p + "router.bias": (e,),
        p + "experts.gate_up_proj": (e, h, 2 * m),
        p + "experts.gate_up_proj_bias": (e, 2 * m),
        p + "experts.down_proj": (e, m, h),
        p + "experts.down_proj_bias": (e, h),
    }


def layer_norm_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The RMSNorms of one decoder layer, in forward order."""
    if cfg.gemma:
        return (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
    return ("input_layernorm", "post_attention_layernorm")


# --------------------------------------------------------------------------------------
# config.json (transformers 5)
# --------------------------------------------------------------------------------------


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type in ("linear", "dynamic", "llama3", "yarn"):
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "yarn":
        rope.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
        if cfg.rope_attention_factor is not None:
            rope["attention_factor"] = cfg.rope_attention_factor
    if cfg.rope_type == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_original_max_position_embeddings is not None and cfg.rope_type != "default":
        rope["original_max_position_embeddings"] = cfg.rope_original_max_position_embeddings
    return rope


def _gemma3_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers 5's Gemma 3 layout: RoPE per layer type; the sliding layers' is default RoPE."""
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}
    return {"full_attention": _rope_parameters(cfg), "sliding_attention": local}


def to_hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` that ``AutoConfig``/``AutoModelForCausalLM`` of transformers 5 read."""
    values = {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "dtype": dtype,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": _rope_parameters(cfg) if cfg.rope_local_base_freq is None else _gemma3_rope_parameters(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "use_cache": False,
        ("hidden_activation" if cfg.gemma else "hidden_act"): cfg.hidden_act,
    }
    if cfg.model_type in ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss"):
        values["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        values["mlp_bias"] = cfg.mlp_bias
    if cfg.model_type in ("qwen2", "qwen3"):
        values.update(
            use_sliding_window=cfg.sliding_window is not None,
            sliding_window=cfg.sliding_window,
            max_window_layers=cfg.num_hidden_layers,
        )
    if cfg.model_type in ("qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss"):
        values["layer_types"] = [
            ("sliding_attention" if cfg.layer_is_sliding(i) else "full_attention") for i in range(cfg.num_hidden_layers)
        ]
    if cfg.model_type in ("mistral", "mixtral", "gemma2", "gemma3_text", "gpt_oss"):
        values["sliding_window"] = cfg.sliding_window
    if cfg.model_type == "gemma3_text":
        values["use_bidirectional_attention"] = False
    names = _HF_MOE_NAMES.get(cfg.model_type, {})
    values.update({names.get(name, name): getattr(cfg, name) for name in _MOE_FIELDS.get(cfg.model_type, ())})
    if cfg.model_type == "qwen3_moe":
        values.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)
        values["mlp_only_layers"] = list(cfg.mlp_only_layers or [])
    if cfg.model_type == "mixtral":
        values["router_jitter_noise"] = 0.0  # from_hf_config refuses any other value
    if cfg.gemma:
        values.update(
            attn_logit_softcapping=cfg.attn_logit_softcapping,
            final_logit_softcapping=cfg.final_logit_softcapping,
            query_pre_attn_scalar=cfg.query_pre_attn_scalar,
        )
    return values


def _refuse(source: str, field: str, value: Any, fix: str) -> NoReturn:
    raise ConfigError(f"{source}: {field}={value!r} is not supported; {fix}")


# What transformers 5 assumes for a key that config.json leaves out, per family: a hand-written
# config.json means here what it means to ``AutoConfig``. ``"heads"`` is num_attention_heads,
# ``"split"`` is hidden_size // num_attention_heads.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads="heads",
        head_dim="split",
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim="split",
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ),
    "qwen3_moe": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim="split",
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        sliding_window=4096,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=None,
        router_aux_loss_coef=0.001,
        output_router_logits=False,
    ),
    "mixtral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim="split",
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        sliding_window=None,
        num_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.001,
        output_router_logits=False,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim="split",
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        sliding_window=4096,
    ),
    "gemma2": dict(
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=256,
    ),
    "gemma3_text": dict(
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        sliding_window=4096,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        query_pre_attn_scalar=256,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
    ),
    "gpt_oss": dict(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        attention_bias=True,
        sliding_window=128,
        num_experts=128,
        num_experts_per_tok=4,
        router_aux_loss_coef=0.001,
        output_router_logits=False,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
    ),
}
# transformers' GptOssConfig when config.json has no rope_parameters
_GPT_OSS_ROPE = dict(
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096
)
_COMMON_DEFAULTS = dict(
    rms_norm_eps=1e-6, initializer_range=0.02, attention_bias=False, mlp_bias=False, rope_theta=10000.0
)


def from_hf_config(values: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """``ModelConfig`` of a Hugging Face ``config.json`` dict, read as transformers 5 reads it (its defaults
    for absent keys, per family); raises ``ConfigError`` naming the field of an architecture twinseq
    does not build (another ``model_type``, activation, RoPE) and what it builds instead."""
    model_type = values.get("model_type")
    if model_type not in MODEL_TYPES:
        _refuse(
            source,
            "model_type",
            model_type,
            f"twinseq builds {', '.join(MODEL_TYPES)}: use a checkpoint of one of those (model_type in config.json).",
        )
    model_type = typing.cast(ModelType, model_type)  # checked against MODEL_TYPES above
    gemma = model_type in ("gemma2", "gemma3_text")
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = values.get(act_key) or values.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in typing.get_args(Activation):
        _refuse(
            source, act_key, act, f"twinseq builds {', '.join(typing.get_args(Activation))} MLPs: use one of those."
        )
    rope = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    if model_type == "gpt_oss" and not rope:
        rope = dict(_GPT_OSS_ROPE)
    if model_type == "gemma3_text":
        rope = _gemma3_global_rope(values, source)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in typing.get_args(RopeType):
        _refuse(
            source,
            "rope_type",
            rope_type,
            f"twinseq builds {', '.join(typing.get_args(RopeType))} RoPE: use one of those.",
        )
    if float(rope.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))) != 1.0:
        _refuse(
            source,
            "partial_rotary_factor",
            rope.get("partial_rotary_factor", values.get("partial_rotary_factor")),
            "twinseq rotates whole heads: use a model with partial_rotary_factor 1.0.",
        )
    defaults = {**_COMMON_DEFAULTS, **_HF_DEFAULTS[model_type]}
    out: dict[str, Any] = {
        k: values.get(k, defaults.get(k))
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
            "initializer_range",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "attention_bias",
            "mlp_bias",
        )
    }
    if out["num_key_value_heads"] in (None, "heads"):
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out["head_dim"] in (None, "split"):
        out["head_dim"] = None  # ModelConfig splits hidden_size
    if model_type in ("qwen2", "mistral"):
        out["attention_bias"] = False  # Qwen2's q/k/v biases come with the family; neither has an o_proj bias
    if model_type != "llama":
        out["mlp_bias"] = False
    out.update(
        model_type=model_type,
        hidden_act=act,
        rope_type=rope_type,
        rope_theta=float(rope.get("rope_theta", values.get("rope_theta", defaults["rope_theta"]))),
    )
    for key, name in (
        ("factor", "rope_factor"),
        ("low_freq_factor", "rope_low_freq_factor"),
        ("high_freq_factor", "rope_high_freq_factor"),
        ("original_max_position_embeddings", "rope_original_max_position_embeddings"),
    ):
        if rope.get(key) is not None and rope_type != "default":
            out[name] = rope[key]
    if rope_type == "yarn":
        out.update(_yarn_fields_of(rope, source))
    if gemma:
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            out[key] = values.get(key, defaults[key])
    if model_type == "gemma3_text":
        out["rope_local_base_freq"] = float(rope["local_theta"])
    sliding_window = values.get("sliding_window", defaults.get("sliding_window"))
    if model_type in ("qwen2", "qwen3"):
        if values.get("use_sliding_window", False) and sliding_window is not None:
            out["sliding_window"] = sliding_window
            window_from = values.get("max_window_layers", 28)
            out["layer_types"] = values.get("layer_types") or [
                "sliding_attention" if i >= window_from else "full_attention" for i in range(out["num_hidden_layers"])
            ]
    elif model_type in ("mistral", "mixtral"):
        out["sliding_window"] = sliding_window
    elif model_type == "qwen3_moe":
        out["sliding_window"] = sliding_window if values.get("use_sliding_window", False) else None
    if model_type in _MOE_FIELDS:
        out.update(_moe_fields_of(model_type, values, defaults, source))
    if gemma or model_type == "gpt_oss":
        out["sliding_window"] = sliding_window
        every = 2
        if model_type == "gemma3_text":  # transformers' legacy key (config.json files on the Hub still hold it)
            every = values.get(
                "sliding_window_pattern", values.get("_sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
            )
        out["layer_types"] = values.get("layer_types") or [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(out["num_hidden_layers"])
        ]
    try:
        return ModelConfig.from_dict(out)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{source}: {err}") from None


def _yarn_fields_of(rope: dict[str, Any], source: str) -> dict[str, Any]:
    """The YaRN keys of ``rope_parameters`` as transformers' ``_compute_yarn_parameters`` reads them (beta_fast 32,
    beta_slow 1, truncate True when absent); ``mscale``/``mscale_all_dim`` (DeepSeek's variant) are refused."""
    for key in ("mscale", "mscale_all_dim"):
        if rope.get(key):
            _refuse(
                source,
                f"rope_parameters.{key}",
                rope[key],
                "twinseq builds YaRN with attention_factor or its default 0.1 * ln(factor) + 1: drop mscale and "
                "mscale_all_dim (or give attention_factor).",
            )
    if rope.get("factor") is None:
        _refuse(source, "rope_parameters.factor", None, "give YaRN's factor explicitly in rope_parameters.")
    out: dict[str, Any] = {
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_truncate": bool(rope.get("truncate", True)),
    }
    if rope.get("attention_factor") is not None:
        out["rope_attention_factor"] = float(rope["attention_factor"])
    return out


def _moe_fields_of(model_type: str, values: dict[str, Any], defaults: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``_MOE_FIELDS`` of a MoE family's config.json, as transformers reads it (``num_experts`` and
    ``num_local_experts`` are one field, as its ``attribute_map`` has it); nonzero ``router_jitter_noise`` is
    refused."""
    jitter = values.get("router_jitter_noise") or 0.0
    if float(jitter) != 0.0:
        _refuse(
            source,
            "router_jitter_noise",
            jitter,
            "transformers multiplies the MoE inputs by random noise in train mode, so no run repeats and the backends "
            "cannot agree: set router_jitter_noise to 0.0 in config.json.",
        )
    out = {key: values.get(key, defaults[key]) for key in _MOE_FIELDS[model_type]}
    if "num_experts" not in values and "num_local_experts" in values:  # Mixtral's name, and Qwen3MoeConfig.to_dict()'s
        out["num_experts"] = values["num_local_experts"]
    if model_type == "qwen3_moe":
        out["mlp_only_layers"] = list(out["mlp_only_layers"] or []) or None
    return out


def _gemma3_global_rope(values: dict[str, Any], source: str) -> dict[str, Any]:
    """The global layers' RoPE of a Gemma 3 config.json, plus ``local_theta`` (the sliding layers' base): from
    transformers 5's ``rope_parameters`` per layer type, or the older ``rope_theta``/``rope_local_base_freq``/
    ``rope_scaling`` keys (as ``Gemma3TextConfig.convert_rope_params_to_dict`` reads them)."""
    if values.get("use_bidirectional_attention"):
        _refuse(
            source,
            "use_bidirectional_attention",
            values["use_bidirectional_attention"],
            "twinseq builds causal language models: use a checkpoint with use_bidirectional_attention false.",
        )
    params = values.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(params or values.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", values.get("rope_theta", _HF_DEFAULTS["gemma3_text"]["rope_theta"]))
    local.setdefault(
        "rope_theta", values.get("rope_local_base_freq", _HF_DEFAULTS["gemma3_text"]["rope_local_base_freq"])
    )
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        _refuse(
            source,
            "rope_parameters.sliding_attention.rope_type",
            local_type,
            "twinseq rotates Gemma 3's sliding layers with default RoPE (rope_local_base_freq): use 'default'.",
        )
    return {**full, "local_theta": local["rope_theta"]}


def resolve_model_config(name_or_path: str) -> ModelConfig:
    """A preset name, or a directory holding a Hugging Face ``config.json``."""
    if name_or_path in MODEL_PRESETS:
        return ModelConfig.preset(name_or_path)
    config_json = Path(name_or_path) / "config.json"
    if config_json.is_file():
        try:
            values = json.loads(config_json.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{config_json}:{err.lineno}: not valid JSON ({err.msg}); fix the file, or save the model again."
            ) from None
        return from_hf_config(values, str(config_json))
    raise ConfigError(
        f"model_config={name_or_path!r} is neither a preset ({sorted(MODEL_PRESETS)}) nor a "
        f"directory with a config.json; pass a preset name or a local checkpoint path."
    )
