"""Hugging Face model folders as numpy, without any framework: ``config.json`` + safetensors.

A model folder holds ``config.json`` and ``model.safetensors`` (or shards listed by
``model.safetensors.index.json``), as ``LlamaForCausalLM.save_pretrained`` writes it. Tensors
are read and written with ``safetensors.numpy``, never converted on the way through (float32
stays float32, bfloat16 stays bfloat16), so torch -> jax -> torch is bitwise exact. The JAX
backend loads and saves models through this module; both backends check folders with it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import numpy as np

from twinseq.common.config import ModelConfig
from twinseq.common.init import check_weights, parameter_shapes

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def _hf_config_to_model_config(values: dict, source: str) -> ModelConfig:
    """ModelConfig from an HF ``config.json`` dict; raises on features this Llama does not have."""
    if values.get("model_type", "llama") != "llama":
        raise ValueError(f"{source}: model_type={values.get('model_type')!r} is not supported; only 'llama' "
                         f"checkpoints can be imported.")
    for flag in ("attention_bias", "mlp_bias"):
        if values.get(flag, False):
            raise ValueError(f"{source}: {flag}=True is not supported (twinseq's Llama has no biases); "
                             f"use a checkpoint with {flag}=false.")
    if values.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={values['hidden_act']!r} is not supported; only 'silu' (SwiGLU).")
    rope = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{source}: rope_type={rope_type!r} is not supported; only the default (unscaled) RoPE.")
    values = dict(values)
    if "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    return ModelConfig.from_dict(values)


def _model_config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
    values = cfg.to_dict()
    rope_theta = values.pop("rope_theta")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "mlp_bias": False, "dtype": dtype,
            "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"}, **values}


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"{str(directory)!r} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}; save the model with "
                     f"save_pretrained(..., safe_serialization=True).")


def _drop_tied_head(cfg: ModelConfig, weights: dict[str, np.ndarray], source: str) -> None:
    """A tied checkpoint may still store ``lm_head.weight``; accept it only as an exact copy."""
    if not cfg.tie_word_embeddings or "lm_head.weight" not in weights:
        return
    if not np.array_equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]):
        raise ValueError(f"{source}: tie_word_embeddings=True but lm_head.weight differs from "
                         f"model.embed_tokens.weight; set tie_word_embeddings=false in config.json.")
    logger.info("%s: dropping lm_head.weight, an exact copy of the tied model.embed_tokens.weight", source)
    del weights["lm_head.weight"]


def read_hf_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read an HF Llama checkpoint directory -> (ModelConfig, HF-named numpy weights as stored).

    Raises ``ValueError`` naming any missing, unexpected or mis-shaped tensor.
    """
    from safetensors.numpy import load_file

    directory = Path(path)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{str(directory)!r} has no {CONFIG_FILE}; pass a Hugging Face checkpoint directory.")
    cfg = _hf_config_to_model_config(json.loads(config_path.read_text()), str(config_path))
    weights: dict[str, np.ndarray] = {}
    for file in _weight_files(directory):
        weights.update(load_file(str(file)))
    _drop_tied_head(cfg, weights, str(directory))
    check_weights(cfg, weights)
    return cfg, weights


def write_hf_checkpoint(cfg: ModelConfig, weights: dict[str, np.ndarray], path: str | Path,
                        dtype: Optional[str] = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` loadable by ``LlamaForCausalLM.from_pretrained``.

    ``dtype`` (``float32``/``bfloat16``/``float16``) casts every tensor; None keeps each as given.
    """
    from safetensors.numpy import save_file

    check_weights(cfg, weights)
    if dtype is not None and dtype not in CHECKPOINT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; choose one of {tuple(CHECKPOINT_DTYPES)} or None.")
    tensors = {}
    for name in parameter_shapes(cfg):
        array = np.asarray(weights[name])
        if dtype is not None:
            array = array.astype(_np_dtype(dtype))
        tensors[name] = np.ascontiguousarray(array)
    stored = {str(a.dtype) for a in tensors.values()}
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config = _model_config_to_hf(cfg, stored.pop() if len(stored) == 1 else "float32")
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes  # ships with jax; numpy has no native bfloat16

        return ml_dtypes.bfloat16
    return np.dtype(name)
