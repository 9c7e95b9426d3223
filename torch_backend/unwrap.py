"""An adapter model seen from inside, without the ``peft`` package.

``peft.add_adapters`` returns a ``peft.PeftModel`` carrying its ``PeftConfig``; the rest of the backend reaches
through that wrapper with the helpers here, which only read attributes:

- ``is_adapter_model``: whether a model is one; ``causal_lm_of``: the HF ``*ForCausalLM`` that runs inside it;
- ``lm_head_weight``: the [V, H] weight the forward really multiplies by (with trainable tokens on a tied
  embedding, the head's rows are the adapter's), so every attention path and every loss runs on an adapter model;
- ``adapter_parameters`` / ``adapter_grads``: the adapter tensors and their gradients by PEFT *saved* key
  (``saved_key``: PEFT's in-memory names carry the adapter name ``default``);
- ``base_layer_of`` / ``dense_weight``: the plain module under PEFT's wrappers and its weight in float32 (an
  NF4 ``Params4bit`` dequantised by bitsandbytes), from which ``model.base_weights`` reads the base.

Nothing here imports ``peft``, and only ``dense_weight`` imports bitsandbytes (an NF4 weight exists only where it is
installed), so ``blocked_attention``, ``attention``, ``model`` and ``memory`` import this module, and
``twinseq.torch_backend.peft`` builds on them, never the reverse.
"""

from __future__ import annotations

import re
from typing import Any, cast

import numpy as np
import torch

from twinseq.common.backend import Model
from twinseq.torch_backend.moe import dequantize_experts

ADAPTER_NAME = "default"
PEFT_CONFIG_ATTR = "_twinseq_peft"  # the attribute of a PeftModel holding the PeftConfig add_adapters was given
_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_magnitude_vector", "trainable_tokens_delta")


def is_adapter_model(model: Any) -> bool:
    """True for a model ``add_adapters`` returned (a ``peft.PeftModel`` carrying its ``PeftConfig``)."""
    return isinstance(model, torch.nn.Module) and PEFT_CONFIG_ATTR in model.__dict__


def causal_lm_of(model: Model) -> torch.nn.Module:
    """The HF ``*ForCausalLM`` that runs: the model itself, or the one inside a ``PeftModel`` (its linear layers
    are PEFT's LoRA layers, so calling it runs the adapters)."""
    return model.get_base_model() if is_adapter_model(model) else model


def token_adapter(module: torch.nn.Module):
    """PEFT's ``TrainableTokensLayer`` of a wrapped embedding or tied lm_head, else None."""
    return getattr(module, "token_adapter", None) if "token_adapter" in getattr(module, "_modules", {}) else None


def lm_head_weight(model: Model) -> torch.Tensor:
    """The [V, H] weight the lm_head multiplies by in this forward: ``lm_head.weight``, or, with trainable tokens
    on a tied embedding, the base weight with the adapter's rows written in (differentiable in those rows;
    the base rows again while the adapters are disabled)."""
    head = cast(torch.nn.Module, causal_lm_of(model).lm_head)
    adapter = token_adapter(head)
    if adapter is None:
        return cast(torch.Tensor, head.weight)
    if adapter.disable_adapters or not adapter.active_adapters:
        return adapter.base_layer.weight
    return adapter.get_merged_weights(adapter.active_adapters)


# --------------------------------------------------------------------------------------
# The adapter tensors, by PEFT saved key
# --------------------------------------------------------------------------------------


def is_adapter_name(name: str) -> bool:
    """Whether a ``PeftModel`` parameter name is an adapter tensor's."""
    return any(f".{part}." in name or name.endswith(f".{part}") for part in _ADAPTER_PARTS)


def saved_key(name: str) -> str:
    """PEFT's saved key of a ``PeftModel`` parameter name (``...lora_A.default.weight`` -> ``...lora_A.weight``,
    ``...lora_magnitude_vector.default.weight`` -> ``...lora_magnitude_vector``)."""
    key = re.sub(rf"\.{ADAPTER_NAME}(?=\.|$)", "", name)
    return key.removesuffix(".weight") if key.endswith("lora_magnitude_vector.weight") else key


def adapter_parameters(model: Model) -> dict[str, torch.nn.Parameter]:
    """``{PEFT saved key: parameter}`` of every adapter tensor (PEFT's in-memory names carry the adapter name
    ``.default``, and DoRA's magnitude a ``.weight``, that the saved names drop)."""
    return {saved_key(name): param for name, param in model.named_parameters() if is_adapter_name(name)}


def adapter_grads(model: Model) -> dict[str, np.ndarray]:
    """float32 numpy gradients of the adapter tensors by PEFT key (zeros where none flowed)."""
    return {
        k: (
            np.zeros(tuple(p.shape), np.float32)
            if p.grad is None
            else p.grad.detach().to(device="cpu", dtype=torch.float32).numpy().copy()
        )
        for k, p in adapter_parameters(model).items()
    }


# --------------------------------------------------------------------------------------
# The base modules under PEFT's wrappers, NF4 dequantised
# --------------------------------------------------------------------------------------


def base_layer_of(module: torch.nn.Module) -> torch.nn.Module:
    """The plain module under PEFT's wrappers of ``module`` (LoRA layers, trainable tokens), or ``module``."""
    while True:
        adapter = token_adapter(module)
        if adapter is not None:
            module = adapter.base_layer
        elif "base_layer" in module._modules:
            module = cast(torch.nn.Module, module.base_layer)
        else:
            return module


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a weight; a bitsandbytes NF4 ``Params4bit`` is dequantised (an NF4 expert tensor
    ``[E, a, b]`` by ``moe.dequantize_experts``, the numbers the experts' kernel multiplies by)."""
    state = getattr(weight, "quant_state", None)
    if type(weight).__name__ == "Params4bit" and state is not None and len(state.shape) == 3:
        return dequantize_experts(weight, 0, state.shape[0])
    if type(weight).__name__ == "Params4bit" and state is not None:
        import bitsandbytes.functional as bnbf  # optional dependency

        data, state = weight.data, cast(Any, weight).quant_state  # a Params4bit (bitsandbytes is untyped)
        if getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.backends.cpu.ops import _convert_weight_packed_for_cpu_inverse  # optional dependency

            data, state = _convert_weight_packed_for_cpu_inverse(data, state)
        return bnbf.dequantize_4bit(data, state).to(torch.float32)
    return weight.detach().to(torch.float32)
