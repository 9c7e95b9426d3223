"""Model folders on disk (Hugging Face layout) for the JAX backend, and its side of training checkpoints.

- ``load_pretrained`` / ``save_pretrained``: a local HF model folder (any family) in and out, through
  ``common.models.hf_folder`` (numpy + safetensors, no torch), bitwise in both directions.
- ``to_numpy_tree`` / ``from_numpy_tree``: an optax state as numpy arrays and back, for
  ``common.run.checkpoint`` (safetensors + JSON: nothing pickled).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from twinseq.common.backend import Model, PathLike
from twinseq.common.errors import CheckpointError
from twinseq.common.models.hf_folder import read_hf_checkpoint, write_hf_checkpoint
from twinseq.common.models.safetensors_stream import LazyArray
from twinseq.jax_backend.model import build_model, lazy_weights


def load_pretrained(
    path: PathLike, *, dtype: Optional[str] = None, attn_implementation: str = "sdpa", device: Any = None
) -> Model:
    """A JAX ``CausalLM`` (any family of ``common.models.configs``) from an HF checkpoint directory.

    ``dtype`` None uses the stored dtype when it is float32 or bfloat16 (else float32).
    """
    cfg, weights = read_hf_checkpoint(Path(path))
    stored = {str(np.asarray(w).dtype) for w in weights.values()}
    if dtype is None:
        dtype = stored.pop() if len(stored) == 1 and stored <= {"float32", "bfloat16"} else "float32"
    return build_model(cfg, weights, dtype=dtype, attn_implementation=attn_implementation, device=device)


def save_pretrained(model: Model, path: PathLike) -> Path:
    """Write a JAX ``CausalLM`` as an HF checkpoint, in the model's own dtype, streamed (one tensor in memory at a
    time); returns ``path``."""
    return write_hf_checkpoint(model.config, lazy_weights(model), Path(path), dtype=model.dtype)


def to_numpy_tree(tree: Any) -> list[np.ndarray]:
    """The leaves of a pytree (an optax state) as numpy arrays, in ``jax.tree`` order."""
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def lazy_numpy_tree(tree: Any) -> list[LazyArray]:
    """``to_numpy_tree``, streamed: each leaf produced (a zero-copy view on CPU) when the writer reaches it."""
    return [LazyArray(tuple(x.shape), str(x.dtype), functools.partial(np.asarray, x)) for x in jax.tree.leaves(tree)]


def from_numpy_tree(leaves: list[np.ndarray], like: Any) -> Any:
    """``leaves`` back into the structure of ``like``; raises ``ValueError`` on a count mismatch."""
    treedef: Any = jax.tree.structure(like)  # jaxlib ships no stubs for PyTreeDef: mypy cannot see num_leaves
    if treedef.num_leaves != len(leaves):
        raise CheckpointError(
            f"the checkpoint holds {len(leaves)} optimizer arrays but this optimizer has "
            f"{treedef.num_leaves}; resume with the same optimizer settings (max_grad_norm)."
        )
    expected = jax.tree.leaves(like)
    for i, (got, want) in enumerate(zip(leaves, expected)):
        if np.shape(got) != np.shape(want) or np.asarray(got).dtype != want.dtype:
            raise CheckpointError(
                f"optimizer array {i} has shape {np.shape(got)} and dtype {np.asarray(got).dtype}, but "
                f"this optimizer expects {np.shape(want)} {want.dtype}; the checkpoint is from another "
                f"model or optimizer configuration: resume with the settings it was written with."
            )
    return jax.tree.unflatten(treedef, [jax.numpy.asarray(x) for x in leaves])
