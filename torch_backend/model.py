"""The torch model: a Hugging Face ``AutoModelForCausalLM`` of any family ``ModelConfig`` describes.

``common.models.configs`` decides the architecture (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3) and writes its
``config.json`` (``to_hf_config``); this module hands that to transformers' own classes
(``AutoConfig.for_model`` + ``AutoModelForCausalLM``), so the torch backend runs exactly the
modules a Hugging Face checkpoint runs. Weights come from ``common.models.init.init_weights`` (numpy, HF
names) or a local HF checkpoint (``checkpoint.load_pretrained``), so the torch and JAX backends
start from the same model. The protocol functions ``build_model``, ``export_weights``, ``logits``
and ``loss_and_grads`` (``common.backend.Backend``) live here; ``logits`` and ``loss_and_grads``
run through ``attention.forward_hidden``, which masks documents (and sliding windows) on every
attention path, and apply the family's final logit soft-cap (Gemma 2; Gemma 3 when set) before the softmax. An adapter
model (``peft.add_adapters``) is reached through ``unwrap``; ``peft`` builds on this module, never the reverse.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.initialization import no_init_weights

from twinseq.common.backend import Model
from twinseq.common.config import DEFAULT_CHUNK_SIZE, ModelConfig
from twinseq.common.data.batching import Batch
from twinseq.common.errors import ConfigError
from twinseq.common.models.configs import from_hf_config, to_hf_config
from twinseq.common.models.init import check_weights, init_weights, parameter_shapes
from twinseq.torch_backend.attention import (
    check_attention_supported,
    forward_hidden,
    hf_attn_name,
    resolve_attn_implementation,
)
from twinseq.torch_backend.losses import apply_logit_softcap, final_logit_softcap, sft_loss_with_aux
from twinseq.torch_backend.moe import select_experts_implementation
from twinseq.torch_backend.unwrap import (
    adapter_grads,
    base_layer_of,
    causal_lm_of,
    dense_weight,
    is_adapter_model,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not valid; choose one of {sorted(_DTYPES)} or a torch.dtype.")
    return _DTYPES[dtype]


def to_hf_model_config(cfg: ModelConfig, attn_implementation: str = "sdpa"):
    """The transformers config object (``LlamaConfig``, ``Gemma2Config``, ...) of exactly ``cfg``.

    Built by ``AutoConfig.for_model`` from ``common.models.configs.to_hf_config``, i.e. from the same
    ``config.json`` a checkpoint of ``cfg`` holds, so a built model and a loaded one agree.
    ``attn_implementation`` is resolved first (``resolve_attn_implementation``: Gemma 2's
    soft-capped attention runs ``eager`` where ``sdpa`` is asked for).
    """
    values = to_hf_config(cfg)
    values.pop("architectures")
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = hf_attn_name(resolve_attn_implementation(attn_implementation, config))
    return config


def model_config_of(model: torch.nn.Module) -> ModelConfig:
    """The neutral ``ModelConfig`` of a transformers model, read from its config as a ``config.json``
    (``common.models.configs.from_hf_config``: an architecture twinseq does not build raises ``ConfigError``)."""
    return from_hf_config(model.config.to_dict(), f"{type(model).__name__}.config")


def make_rope_stateless_(model: torch.nn.Module) -> None:
    """Make dynamic RoPE depend on the current batch only (``common.models.rope``'s rule), in place.

    transformers' ``dynamic_rope_update`` keeps the largest ``seq_len`` seen so far in the rotary
    module (``inv_freq``, ``max_seq_len_cached``) and only shrinks back below
    ``max_position_embeddings``: a batch whose longest document is 22 tokens is rotated with the
    frequencies of a 23-token batch that came before it. A forward pre-hook restores the module's
    original state before every call, so each forward recomputes from its own largest position id.
    Other RoPE types have no state; the hook is installed only where it matters.
    """
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or "dynamic" not in str(getattr(rotary, "rope_type", "")):
        return
    if not getattr(rotary, "_twinseq_stateless", False):
        rotary.register_forward_pre_hook(_reset_dynamic_rope)
        rotary._twinseq_stateless = True


def _reset_dynamic_rope(rotary: torch.nn.Module, _args) -> None:
    # HF's own "reset" branch, taken unconditionally: the next forward grows from the original state
    rotary.register_buffer("inv_freq", rotary.original_inv_freq.clone(), persistent=False)
    rotary.max_seq_len_cached = rotary.original_max_seq_len


def build_model(
    cfg: ModelConfig,
    weights: Optional[dict[str, np.ndarray]] = None,
    *,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    device: Any = None,
) -> Model:
    """An ``AutoModelForCausalLM`` of ``cfg`` (its family's HF class) in ``dtype`` on ``device``
    (default CPU), in train mode.

    ``weights`` are HF-named numpy arrays, checked strictly by name and shape (``ValueError``
    listing every mismatch); None draws ``common.models.init.init_weights(cfg, seed=0)``, the same
    model the JAX backend builds. MoE experts run ``torch_backend.moe``'s grouped kernel on CPU.
    """
    device = torch.device("cpu" if device is None else device)
    check_attention_supported(attn_implementation, device=device, requires_grad=False)
    weights = init_weights(cfg, seed=0) if weights is None else weights
    check_weights(cfg, weights)
    config = to_hf_model_config(cfg, attn_implementation)
    # HF's random init would only be overwritten; no_init_weights also skips the tying step
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    make_rope_stateless_(model)
    load_weights_(model, weights)
    model.to(device)
    _cast_parameters(model, _as_dtype(dtype))
    select_experts_implementation(model, device)
    return model.train()


def cast_parameters_(model: torch.nn.Module, dtype: Union[str, torch.dtype]) -> torch.nn.Module:
    """``model`` with every parameter in ``dtype`` (``"bfloat16"``, ...), in place; buffers stay float32."""
    _cast_parameters(model, _as_dtype(dtype))
    return model


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters to ``dtype``; buffers (RoPE ``inv_freq``) stay float32, as HF's from_pretrained keeps them."""
    for param in model.parameters():  # a tied weight is listed once
        param.data = param.data.to(dtype)
    model.config.dtype = dtype


@torch.no_grad()
def load_weights_(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Copy HF-named numpy ``weights`` into ``model`` in place (strict names and shapes)."""
    cfg = model_config_of(model)
    check_weights(cfg, weights)
    params = dict(model.named_parameters())
    for name in parameter_shapes(cfg):
        assert name in params, f"{name} is in parameter_shapes but not in the HF model"
        param = params[name]
        param.copy_(torch.as_tensor(np.asarray(weights[name]), device=param.device, dtype=param.dtype))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tied embeddings are not shared"


def export_weights(model: Model) -> dict[str, np.ndarray]:
    """float32 numpy copies of every parameter, HF names; ``lm_head.weight`` omitted when tied.

    Of an adapter model (``add_adapters``): its base weights (NF4 dequantised under QLoRA), without the adapters
    (``export_adapters`` has those; ``merge_adapters`` folds them in)."""
    if is_adapter_model(model):
        return base_weights(model)
    names = parameter_shapes(model_config_of(model))
    params = dict(model.named_parameters())
    return {name: params[name].detach().to(device="cpu", dtype=torch.float32).numpy().copy() for name in names}


def base_weights(model: Model) -> dict[str, np.ndarray]:
    """float32 numpy base weights in HF names (``common.models.configs.parameter_shapes``), through PEFT's wrappers; an
    NF4 weight dequantised (the numbers QLoRA's forward multiplies by)."""
    inner = causal_lm_of(model)
    out = {}
    for name in parameter_shapes(model_config_of(inner)):
        module_name, _, attr = name.rpartition(".")
        module = base_layer_of(inner.get_submodule(module_name))
        out[name] = dense_weight(getattr(module, attr)).cpu().numpy().copy()
    return out


# --------------------------------------------------------------------------------------
# Backend protocol
# --------------------------------------------------------------------------------------


@torch.no_grad()
def logits(model: Model, batch: Batch) -> np.ndarray:
    """np.float32 [B, T, V] logits of ``batch`` with the model's attention path, documents masked, after the
    family's final soft-cap (applied in float32, after the upcast)."""
    hidden_BTH = forward_hidden(model, batch)
    head = causal_lm_of(model).lm_head  # through PEFT's wrapper: trainable-token rows of a tied head included
    return apply_logit_softcap(head(hidden_BTH).float(), final_logit_softcap(model)).cpu().numpy()


def compute_loss(
    model: torch.nn.Module,
    batch: Batch,
    loss_type: str = "nll",
    *,
    attn_implementation: Optional[str] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_metrics: bool = False,
):
    """Scalar loss tensor: ``sum of NLL over batch's targets / batch.num_items_in_batch`` (of the soft-capped
    logits when the family caps them), plus a MoE model's weighted aux loss with ``output_router_logits``
    (``losses.sft_loss_with_aux``, one micro-batch)."""
    return sft_loss_with_aux(
        model,
        batch,
        attn_implementation,
        loss_type=loss_type,
        chunk_size=chunk_size,
        return_metrics=return_metrics,
        logit_softcap=final_logit_softcap(model),
    )


def loss_and_grads(
    model: Model, batch: Batch, loss_type: str = "nll", *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, float32 numpy gradient per HF parameter name) of one micro-batch.

    The loss is normalised by ``batch.num_items_in_batch`` (the whole step's label count), so
    summing the results of a step's micro-batches gives the full-batch loss and gradients.
    The model's ``.grad`` fields are cleared before and after. Of an adapter model (``add_adapters``): the
    gradients of the adapter tensors only, by PEFT saved key.
    """
    model.zero_grad(set_to_none=True)
    loss = compute_loss(model, batch, loss_type, chunk_size=chunk_size)
    loss.backward()
    if is_adapter_model(model):
        grads = adapter_grads(model)
        model.zero_grad(set_to_none=True)
        return float(loss.detach()), grads
    params = dict(model.named_parameters())
    grads = {}
    for name in parameter_shapes(model_config_of(model)):
        grad = params[name].grad
        grads[name] = (
            np.zeros(tuple(params[name].shape), np.float32)
            if grad is None
            else grad.detach().to(device="cpu", dtype=torch.float32).numpy().copy()
        )
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads
