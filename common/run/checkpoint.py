"""Resumable training checkpoints, backend-neutral: safetensors for arrays, JSON for the rest.

A trainer's ``state_dict()`` is a nested dict whose leaves are numpy arrays or JSON values
(numbers, strings, lists, None). ``save_training_checkpoint`` splits it: every array goes into
``training_state.safetensors`` under its path (``optimizer/state/0/exp_avg``), everything else
into ``trainer_state.json`` beside the step, the data position and the run config. Nothing is
pickled, so loading a checkpoint never runs code. An array leaf may be a ``LazyArray``
(``common.models.safetensors_stream``): the file is written one tensor at a time, so a save needs no
second copy of the model and optimizer state in memory.

A checkpoint is written into a hidden temporary folder and renamed to ``checkpoint-N`` only
when complete; ``trainer_state.json`` carries ``"complete": true`` and is written last. A kill
during a save leaves a temporary folder that no resume takes (and the next save removes).

>>> tree = {"step": 3, "optimizer": {"m": np.zeros(2, np.float32), "groups": [{"lr": 0.1}]}}
>>> arrays, skeleton = flatten_state(tree)
>>> sorted(arrays), skeleton["optimizer"]["m"]
(['optimizer/m'], {'__array__': 'optimizer/m'})
>>> flatten_state({"count": np.int32(7)})[0]["count"].shape  # scalars keep their shape
()
>>> unflatten_state(skeleton, arrays)["optimizer"]["groups"]
[{'lr': 0.1}]
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np

from twinseq.common.errors import CheckpointError
from twinseq.common.models.safetensors_stream import LazyArray, Tensor, write_safetensors

logger = logging.getLogger(__name__)

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
ARRAYS_FILE = "training_state.safetensors"
FORMAT_VERSION = 1
_ARRAY_KEY = "__array__"
_TMP_PREFIX = ".tmp-"


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"{PREFIX}{step}"


def flatten_state(tree: Any, prefix: str = "") -> tuple[dict[str, Tensor], Any]:
    """(arrays by path, a JSON skeleton with ``{"__array__": path}`` where each array was)."""
    if isinstance(tree, (np.ndarray, LazyArray)):
        return {prefix: tree}, {_ARRAY_KEY: prefix}  # as given: the writer streams it, nothing is copied here
    if isinstance(tree, np.generic):
        return {prefix: np.asarray(tree)}, {_ARRAY_KEY: prefix}  # a 0-d array keeps its shape ()
    skeleton: Any
    if isinstance(tree, dict):
        arrays, skeleton = {}, {}
        for key, value in tree.items():
            if not isinstance(key, str) or "/" in key:
                raise TypeError(f"state keys must be strings without '/', got {key!r} at {prefix or '<root>'}")
            sub_arrays, skeleton[key] = flatten_state(value, f"{prefix}/{key}" if prefix else key)
            arrays.update(sub_arrays)
        return arrays, skeleton
    if isinstance(tree, (list, tuple)):
        arrays, skeleton = {}, []
        for i, value in enumerate(tree):
            sub_arrays, sub = flatten_state(value, f"{prefix}/{i}" if prefix else str(i))
            arrays.update(sub_arrays)
            skeleton.append(sub)
        return arrays, skeleton
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {}, tree
    raise TypeError(
        f"state leaf at {prefix or '<root>'} is a {type(tree).__name__}; a trainer's state_dict may "
        f"hold numpy arrays and JSON values only."
    )


def unflatten_state(skeleton: Any, arrays: dict[str, np.ndarray]) -> Any:
    """The inverse of ``flatten_state``."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_ARRAY_KEY}:
            return arrays[skeleton[_ARRAY_KEY]]
        return {k: unflatten_state(v, arrays) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten_state(v, arrays) for v in skeleton]
    return skeleton


