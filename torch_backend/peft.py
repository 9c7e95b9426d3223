"""PEFT on the torch backend: LoRA/DoRA/rsLoRA adapters, QLoRA's 4-bit base and trainable tokens.

The rules (targets, initial values, scaling, key names, merge) are ``twinseq.common.models.peft``'s; the layers are
the real ``peft`` library's (``LoraConfig`` + ``get_peft_model``), so an adapter model here is a
``peft.PeftModel`` that PEFT, TRL and ``transformers`` recognise:

- LoRA on the experts of MoE layers (``lora_target_parameters``): PEFT's ``target_parameters``, one
  ``lora.ParamWrapper`` per fused expert tensor (``experts.gate_up_proj`` ``[E, 2m, h]``, ``experts.down_proj``),
  whose forward adds ``scaling * B_e @ A_e`` to each expert's weight while the experts run;
- ``add_adapters`` wraps a plain model (``model.build_model``/``load_pretrained``) and overwrites PEFT's random
  initialisation with ``common.models.peft.init_adapters`` (or given adapters), so the torch and JAX backends start
  from the same numbers. With ``load_in_4bit`` the decoder's linear layers are first quantised to NF4 by
  bitsandbytes (``Linear4bit``, float32 compute; its CPU backend runs forward and backward), and PEFT wraps
  them with its own 4-bit LoRA layers (QLoRA). A MoE model's fused expert tensors become NF4 too
  (``moe.quantize_experts_``, run by twinseq's grouped kernel a chunk of experts at a time); LoRA on them is
  ``moe.NF4ExpertLoRA`` in the place and under the names of PEFT's ``ParamWrapper``, which cannot wrap NF4.
- Only the adapter tensors (``lora_A``, ``lora_B``, DoRA's ``lora_magnitude_vector``, the trainable-token
  rows) require grad; every other tensor is frozen.
- ``adapter_parameters`` maps the live parameters to PEFT's *saved* key names (``...q_proj.lora_A.weight``:
  PEFT's in-memory names carry the adapter name ``default``), the keys of ``export_adapters`` and of the
  gradients ``loss_and_grads``/``dpo_loss_and_grads`` return for an adapter model.
- ``unwrap`` (which needs neither this module nor the ``peft`` package) reaches inside the wrapper for the rest of
  the backend: ``causal_lm_of`` and ``lm_head_weight`` give the HF ``*ForCausalLM`` inside it and the lm_head
  weight the forward really uses (with trainable tokens on a tied embedding, the head's rows are the adapter's),
  so every attention path and every loss (``nll``, ``chunked_nll``, ``fused_linear``) runs on an adapter model;
  ``model.base_weights`` reads the base through PEFT's wrappers. This module builds on ``model`` and ``unwrap``.
- DPO's reference is the same model under ``adapters_disabled`` (PEFT's ``disable_adapter``), never a copy.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import sys
from typing import Any, Iterator, Optional

import numpy as np
import torch

from twinseq.common.backend import Model
from twinseq.common.errors import ConfigError, MissingDependencyError
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.peft import (
    NF4_BLOCKSIZE,
    PeftConfig,
    adapter_shapes,
    check_adapters,
    check_token_indices,
    expert_targets,
    init_adapters,
    lora_targets,
)
from twinseq.common.models.peft import merge_adapters as merge_adapter_weights
from twinseq.torch_backend.attention import twinseq_attn_name
from twinseq.torch_backend.model import base_weights, build_model, model_config_of
from twinseq.torch_backend.moe import NF4ExpertLoRA, experts_modules, quantize_experts_

# re-exported for the modules that still import them from here (they live in unwrap now): lm_head_weight
# (grpo.py, deepspeed.py, parallel.py), saved_key (trainer.py)
from twinseq.torch_backend.unwrap import (  # noqa: F401
    PEFT_CONFIG_ATTR,
    adapter_parameters,
    causal_lm_of,
    is_adapter_model,
    lm_head_weight,
    saved_key,
)

logger = logging.getLogger(__name__)

PEFT_EXTRA = "pip install -e '.[peft]'"


# --------------------------------------------------------------------------------------
# Dependencies
# --------------------------------------------------------------------------------------


def peft_available() -> bool:
    return importlib.util.find_spec("peft") is not None


def bitsandbytes_available() -> bool:
    """bitsandbytes importable (QLoRA's NF4 layers, ``adamw_bnb_8bit``); tests patch this to simulate its absence."""
    return importlib.util.find_spec("bitsandbytes") is not None


@contextlib.contextmanager
def bitsandbytes_hidden(hide: bool = True) -> Iterator[None]:
    """While active (``hide``), ``import bitsandbytes`` raises ImportError and ``importlib.util.find_spec`` finds
    nothing, unless bitsandbytes is already imported; afterwards it is importable again.

    PEFT imports bitsandbytes whenever it is installed: ``import peft`` (``peft.helpers``) and each LoRA layer's
    dispatch (``is_bnb_available``). On a run that quantizes nothing that costs about two seconds and prints
    bitsandbytes' warning about its missing CPU kernels. PEFT reads the absence at call time, so a later QLoRA run
    in the same process still finds bitsandbytes.
    """
    if not hide or "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # Python's own "import blocked" marker
    try:
        yield
    finally:
        if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]


def require_peft() -> None:
    if not peft_available():
        raise MissingDependencyError(f"use_peft=True needs the 'peft' package; install it with `{PEFT_EXTRA}`.")


def require_bitsandbytes(what: str) -> None:
    if not bitsandbytes_available():
        raise MissingDependencyError(
            f"{what} needs the 'bitsandbytes' package (its CPU backend works too); install "
            f"it with `{PEFT_EXTRA}`, or drop {what}."
        )


# --------------------------------------------------------------------------------------
# An adapter model's config, and its reference
# --------------------------------------------------------------------------------------


def peft_config_of(model: Model) -> PeftConfig:
    if not is_adapter_model(model):
        raise ConfigError(f"{type(model).__name__} has no adapters; call add_adapters(model, cfg, peft) first.")
    return model.__dict__[PEFT_CONFIG_ATTR]


@contextlib.contextmanager
def adapters_disabled(model: Model) -> Iterator[Model]:
    """The base model inside this block: PEFT's ``disable_adapter`` (DPO's reference, as TRL does)."""
    if not is_adapter_model(model):
        raise ConfigError(
            f"adapters_disabled needs an adapter model, but this {type(model).__name__} has none to disable; "
            "add them with add_adapters first."
        )
    wrappers = [m for m in model.modules() if isinstance(m, NF4ExpertLoRA)]  # not PEFT's layers: disabled here
    with model.disable_adapter():
        for wrapper in wrappers:
            wrapper.disable_adapters = True
        try:
            yield model
        finally:
            for wrapper in wrappers:
                wrapper.disable_adapters = False


@contextlib.contextmanager
def reference_mode(model: Model) -> Iterator[Model]:
    """DPO's reference model: the policy with its adapters disabled, in eval mode (no dropout), restored after."""
    was_training = model.training
    with adapters_disabled(model):
        model.eval()
        try:
            yield model
        finally:
            model.train(was_training)


# --------------------------------------------------------------------------------------
# add_adapters
# --------------------------------------------------------------------------------------


def check_peft_model(model: torch.nn.Module, cfg: ModelConfig, peft: PeftConfig) -> None:
    """Refuse what cannot combine, before anything is built."""
    if not peft.use_peft:
        raise ConfigError("add_adapters was given use_peft=False; set use_peft=True (--use-peft) to add adapters.")
    if is_adapter_model(model):
        raise ConfigError(
            f"this {type(model).__name__} already has adapters (add_adapters was called on it); merge_adapters or "
            "build a new base model first."
        )
    lora_targets(cfg, peft)  # ConfigError for unknown target modules, empty lists, repeated token ids
    expert_targets(cfg, peft)  # ConfigError for expert tensors on a model without experts
    check_token_indices(cfg, peft)
    if peft.lora_r <= 0:  # PeftConfig checks this on construction; a config built with checks off still must not
        raise ConfigError(f"lora_r={peft.lora_r} is not valid: pass an adapter rank >= 1 (--lora-r).")
    dtypes = {p.dtype for p in model.parameters()}
    if peft.load_in_4bit and dtypes != {torch.float32}:
        raise ConfigError(
            f"load_in_4bit=True quantises a float32 base here (parameters are "
            f"{sorted(map(str, dtypes))}); build the model with dtype='float32' (bitsandbytes computes "
            f"in float32 on CPU)."
        )


def add_adapters(
    model: Model, cfg: ModelConfig, peft: PeftConfig, adapters: Optional[dict[str, np.ndarray]] = None
) -> Model:
    """``model`` wrapped by ``peft.get_peft_model`` with LoRA/DoRA adapters on ``common.models.peft.lora_targets`` (and
    trainable tokens, and an NF4 base with ``load_in_4bit``), loaded from ``adapters`` (PEFT keys; None:
    ``common.models.peft.init_adapters(cfg, peft, seed=0, base_weights=...)``). Only the adapters require grad.

    The plain model is modified in place (PEFT injects its layers into it); use the returned ``PeftModel``.
    """
    return add_adapters_seeded(model, cfg, peft, adapters, seed=0)


def add_adapters_seeded(
    model: Model, cfg: ModelConfig, peft: PeftConfig, adapters: Optional[dict[str, np.ndarray]] = None, *, seed: int = 0
) -> Model:
    """``add_adapters`` whose fresh adapters are drawn with ``seed`` (the trainer's ``TrainConfig.seed``)."""
    require_peft()
    check_peft_model(model, cfg, peft)
    with bitsandbytes_hidden(not peft.load_in_4bit):
        from peft import LoraConfig, get_peft_model  # optional dependency

    if peft.load_in_4bit:
        require_bitsandbytes("load_in_4bit=True (QLoRA)")
    if adapters is not None:
        check_adapters(cfg, peft, adapters, "add_adapters(adapters=...)")
    if peft.load_in_4bit:
        quantize_4bit_(model)
    if adapters is None:
        # from the weights the forward multiplies by (NF4 dequantised under QLoRA): DoRA's magnitude starts at
        # their row norms, so the adapted model starts equal to its base, as PEFT's own initialisation does
        adapters = init_adapters(cfg, peft, seed=seed, base_weights=base_weights(model))
    targets = sorted(lora_targets(cfg, peft))
    # an NF4 expert tensor is no float Parameter for PEFT's ParamWrapper: twinseq's NF4ExpertLoRA takes its place
    nf4_experts = peft.load_in_4bit and bool(expert_targets(cfg, peft))
    config = LoraConfig(
        r=peft.lora_r,
        lora_alpha=peft.lora_alpha,
        lora_dropout=peft.lora_dropout,
        # explicit module paths (not "all-linear"): exactly common.models.peft's targets, whatever PEFT's own rule is
        target_modules=targets,
        # the experts' fused 3-D tensors, by full path: PEFT's ParamWrapper (W[e] + scaling * B_e @ A_e per expert)
        target_parameters=None if nf4_experts else list(expert_targets(cfg, peft)) or None,
        use_rslora=peft.use_rslora,
        use_dora=peft.use_dora,
        bias="none",
        task_type="CAUSAL_LM",
        trainable_token_indices=(
            {"embed_tokens": list(peft.trainable_token_indices)} if peft.trainable_token_indices else None
        ),
    )
    with bitsandbytes_hidden(not peft.load_in_4bit):
        wrapped = get_peft_model(model, config)
    wrapped.__dict__[PEFT_CONFIG_ATTR] = peft
    if nf4_experts:
        add_nf4_expert_lora_(causal_lm_of(wrapped), cfg, peft)
    params = adapter_parameters(wrapped)
    expected = adapter_shapes(cfg, peft)
    if set(params) != set(expected):
        raise AssertionError(
            f"PEFT built other adapter tensors than common.models.peft expects: missing "
            f"{sorted(set(expected) - set(params))[:3]}, extra "
            f"{sorted(set(params) - set(expected))[:3]}"
        )
    load_adapters_(wrapped, adapters)
    trainable = {id(p) for p in params.values()}
    for param in wrapped.parameters():
        param.requires_grad_(id(param) in trainable)
    return wrapped


def add_nf4_expert_lora_(causal_lm: torch.nn.Module, cfg: ModelConfig, peft: PeftConfig) -> int:
    """LoRA on the NF4 experts (``load_in_4bit`` + ``lora_target_parameters``): an ``moe.NF4ExpertLoRA`` per targeted
    tensor, nested in PEFT's order (the first target innermost), in place of the experts module, so the adapter
    tensors carry PEFT's saved keys (``common.models.peft.expert_adapter_keys``); returns how many wrappers."""
    count = 0
    for path in expert_targets(cfg, peft):
        module_path, _, name = path.rpartition(".")
        parent_path, _, attr = module_path.rpartition(".")
        parent = causal_lm.get_submodule(parent_path)
        setattr(parent, attr, NF4ExpertLoRA(getattr(parent, attr), name, peft.lora_r, peft.scaling))
        count += 1
    return count


@torch.no_grad()
def load_adapters_(model: Model, adapters: dict[str, np.ndarray]) -> None:
    """Copy adapter tensors (PEFT keys) into an adapter model, in place (strict names and shapes)."""
    params = adapter_parameters(model)
    missing, unexpected = sorted(set(params) - set(adapters)), sorted(set(adapters) - set(params))
    if missing or unexpected:
        raise ConfigError(
            f"the adapters do not fit this adapter model: missing keys {missing[:3]}, unexpected keys "
            f"{unexpected[:3]}; pass the tensors of the same PeftConfig."
        )
    for key, param in params.items():
        value = torch.as_tensor(np.asarray(adapters[key]), device=param.device, dtype=param.dtype)
        if tuple(value.shape) != tuple(param.shape):
            raise ConfigError(
                f"adapter {key}: shape {tuple(value.shape)} != {tuple(param.shape)} of this model; pass the tensors "
                "of the same PeftConfig (lora_r, targets)."
            )
        param.copy_(value)


