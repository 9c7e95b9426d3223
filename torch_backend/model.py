"""The torch model: a Hugging Face ``LlamaForCausalLM`` built from the neutral ``ModelConfig``.

Weights come from ``common.init.init_weights`` (numpy, HF names) or a local HF checkpoint
(``checkpoint.load_pretrained``), so the torch and JAX backends start from the same model.
The protocol functions ``build_model``, ``export_weights``, ``logits`` and ``loss_and_grads``
(``common.backend.Backend``) live here; ``logits`` and ``loss_and_grads`` run through
``attention.forward_hidden``, which masks documents on every attention path.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import numpy as np
import torch

from twinseq.common.batching import Batch
from twinseq.common.config import DEFAULT_CHUNK_SIZE, ModelConfig
from twinseq.common.errors import ConfigError
from twinseq.common.init import check_weights, init_weights, parameter_shapes
from twinseq.common.backend import Model
from twinseq.torch_backend.attention import check_attention_supported, forward_hidden, hf_attn_name

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not valid; choose one of {sorted(_DTYPES)} or a torch.dtype.")
    return _DTYPES[dtype]


def to_llama_config(cfg: ModelConfig, attn_implementation: str = "sdpa"):
    """``transformers.LlamaConfig`` of exactly the architecture ``cfg`` describes."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.rms_norm_eps, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False, mlp_bias=False,
        attention_dropout=0.0, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id, use_cache=False)
    config._attn_implementation = hf_attn_name(attn_implementation)
    return config


def model_config_from_hf(config) -> ModelConfig:
    """The neutral ``ModelConfig`` of a ``LlamaConfig`` (rope_theta read from ``rope_parameters``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported; twinseq builds default "
                          f"(unscaled) RoPE only. Use a checkpoint without RoPE scaling.")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ConfigError("attention_bias/mlp_bias=True is not supported by twinseq's Llama; use a checkpoint "
                          "without biases.")
    values = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                              "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                              "head_dim", "rms_norm_eps", "max_position_embeddings",
                                              "tie_word_embeddings", "initializer_range", "bos_token_id",
                                              "eos_token_id", "pad_token_id")}
    values["rope_theta"] = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    values = {k: v for k, v in values.items() if v is not None}
    return ModelConfig(**values)


def model_config_of(model: torch.nn.Module) -> ModelConfig:
    return model_config_from_hf(model.config)


def build_model(cfg: ModelConfig, weights: Optional[dict[str, np.ndarray]] = None, *, dtype: str = "float32",
                attn_implementation: str = "sdpa", device: Any = None) -> Model:
    """A ``LlamaForCausalLM`` of ``cfg`` in ``dtype`` on ``device`` (default CPU), in train mode.

    ``weights`` are HF-named numpy arrays, checked strictly by name and shape (``ValueError``
    listing every mismatch); None draws ``common.init.init_weights(cfg, seed=0)``, the same
    model the JAX backend builds.
    """
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    device = torch.device("cpu" if device is None else device)
    check_attention_supported(attn_implementation, device=device, requires_grad=False)
    weights = init_weights(cfg, seed=0) if weights is None else weights
    check_weights(cfg, weights)
    # HF's random init would only be overwritten; no_init_weights also skips the tying step
    with no_init_weights():
        model = LlamaForCausalLM(to_llama_config(cfg, attn_implementation))
    model.tie_weights()
    load_weights_(model, weights)
    model.to(device)
    _cast_parameters(model, _as_dtype(dtype))
    return model.train()


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
    """float32 numpy copies of every parameter, HF names; ``lm_head.weight`` omitted when tied."""
    names = parameter_shapes(model_config_of(model))
    params = dict(model.named_parameters())
    return {name: params[name].detach().to(device="cpu", dtype=torch.float32).numpy().copy() for name in names}


# --------------------------------------------------------------------------------------
# Backend protocol
# --------------------------------------------------------------------------------------


@torch.no_grad()
def logits(model: Model, batch: Batch) -> np.ndarray:
    """np.float32 [B, T, V] logits of ``batch`` with the model's attention path, documents masked."""
    hidden_BTH = forward_hidden(model, batch)
    return model.lm_head(hidden_BTH).float().cpu().numpy()


def compute_loss(model: torch.nn.Module, batch: Batch, loss_type: str = "nll", *,
                 attn_implementation: Optional[str] = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 return_metrics: bool = False):
    """Scalar loss tensor: ``sum of NLL over batch's targets / batch.num_items_in_batch``."""
    from twinseq.torch_backend.losses import causal_lm_loss

    hidden_BTH = forward_hidden(model, batch, attn_implementation)
    labels_BT = torch.as_tensor(batch.labels, dtype=torch.long, device=hidden_BTH.device)
    return causal_lm_loss(hidden_BTH, model.lm_head.weight, labels_BT, batch.num_items_in_batch, loss_type,
                          chunk_size=chunk_size, return_metrics=return_metrics)


def loss_and_grads(model: Model, batch: Batch, loss_type: str = "nll", *,
                   chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, float32 numpy gradient per HF parameter name) of one micro-batch.

    The loss is normalised by ``batch.num_items_in_batch`` (the whole step's label count), so
    summing the results of a step's micro-batches gives the full-batch loss and gradients.
    The model's ``.grad`` fields are cleared before and after.
    """
    model.zero_grad(set_to_none=True)
    loss = compute_loss(model, batch, loss_type, chunk_size=chunk_size)
    loss.backward()
    params = dict(model.named_parameters())
    grads = {}
    for name in parameter_shapes(model_config_of(model)):
        grad = params[name].grad
        grads[name] = (np.zeros(tuple(params[name].shape), np.float32) if grad is None
                       else grad.detach().to(device="cpu", dtype=torch.float32).numpy().copy())
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads
