"""Model folders on disk (Hugging Face layout) and the torch side of training checkpoints.

- ``load_pretrained`` / ``save_pretrained``: a local HF folder (``config.json`` +
  ``model.safetensors``) of any family of ``common.models.configs`` in and out: transformers' own reader, and a
  streamed writer (one tensor in memory at a time) of the same files.
- ``to_numpy_tree`` / ``from_numpy_tree``: a state dict of tensors as numpy arrays and back, so
  that ``common.run.checkpoint`` writes it as safetensors + JSON (nothing pickled, nothing that runs
  code on load) and a resumed run continues bitwise (fp32 on CPU).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Mapping, Optional, cast

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config

from twinseq.common.backend import Model, PathLike
from twinseq.common.errors import CheckpointError
from twinseq.common.models.configs import parameter_shapes
from twinseq.common.models.hf_folder import WEIGHTS_FILE, inspect_model_folder
from twinseq.common.models.mxfp4 import quant_method
from twinseq.common.models.safetensors_stream import LazyArray, write_safetensors
from twinseq.torch_backend.attention import check_attention_supported, hf_attn_name, resolve_attn_implementation
from twinseq.torch_backend.distributed import lazy_tensor
from twinseq.torch_backend.model import _as_dtype, make_rope_stateless_, model_config_of
from twinseq.torch_backend.moe import select_experts_implementation

logger = logging.getLogger(__name__)


def load_pretrained(
    path: PathLike, *, dtype: Optional[str] = None, attn_implementation: str = "sdpa", device: Any = None
) -> Model:
    """Load a local HF checkpoint directory of any family twinseq builds (no download); train mode.

    The folder is checked first with numpy (``common.models.hf_folder.inspect_model_folder``: its
    ``config.json`` must describe a ``model_type`` of ``common.models.configs.MODEL_TYPES``, and every
    tensor must be there with its shape), then ``AutoModelForCausalLM`` loads it with
    transformers' own reader, safetensors only. ``dtype`` None keeps the stored dtype when it is
    float32 or bfloat16 (else float32).
    """
    path = Path(path)
    # config.json (an unsupported model_type is refused here, naming the supported ones), every file
    # and shape, before anything loads
    inspect_model_folder(path)
    device = torch.device("cpu" if device is None else device)
    check_attention_supported(attn_implementation, device=device, requires_grad=False)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    attn = hf_attn_name(resolve_attn_implementation(attn_implementation, config))
    # gpt-oss's MXFP4 experts load dequantized (exactly: common.models.mxfp4): MXFP4 has no backward to train
    quantized = quant_method(config.to_dict()) == "mxfp4"
    # safetensors only: a pickled pytorch_model.bin is never unpickled
    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        local_files_only=True,
        use_safetensors=True,
        dtype="auto" if dtype is None else _as_dtype(dtype),
        attn_implementation=attn,
        **({"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}),
    )
    if quantized:
        logger.info("%s: gpt-oss MXFP4 experts dequantized (exactly) to train in %s", path, model.dtype)
    if model.dtype not in (torch.float32, torch.bfloat16):
        model = model.float()
    model_config_of(model)  # the loaded config must read back as a ModelConfig (an invariant, checked again)
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            raise CheckpointError(
                f"{path}: tensor {name} holds NaN or Inf values; the checkpoint is corrupt or came "
                f"from a diverged run: use an earlier one."
            )
    model.config.use_cache = False
    make_rope_stateless_(model)
    model = model.to(device)
    select_experts_implementation(model, torch.device(device))  # MoE experts: twinseq's grouped kernel on CPU
    return model.train()


def adopt_model(model: Any, *, attn_implementation: str = "sdpa") -> Model:
    """A ``transformers`` model a Python caller built, made ready to train as ``load_pretrained`` makes a loaded
    one: a family twinseq trains (``model_config_of`` refuses another, naming them), finite weights, float32 master
    weights (a bfloat16 or float16 model is converted, and the log says so), twinseq's document-masked attention,
    no KV cache, stateless RoPE. The model is changed in place and returned."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise CheckpointError(
            f"model={type(model).__name__} is not a transformers model; pass a PreTrainedModel (e.g. "
            f"AutoModelForCausalLM.from_pretrained(...)), a model folder, a Hub id in the local cache, or a preset "
            f"name."
        )
    model_config_of(model)  # the family and its config, checked
    if model.dtype != torch.float32:
        logger.info("model: converting the %s weights to float32 master weights (compute dtype: --dtype)", model.dtype)
        model = model.float()
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            raise CheckpointError(
                f"model: tensor {name} holds NaN or Inf values; pass a model with finite weights (an earlier "
                f"checkpoint, or a fresh load)."
            )
    attn = hf_attn_name(resolve_attn_implementation(attn_implementation, model.config))
    model.set_attn_implementation(attn)
    model.config.use_cache = False
    make_rope_stateless_(model)
    return model


def save_pretrained(model: Model, path: PathLike) -> Path:
    """Write ``config.json`` (+ ``generation_config.json``) + ``model.safetensors`` (HF layout) to ``path``, streamed
    (``save_model_folder``); returns ``path``."""
    return save_model_folder(model, path)


def save_model_folder(model: Model, path: PathLike, weights: Optional[Mapping[str, LazyArray]] = None) -> Path:
    """Write ``config.json`` (+ ``generation_config.json``) + ``model.safetensors`` (HF layout) to ``path``.

    The weights are streamed (``common.models.safetensors_stream``), one tensor in memory at a time, where
    transformers' own writer builds the whole file's bytes first: a second copy of the model. ``weights`` are the
    tensors to write by HF name (FSDP: each gathered when its turn comes); None: the model's own parameters, in
    their dtype, as zero-copy views. The config is transformers' own, with the dtype and architecture set as its
    ``save_pretrained`` sets them. Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if weights is None:
        params = dict(model.named_parameters(remove_duplicate=False))
        weights = {name: lazy_tensor(params[name]) for name in parameter_shapes(model_config_of(model))}
    dtypes = {w.dtype for w in weights.values()}
    model.config.dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    model.config.save_pretrained(str(path))
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(path))
    write_safetensors(path / WEIGHTS_FILE, weights, metadata={"format": "pt"})
    return path


def to_numpy_tree(tree: Any) -> Any:
    """Tensors -> numpy (bfloat16 through float32, exact), tuples -> lists, int dict keys -> strings."""
    if isinstance(tree, torch.Tensor):
        t = tree.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
    if isinstance(tree, dict):
        return {str(k): to_numpy_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [to_numpy_tree(v) for v in tree]
    return tree


def from_numpy_tree(tree: Any) -> Any:
    """numpy arrays -> CPU tensors (the inverse of ``to_numpy_tree`` but for keys and tuples)."""
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.array(tree))
    if isinstance(tree, dict):
        return {k: from_numpy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [from_numpy_tree(v) for v in tree]
    return tree


def rng_state() -> dict[str, Any]:
    """Every RNG a torch run draws from, as numpy/JSON (Python's, numpy's legacy one, torch CPU/CUDA)."""
    version, internal, gauss = random.getstate()
    # legacy=True (the default) gives the MT19937 tuple; numpy's stubs pick the dict overload for a bare call
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state = {
        "python": {"version": version, "internal": np.asarray(internal, np.uint64), "gauss": gauss},
        "numpy": {
            "keys": legacy[1],
            "pos": int(legacy[2]),
            "has_gauss": int(legacy[3]),
            "cached_gaussian": float(legacy[4]),
        },
        "torch": torch.get_rng_state().numpy().copy(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.numpy().copy() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", npy["keys"], npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(torch.from_numpy(np.array(state["torch"])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(np.array(s)) for s in state["cuda"]])
