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
from twinseq.common.errors import CheckpointError
from twinseq.common.init import check_weights, parameter_shapes

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def _hf_config_to_model_config(values: dict, source: str) -> ModelConfig:
    """ModelConfig from an HF ``config.json`` dict; raises on features this Llama does not have."""
    if values.get("model_type", "llama") != "llama":
        raise CheckpointError(f"{source}: model_type={values.get('model_type')!r} is not supported; only 'llama' "
                              f"checkpoints can be imported.")
    for flag in ("attention_bias", "mlp_bias"):
        if values.get(flag, False):
            raise CheckpointError(f"{source}: {flag}=True is not supported (twinseq's Llama has no biases); "
                                  f"use a checkpoint with {flag}=false.")
    if values.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={values['hidden_act']!r} is not supported; only 'silu' (SwiGLU).")
    rope = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{source}: rope_type={rope_type!r} is not supported; only the default (unscaled) RoPE.")
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


def read_json(path: Path) -> dict:
    """A JSON object from ``path``, or ``CheckpointError`` naming the file and the line of the fault."""
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}:{err.lineno}: not valid JSON ({err.msg}); the file is corrupt or truncated: "
                              f"restore it or save the model again.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read ({err}); check the file and its permissions.") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not a {type(values).__name__}.")
    return values


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object; the index is corrupt: save the model again.")
        return [directory / s for s in sorted(set(weight_map.values()))]
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"{str(directory)!r} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}; save the model with "
                          f"save_pretrained(..., safe_serialization=True).")


def _drop_tied_head(cfg: ModelConfig, weights: dict[str, np.ndarray], source: str) -> None:
    """A tied checkpoint may still store ``lm_head.weight``; accept it only as an exact copy."""
    if not cfg.tie_word_embeddings or "lm_head.weight" not in weights:
        return
    if not np.array_equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]):
        raise CheckpointError(f"{source}: tie_word_embeddings=True but lm_head.weight differs from "
                              f"model.embed_tokens.weight; set tie_word_embeddings=false in config.json.")
    logger.info("%s: dropping lm_head.weight, an exact copy of the tied model.embed_tokens.weight", source)
    del weights["lm_head.weight"]


def _safetensors_header(file: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file (name -> dtype, shape, data_offsets), read from its header
    alone, after checking that the file holds every byte the header promises (a truncated copy does not)."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < header_len <= size - 8:
                raise ValueError("no valid header")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is not a readable safetensors file ({err}); the file is corrupt, truncated "
                              f"or unreadable: save the model again.") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(f"{file} is truncated: its header describes {8 + header_len + end} bytes, the file has "
                              f"{size}; copy or save the model again.")
    return tensors


def inspect_model_folder(path: str | Path) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    """Check a Hugging Face model folder without loading its weights; (ModelConfig, shape by tensor name).

    Raises ``CheckpointError`` naming the file for a missing or corrupt ``config.json``, a missing,
    unreadable or truncated weight file, and any tensor missing, unexpected or of another shape than
    ``config.json`` implies. Both backends run it before they load a model folder.
    """
    directory = Path(path)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{str(directory)!r} has no {CONFIG_FILE}; pass a Hugging Face checkpoint directory "
                              f"(config.json + model.safetensors).")
    try:
        cfg = _hf_config_to_model_config(read_json(config_path), str(config_path))
    except (ValueError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{config_path}: {err}") from None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in _weight_files(directory):
        if not file.is_file():
            raise CheckpointError(f"{file} is listed in {INDEX_FILE} but missing; copy the whole model folder.")
        shapes.update({k: tuple(v["shape"]) for k, v in _safetensors_header(file).items()})
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    expected = parameter_shapes(cfg)
    problems = [f"missing {sorted(set(expected) - set(shapes))[:3]}" if set(expected) - set(shapes) else "",
                f"unexpected {sorted(set(shapes) - set(expected))[:3]}" if set(shapes) - set(expected) else ""]
    problems += [f"{k} is {shapes[k]}, config.json implies {v}" for k, v in expected.items()
                 if k in shapes and shapes[k] != v][:3]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(f"{directory}: the weights do not match {CONFIG_FILE}: {'; '.join(problems)}; the "
                              f"folder mixes files of two models, or config.json was edited.")
    return cfg, shapes


def check_finite(name: str, values, source: str) -> None:
    """``CheckpointError`` if the array ``values`` of tensor ``name`` holds NaN or Inf."""
    if not np.isfinite(np.asarray(values, dtype=np.float32)).all():
        raise CheckpointError(f"{source}: tensor {name} holds NaN or Inf values; the checkpoint is corrupt or came "
                              f"from a diverged run: use an earlier one.")


def read_hf_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read an HF Llama checkpoint directory -> (ModelConfig, HF-named numpy weights as stored).

    The folder is checked first (``inspect_model_folder``), then every tensor for NaN and Inf.
    """
    from safetensors.numpy import load_file

    directory = Path(path)
    cfg, _ = inspect_model_folder(directory)
    weights: dict[str, np.ndarray] = {}
    for file in _weight_files(directory):
        weights.update(load_file(str(file)))
    _drop_tied_head(cfg, weights, str(directory))
    check_weights(cfg, weights)
    for name, values in weights.items():
        check_finite(name, values, str(directory))
    return cfg, weights


def write_hf_checkpoint(cfg: ModelConfig, weights: dict[str, np.ndarray], path: str | Path,
                        dtype: Optional[str] = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` loadable by ``LlamaForCausalLM.from_pretrained``.

    ``dtype`` (``float32``/``bfloat16``/``float16``) casts every tensor; None keeps each as given.
    """
    from safetensors.numpy import save_file

    check_weights(cfg, weights)
    if dtype is not None and dtype not in CHECKPOINT_DTYPES:
        raise CheckpointError(f"dtype={dtype!r} is not valid; choose one of {tuple(CHECKPOINT_DTYPES)} or None.")
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