def export_adapters(model: Model) -> dict[str, np.ndarray]:
    """float32 numpy adapter tensors by PEFT saved key (what ``common.models.peft.save_adapters`` writes)."""
    peft_config_of(model)
    return {
        k: p.detach().to(device="cpu", dtype=torch.float32).numpy().copy() for k, p in adapter_parameters(model).items()
    }


# --------------------------------------------------------------------------------------
# QLoRA: the decoder's linear layers in NF4
# --------------------------------------------------------------------------------------


@torch.no_grad()
def quantize_4bit_(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of the decoder layers (never the embedding or lm_head, as transformers'
    bitsandbytes quantiser does) by bitsandbytes' ``Linear4bit`` (NF4, float32 compute), in place; returns how
    many layers were quantised."""
    import bitsandbytes as bnb  # optional dependency

    device = next(model.parameters()).device
    num_experts = _quantize_experts_4bit_(model, bnb)
    count = 0
    for layer in causal_lm_of(model).model.layers:
        for name, child in list(layer.named_modules()):
            if type(child) is not torch.nn.Linear:
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=torch.float32,
                quant_type="nf4",
                quant_storage=torch.uint8,
                device="meta",
            )
            q.weight = bnb.nn.Params4bit(
                child.weight.data.to("cpu"), requires_grad=False, quant_type="nf4", quant_storage=torch.uint8
            ).to(device)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
            setattr(parent, attr, q)
            count += 1
    logger.info(
        "load_in_4bit: %d linear layers and %d expert tensors quantised to NF4 (bitsandbytes %s, float32 compute)",
        count,
        num_experts,
        getattr(bnb, "__version__", "?"),
    )
    return count


def _quantize_experts_4bit_(model: torch.nn.Module, bnb: Any) -> int:
    """Every MoE experts module's ``gate_up_proj`` and ``down_proj`` to NF4 (``moe.quantize_experts_``: blocks of
    ``NF4_BLOCKSIZE`` with float32 absmax, flattened so that each expert is a whole run of blocks and dequantises
    alone), on the device they are on; returns how many tensors."""
    count = 0
    for experts in experts_modules(causal_lm_of(model)):
        path = next(name for name, m in causal_lm_of(model).named_modules() if m is experts)
        shape = tuple(experts.gate_up_proj.shape)
        for name in ("gate_up_proj", "down_proj"):
            numbers = math.prod(getattr(experts, name).shape[1:])
            if numbers % NF4_BLOCKSIZE:
                raise ConfigError(
                    f"load_in_4bit=True: {path}.{name} has {numbers} numbers per expert, not a multiple of the NF4 "
                    f"block ({NF4_BLOCKSIZE}), so an expert would not dequantise alone; drop --load-in-4bit for this "
                    "model, or use hidden and intermediate sizes with a product divisible by 64."
                )

        def to_nf4(weight: torch.Tensor) -> torch.Tensor:
            codes, state = bnb.functional.quantize_4bit(
                weight.reshape(-1).to(torch.float32).contiguous(),
                blocksize=NF4_BLOCKSIZE,
                compress_statistics=False,
                quant_type="nf4",
                quant_storage=torch.uint8,
            )
            state.shape = weight.shape
            return bnb.nn.Params4bit(
                codes,
                requires_grad=False,
                quant_state=state,
                blocksize=NF4_BLOCKSIZE,
                compress_statistics=False,
                quant_type="nf4",
                quant_storage=torch.uint8,
                bnb_quantized=True,
            )

        try:
            count += quantize_experts_(experts, to_nf4)
        except ValueError as err:
            raise ConfigError(
                f"load_in_4bit=True: twinseq's grouped kernel cannot run the NF4 experts {path} {shape} ({err}); "
                "drop --load-in-4bit for this model."
            ) from None
    return count


def is_quantized(model: Model) -> bool:
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())


# --------------------------------------------------------------------------------------
# merge
# --------------------------------------------------------------------------------------


def merge_adapters(model: Model) -> Model:
    """A plain HF model (float32, same attention path) whose weights are the base's (NF4 dequantised) with the
    adapters folded in by ``common.models.peft.merge_adapters``; ``model`` is left as it is."""
    peft = peft_config_of(model)
    inner = causal_lm_of(model)
    cfg = model_config_of(inner)
    merged = merge_adapter_weights(cfg, peft, base_weights(model), export_adapters(model))
    device = next(model.parameters()).device
    plain = build_model(
        cfg, merged, attn_implementation=twinseq_attn_name(inner.config._attn_implementation), device=device
    )
    return plain.train(model.training)
