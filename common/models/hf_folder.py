"""Hugging Face model folders as numpy, without any framework: ``config.json`` + safetensors.

A model folder holds ``config.json`` and ``model.safetensors`` (or shards listed by
``model.safetensors.index.json``), as ``save_pretrained`` of transformers writes it. Tensors
are read and written with ``safetensors.numpy``, never converted on the way through (float32
stays float32, bfloat16 stays bfloat16), so torch -> jax -> torch is bitwise exact. The JAX
backend loads and saves models through this module; both backends check folders with it.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np

from twinseq.common.errors import CheckpointError, ConfigError, ConfigTypeError
from twinseq.common.models.configs import (
    MODEL_PRESETS,
    ModelConfig,
    from_hf_config,
    parameter_shapes,
    resolve_model_config,
    to_hf_config,
)
from twinseq.common.models.init import check_weights
from twinseq.common.models.mxfp4 import MXFP4_TENSORS, quant_method, unpack_mxfp4_experts_, unpack_mxfp4_shapes_
from twinseq.common.models.safetensors_stream import LazyArray, Tensor, as_lazy, write_safetensors

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def read_model_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a model folder's ``config.json`` (weights not needed), or ``CheckpointError``
    naming the file: missing, corrupt, or an architecture twinseq does not build (the error names the
    ``model_type`` and the supported list)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(
            f"{str(Path(path))!r} has no {CONFIG_FILE}; pass a Hugging Face checkpoint directory "
            f"(config.json + model.safetensors), or a folder with a hand-written config.json to "
            f"train from random weights."
        )
    try:
        return from_hf_config(read_json(config_path), str(config_path))
    except (ConfigError, ConfigTypeError) as err:  # ModelConfig's own refusal (field, value, fix), with the path
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(str(err) if str(err).startswith(str(config_path)) else f"{config_path}: {err}") from None


def has_weights(path: str | Path) -> bool:
    """Whether a model folder holds weights (``model.safetensors`` or a safetensors index)."""
    return (Path(path) / WEIGHTS_FILE).is_file() or (Path(path) / INDEX_FILE).is_file()


def read_json(path: Path) -> dict:
    """A JSON object from ``path``, or ``CheckpointError`` naming the file and the line of the fault."""
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{path}:{err.lineno}: not valid JSON ({err.msg}); the file is corrupt or truncated: "
            f"restore it or save the model again."
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read ({err}); check the file and its permissions.") from None
    if not isinstance(values, dict):
        raise CheckpointError(
            f"{path} must hold a JSON object, not a {type(values).__name__}; restore the file from the model's "
            f"repository."
        )
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
    raise CheckpointError(
        f"{str(directory)!r} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}; save the model with "
        f"save_pretrained(..., safe_serialization=True)."
    )


def _drop_tied_head(cfg: ModelConfig, weights: dict[str, np.ndarray], source: str) -> None:
    """A tied checkpoint may still store ``lm_head.weight``; accept it only as an exact copy."""
    if not cfg.tie_word_embeddings or "lm_head.weight" not in weights:
        return
    if not np.array_equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]):
        raise CheckpointError(
            f"{source}: tie_word_embeddings=True but lm_head.weight differs from "
            f"model.embed_tokens.weight; set tie_word_embeddings=false in config.json."
        )
    logger.info("%s: dropping lm_head.weight, an exact copy of the tied model.embed_tokens.weight", source)
    del weights["lm_head.weight"]


def check_quantization(hf_config: dict, directory: Path) -> None:
    """A ``config.json`` with a ``quantization_config`` is refused unless it is gpt-oss's MXFP4 (loaded
    dequantized, ``common.models.mxfp4``): the other formats' packed tensors are not weights twinseq can train."""
    method = quant_method(hf_config)
    if method not in (None, "mxfp4"):
        raise CheckpointError(
            f"{directory / CONFIG_FILE}: quantization_config quant_method={method!r}; twinseq loads float "
            "checkpoints (and gpt-oss's MXFP4 experts, dequantized): use the float (unquantized) release of this "
            "model, and --load-in-4bit for a 4-bit QLoRA base"
        )


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
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({err}); the file is corrupt, truncated "
            f"or unreadable: save the model again."
        ) from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(
            f"{file} is truncated: its header describes {8 + header_len + end} bytes, the file has "
            f"{size}; copy or save the model again."
        )
    return tensors


