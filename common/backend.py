"""Backend selection: one flag, one lazy import, no global state beyond the choice."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from twinseq.common.config import BACKENDS

_EXTRA_FOR = {"torch": ("torch", "transformers"), "jax": ("jax", "flax", "optax")}
PROTOCOL = ("build_model", "export_weights", "logits", "loss_and_grads", "train")


def default_backend() -> str:
    return os.environ.get("TWINSEQ_BACKEND", "torch")


def require(backend: str) -> None:
    """Raise ``ImportError`` naming the extra to install when a backend's framework is missing."""
    for module in _EXTRA_FOR[backend]:
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"the {backend} backend needs the '{module}' package; install it with "
                              f"`pip install -e '.[{backend}]'` (or '.[all]').")


def load_backend(name: str | None = None) -> ModuleType:
    """Return the backend module (``twinseq.torch_backend`` or ``twinseq.jax_backend``).

    Both expose the same public names: ``build_model``, ``export_weights``, ``logits``,
    ``loss_and_grads`` and ``train``.
    """
    name = name or default_backend()
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not valid; choose one of {BACKENDS} "
                         f"(flag --backend or env TWINSEQ_BACKEND).")
    require(name)
    return importlib.import_module(f"twinseq.{name}_backend")
