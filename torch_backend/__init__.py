"""The PyTorch backend: the protocol names of ``common.backend.PROTOCOL`` and a few more.

Imports are lazy (PEP 562): ``import twinseq.torch_backend`` does not import torch or
transformers until a name is used.

``train`` is both a protocol function and a submodule (``torch_backend/train.py``). Importing a
submodule makes Python set it as an attribute of the package, which would shadow the function
for ``load_backend("torch").train(cfg)``; ``_BackendModule`` keeps the function. Use
``from twinseq.torch_backend.train import ...`` for the module's other names.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    # backend protocol
    "build_model": "model",
    "export_weights": "model",
    "logits": "model",
    "loss_and_grads": "model",
    "train": "train",
    # model I/O and loss
    "load_pretrained": "model",
    "save_pretrained": "model",
    "compute_loss": "model",
    # attention
    "forward_hidden": "attention",
    "check_attention_supported": "attention",
    # memory
    "ActivationOffloader": "offload",
    "offload_activations": "offload",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'twinseq.torch_backend' has no attribute {name!r}")
    module = importlib.import_module(f"twinseq.torch_backend.{_EXPORTS[name]}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _BackendModule(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return  # the import system binding a submodule over a protocol function of the same name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _BackendModule