def inspect_model_folder(path: str | Path) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    """Check a Hugging Face model folder without loading its weights; (ModelConfig, shape by tensor name).

    Raises ``CheckpointError`` naming the file for a missing or corrupt ``config.json``, a missing,
    unreadable or truncated weight file, and any tensor missing, unexpected or of another shape than
    ``config.json`` implies. Both backends run it before they load a model folder.
    """
    directory = Path(path)
    cfg = read_model_config(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in _weight_files(directory):
        if not file.is_file():
            raise CheckpointError(f"{file} is listed in {INDEX_FILE} but missing; copy the whole model folder.")
        shapes.update({k: tuple(v["shape"]) for k, v in _safetensors_header(file).items()})
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    check_quantization(read_json(directory / CONFIG_FILE), directory)
    unpack_mxfp4_shapes_(shapes)
    fuse_experts_(cfg, shapes, lambda parts, axis: _stacked_shape(parts, axis))
    expected = parameter_shapes(cfg)
    problems = [
        f"missing {sorted(set(expected) - set(shapes))[:3]}" if set(expected) - set(shapes) else "",
        f"unexpected {sorted(set(shapes) - set(expected))[:3]}" if set(shapes) - set(expected) else "",
    ]
    problems += [
        f"{k} is {shapes[k]}, config.json implies {v}" for k, v in expected.items() if k in shapes and shapes[k] != v
    ][:3]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(
            f"{directory}: the weights do not match {CONFIG_FILE}: {'; '.join(problems)}; the "
            f"folder mixes files of two models, or config.json was edited: copy the model folder again, or restore its "
            f"config.json."
        )
    return cfg, shapes


@dataclass(frozen=True)
class ModelSource:
    """What ``model_config`` names: an architecture, and the folder its weights come from (None: twinseq
    draws them with ``common.models.init.init_weights``, the same model on both backends)."""

    config: ModelConfig
    weights_folder: Optional[Path]
    description: str


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face Hub model id (``org/name``), as ``model_config`` / ``model_name_or_path`` may give one."""


def hub_cache_folder(repo_id: str) -> Path:
    """The snapshot folder of ``repo_id`` in the local Hugging Face cache (``HF_HUB_CACHE``/``HF_HOME``), offline:
    twinseq never downloads a model. A model that is not there is refused, naming the cache and the fix."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise CheckpointError(
            f"model_config={repo_id!r} is not a preset or a local folder, and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it where there is network (`hf download {repo_id}`), or pass the "
            f"model's folder."
        ) from None
    logger.info("model %s: the local Hugging Face cache's snapshot %s", repo_id, folder)
    return folder


def resolve_model_source(spec: str, init_weights: str = "pretrained") -> ModelSource:
    """The model a run trains, from ``--model-config`` and ``--init-weights``: a preset name (random initial
    weights), a Hugging Face checkpoint folder (``config.json`` + safetensors, checked by ``inspect_model_folder``),
    or, with ``init_weights="random"``, a folder's architecture from random initial weights (its weights, if any,
    unread). A folder with a ``config.json`` and no weights is refused unless random weights are asked for: a
    forgotten ``model.safetensors`` must not train a random model silently.

    >>> resolve_model_source("tiny-qwen3").description
    "preset 'tiny-qwen3' (qwen3, 1.79M parameters), random initial weights"
    """
    if init_weights not in ("pretrained", "random"):
        raise ConfigError(
            f"init_weights={init_weights!r} is not valid; choose 'pretrained' (the folder's weights) or "
            f"'random' (weights drawn from the seed)."
        )
    path = Path(spec)
    if spec not in MODEL_PRESETS and path.is_dir():
        if init_weights == "pretrained":
            if not has_weights(path):
                read_model_config(path)  # a missing or broken config.json is named first
                raise CheckpointError(
                    f"model_config={spec!r} has a {CONFIG_FILE} but no weights: neither {WEIGHTS_FILE} nor "
                    f"{INDEX_FILE} is there. Copy the checkpoint's safetensors files into it, or pass "
                    f"--init-weights random to train this architecture from random initial weights."
                )
            cfg = inspect_model_folder(path)[0]
            return ModelSource(cfg, path, f"{spec} ({cfg.model_type}, {cfg.num_parameters() / 1e6:.2f}M parameters)")
        cfg = read_model_config(path)
        logger.info(
            "init_weights='random': training %s's architecture (%s) from random initial weights%s",
            spec,
            cfg.model_type,
            "; its weights are not read" if has_weights(path) else "",
        )
        return ModelSource(
            cfg,
            None,
            f"{spec} ({cfg.model_type}, {cfg.num_parameters() / 1e6:.2f}M parameters), "
            f"random initial weights (--init-weights random)",
        )
    if spec not in MODEL_PRESETS and not path.exists() and HUB_ID.fullmatch(spec):
        return resolve_model_source(str(hub_cache_folder(spec)), init_weights)
    cfg = resolve_model_config(spec)
    return ModelSource(
        cfg,
        None,
        f"preset {spec!r} ({cfg.model_type}, {cfg.num_parameters() / 1e6:.2f}M parameters), random initial weights",
    )


def check_tokenizer_fits(cfg: ModelConfig, tokenizer_vocab_size: int, spec: str) -> None:
    """``ConfigError`` when the tokenizer can produce ids the model has no embedding for."""
    if cfg.vocab_size < tokenizer_vocab_size:
        raise ConfigError(
            f"model_config={spec!r} has vocab_size={cfg.vocab_size} but the tokenizer has "
            f"{tokenizer_vocab_size} tokens; use the model's own tokenizer (--tokenizer-name-or-path) "
            f"or one of at most {cfg.vocab_size} tokens."
        )


def check_finite(name: str, values, source: str) -> None:
    """``CheckpointError`` if the array ``values`` of tensor ``name`` holds NaN or Inf."""
    if not np.isfinite(np.asarray(values, dtype=np.float32)).all():
        raise CheckpointError(
            f"{source}: tensor {name} holds NaN or Inf values; the checkpoint is corrupt or came "
            f"from a diverged run: use an earlier one."
        )


def read_hf_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a Hugging Face checkpoint directory -> (ModelConfig, HF-named numpy weights as stored).

    The folder is checked first (``inspect_model_folder``), then every tensor for NaN and Inf.
    """
    from safetensors.numpy import load_file

    directory = Path(path)
    cfg, _ = inspect_model_folder(directory)
    weights: dict[str, np.ndarray] = {}
    for file in _weight_files(directory):
        weights.update(load_file(str(file)))
    if unpack_mxfp4_experts_(weights):
        # float32 holds the MXFP4 numbers exactly, and so does the checkpoint's own float dtype (bfloat16: the same
        # exponent range, FP4 has 2 significant bits): the experts take it, so the model keeps one dtype
        stored = {str(w.dtype) for k, w in weights.items() if k.rsplit(".", 1)[-1] not in MXFP4_TENSORS}
        if len(stored) == 1:
            dtype = _np_dtype(stored.pop())
            for name in [k for k in weights if k.rsplit(".", 1)[-1] in MXFP4_TENSORS]:
                weights[name] = weights[name].astype(dtype)
        logger.info("%s: gpt-oss MXFP4 experts dequantized (exactly) to train in float", directory)
    fuse_experts_(cfg, weights, lambda parts, axis: np.stack([np.concatenate(p, axis=0) for p in parts], axis=axis))
    _drop_tied_head(cfg, weights, str(directory))
    check_weights(cfg, weights)
    for name, values in weights.items():
        check_finite(name, values, str(directory))
    return cfg, weights


_HUB_EXPERTS = {
    "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
}
"""Per MoE family, how transformers' ``save_pretrained`` writes a sparse layer (its ``conversion_mapping`` reversed):
the block's name in the file, and the names of each expert's gate, up and down weights."""


def fuse_experts_(cfg: ModelConfig, tensors: dict[str, Any], stack: Callable[[list[list[Any]], int], Any]) -> None:
    """Hub-format MoE experts, what transformers' ``save_pretrained`` writes (``_HUB_EXPERTS``: Qwen3-MoE's
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``
    and ``block_sparse_moe.gate.weight``), to transformers 5's fused in-memory tensors (``parameter_shapes``), in
    place: ``mlp.experts.gate_up_proj[e] = concat(gate[e], up[e])`` ``[E, 2m, h]`` and ``mlp.experts.down_proj``
    ``[E, h, m]``, as transformers' checkpoint conversion stacks them; Mixtral's router becomes ``mlp.gate.weight``.
    ``stack(parts, 0)`` stacks per expert the concatenation of ``parts[e]``; tensors already fused are left alone.

    >>> cfg = ModelConfig.preset("tiny-qwen3-moe", num_hidden_layers=1)
    >>> t = {f"model.layers.0.mlp.experts.{e}.{n}_proj.weight": np.zeros((64, 96) if n != "down" else (96, 64))
    ...      for e in range(4) for n in ("gate", "up", "down")}
    >>> fuse_experts_(cfg, t, lambda parts, axis: np.stack([np.concatenate(p) for p in parts], axis))
    >>> sorted((k, v.shape) for k, v in t.items())
    [('model.layers.0.mlp.experts.down_proj', (4, 96, 64)), ('model.layers.0.mlp.experts.gate_up_proj', (4, 128, 96))]
    """
    if cfg.model_type not in _HUB_EXPERTS:
        return
    block, (gate, up, down) = _HUB_EXPERTS[cfg.model_type]
    for layer in range(cfg.num_hidden_layers):
        hub, fused = f"model.layers.{layer}.{block}", f"model.layers.{layer}.mlp."
        if not cfg.layer_is_moe(layer):
            continue
        if hub != fused and hub + "gate.weight" in tensors:
            tensors[fused + "gate.weight"] = tensors.pop(hub + "gate.weight")
        names = [[f"{hub}experts.{e}.{n}.weight" for n in (gate, up)] for e in range(cfg.num_experts)]
        downs = [[f"{hub}experts.{e}.{down}.weight"] for e in range(cfg.num_experts)]
        if any(n not in tensors for pair in names + downs for n in pair):
            continue  # already fused, or inspect_model_folder names what is missing
        tensors[fused + "experts.gate_up_proj"] = stack([[tensors.pop(n) for n in pair] for pair in names], 0)
        tensors[fused + "experts.down_proj"] = stack([[tensors.pop(n) for n in pair] for pair in downs], 0)


def _stacked_shape(parts: list[list[tuple[int, ...]]], axis: int) -> tuple[int, ...]:
    """The shape ``fuse_experts_`` gives to per-expert tensors of these shapes (headers only, no data)."""
    first = parts[0]
    return (len(parts), sum(shape[0] for shape in first), *first[0][1:])


def write_hf_checkpoint(
    cfg: ModelConfig, weights: Mapping[str, Tensor], path: str | Path, dtype: Optional[str] = None
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` loadable by ``AutoModelForCausalLM.from_pretrained``.

    ``weights`` are numpy arrays or ``LazyArray``s (``safetensors_stream``): the file is streamed, one tensor
    in memory at a time, each cast on its own. ``dtype`` (``float32``/``bfloat16``/``float16``) casts every
    tensor; None keeps each as given.
    """
    check_weights(cfg, weights)
    if dtype is not None and dtype not in CHECKPOINT_DTYPES:
        raise CheckpointError(f"dtype={dtype!r} is not valid; choose one of {tuple(CHECKPOINT_DTYPES)} or None.")
    tensors = {name: _cast(as_lazy(weights[name]), dtype) for name in parameter_shapes(cfg)}
    stored = {t.dtype for t in tensors.values()}
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    config = to_hf_config(cfg, stored.pop() if len(stored) == 1 else "float32")
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def _cast(tensor: LazyArray, dtype: Optional[str]) -> LazyArray:
    if dtype is None or dtype == tensor.dtype:
        return tensor
    return LazyArray(tensor.shape, dtype, lambda: tensor.values().astype(_np_dtype(dtype)))


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes  # ships with jax; numpy has no native bfloat16

        return ml_dtypes.bfloat16
    return np.dtype(name)