def save_training_checkpoint(
    output_dir: str | os.PathLike, step: int, state: dict[str, Any], meta: dict[str, Any], *, write: bool = True
) -> Optional[Path]:
    """Write ``checkpoint-<step>`` atomically; ``meta`` (JSON: data position, config) goes beside the state.

    The arrays are streamed (``safetensors_stream``): a ``LazyArray`` leaf is produced when its turn comes and
    dropped after, so a save holds one tensor beyond the live training state. ``write=False`` is a rank that
    does not write: it produces every ``LazyArray`` in the same order (each may be a collective, such as
    gathering one FSDP shard) and returns None.
    """
    arrays, skeleton = flatten_state(state)
    if not write:
        for value in arrays.values():
            if isinstance(value, LazyArray):
                value.produce()
        return None
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(f"{_TMP_PREFIX}{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_safetensors(tmp / ARRAYS_FILE, arrays)
    record = {"format_version": FORMAT_VERSION, "step": int(step), **meta, "state": skeleton, "complete": True}
    (tmp / STATE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def _fsync_dir(path: Path) -> None:
    for file in path.iterdir() if path.is_dir() else ():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint, checked to be complete and of a known format."""
    path = Path(path)
    state_file = path / STATE_FILE
    if not path.is_dir():
        raise CheckpointError(
            f"resume_from_checkpoint={str(path)!r} is not a directory; pass a 'checkpoint-N' "
            f"folder of a previous run, or 'latest'."
        )
    if not state_file.is_file():
        raise CheckpointError(
            f"resume_from_checkpoint={str(path)!r} holds no {STATE_FILE}; pass a 'checkpoint-N' "
            f"folder written by `twinseq train --save-steps N`, or 'latest'."
        )
    try:
        meta = json.loads(state_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{state_file} is corrupt ({err}); resume from another checkpoint.") from None
    if not isinstance(meta, dict) or meta.get("complete") is not True:
        raise CheckpointError(
            f"{state_file} is incomplete (the save was interrupted); resume from another checkpoint or 'latest'."
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{state_file} has format_version={meta.get('format_version')!r}; this twinseq "
            f"reads version {FORMAT_VERSION}. Resume with the twinseq version that wrote it."
        )
    return meta


def load_training_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, state) of a checkpoint written by ``save_training_checkpoint``."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    meta = read_meta(path)
    try:
        arrays = load_file(str(path / ARRAYS_FILE))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{path / ARRAYS_FILE} cannot be read ({err}); the checkpoint is corrupt or "
            f"truncated: resume from another checkpoint."
        ) from None
    try:
        state = unflatten_state(meta.pop("state"), arrays)
    except KeyError as err:
        raise CheckpointError(
            f"{path / ARRAYS_FILE} lacks the array {err}; the checkpoint is corrupt: resume from another checkpoint."
        ) from None
    return meta, state


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete ``checkpoint-N`` folders of ``output_dir``, oldest first (by N)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = re.fullmatch(rf"{PREFIX}(\d+)", child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def resolve_resume(value: Optional[str], output_dir: str | os.PathLike) -> Optional[Path]:
    """The checkpoint to resume from: None, an explicit folder, or the newest complete one for
    ``latest``/``auto`` (None when there is none yet, so a first run starts fresh)."""
    if value is None:
        return None
    if value in ("latest", "auto"):
        for path in reversed(list_checkpoints(output_dir)):
            try:
                read_meta(path)
                return path
            except CheckpointError as err:
                logger.warning("skipping %s: %s", path, err)
        logger.info("resume_from_checkpoint=%r: no checkpoint in %s yet; starting from step 0", value, output_dir)
        return None
    return Path(value)


def rotate_checkpoints(output_dir: str | os.PathLike, keep: Optional[int]) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (and leftovers of interrupted saves); returns the deleted."""
    output_dir = Path(output_dir)
    deleted = [p for p in output_dir.glob(f"{_TMP_PREFIX}{PREFIX}*") if p.is_dir()]
    if keep is not None:
        deleted += list_checkpoints(output_dir)[:-keep]
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted
