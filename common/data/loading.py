"""Datasets from anywhere, offline first: what ``twinseq.common.data.prepare`` tokenises.

``load_dataset_any(name_or_path, split)``: the embedded datasets, local JSONL / JSON /
Parquet / CSV files, a folder saved with ``Dataset.save_to_disk``, or a Hub name (which
needs network; offline it fails at once with a message that says so). Every failure is a
``DataError`` naming the file, the line or the split, and the fix.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from twinseq.common.data import corpus
from twinseq.common.errors import DataError, DataTypeError, TwinseqError

logger = logging.getLogger(__name__)

FILE_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv"}
_PATH_LIKE_SUFFIXES = set(FILE_FORMATS) | {".txt", ".arrow", ".gz", ".zip", ".xlsx", ".md", ".yaml", ".yml"}
NETWORK_PROBE_TIMEOUT_S = 3.0


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def one_line_of(err: BaseException) -> str:
    """An exception's message on one line (the CLI prints errors as one line)."""
    return " ".join(str(err).split())


def _parse_split(split: str) -> tuple[str, Optional[str]]:
    """``"train[:100]"`` -> ``("train", ":100")``; ``"train"`` -> ``("train", None)``."""
    m = re.fullmatch(r"(\w+)(?:\[(-?\d*%?:-?\d*%?)\])?", split)
    if not m:
        raise DataError(
            f"dataset_split={split!r} is not valid; use a split name such as 'train', "
            f"optionally sliced: 'train[:1000]', 'train[100:200]', 'train[:10%]'."
        )
    return m.group(1), m.group(2)


def _apply_slice(ds, spec: Optional[str]):
    return ds if spec is None else ds.select(_slice_range(len(ds), spec))


def _slice_range(n: int, spec: str) -> range:
    """The rows ``[spec]`` of ``n`` rows selects (``":100"``, ``"10%:"``)."""

    def bound(text: str, default: int) -> int:
        if not text:
            return default
        return int(text[:-1]) * n // 100 if text.endswith("%") else int(text)

    start, stop = spec.split(":")
    return range(*slice(bound(start, 0), bound(stop, n)).indices(n))


def from_table(table):
    """A ``pyarrow.Table`` -> ``datasets.Dataset`` held in memory (no cache files written)."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    return Dataset(InMemoryTable(table))


def _load_file(path: Path):
    import pyarrow as pa

    fmt = FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(
            f"dataset file {str(path)!r} has the unsupported extension {path.suffix!r}; "
            f"supported: {', '.join(FILE_FORMATS)}. Convert it, e.g. to JSONL with one "
            f'{{"prompt", "completion"}} object per line.'
        )
    try:
        if fmt == "json":
            return as_dataset(_read_json_rows(path), source=str(path))
        if fmt == "jsonl":
            import pyarrow.json as pj

            longest = _check_jsonl_lines(path)
            # Arrow reads a JSONL file in blocks (1 MiB by default) and fails on a line longer than one block
            # ("straddling object straddles two block boundaries"): one long document is a normal dataset here
            block = max(1 << 20, longest + 1)
            return from_table(pj.read_json(path, read_options=pj.ReadOptions(block_size=block)))
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return from_table(pq.read_table(path))
        import pyarrow.csv as pc

        delimiter = "\t" if fmt == "tsv" else ","
        return from_table(pc.read_csv(path, parse_options=pc.ParseOptions(delimiter=delimiter)))
    except TwinseqError:
        raise
    except (pa.ArrowException, json.JSONDecodeError, TypeError, ValueError, UnicodeDecodeError) as err:
        raise DataError(
            f"could not read dataset file {str(path)!r} as {fmt}: {one_line_of(err)}; fix the file, or convert it "
            f"to JSONL (one object per line)."
        ) from None


def _read_json_rows(path: Path):
    """A ``.json`` file: a list of row objects, or an object of equal-length columns."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg}); fix that line, or write one "
            f"object per line as JSONL."
        ) from None
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        return data
    if isinstance(data, dict) and all(isinstance(col, list) for col in data.values()):
        return data
    kind = (
        type(data).__name__
        if not isinstance(data, list)
        else "list of " + ", ".join(sorted({type(row).__name__ for row in data}))
    )
    raise DataTypeError(
        f"{path}: the top level is a {kind}; a dataset file holds rows: a list of objects "
        f'([{{"prompt": ..., "completion": ...}}, ...]) or an object of columns; write it in one of those shapes.'
    )


def _check_jsonl_lines(path: Path) -> int:
    """Name the first line of a JSONL file that is not a JSON object (Arrow's reader names none); returns the
    longest line's length in bytes."""
    longest = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            longest = max(longest, len(line.encode("utf-8", errors="replace")))
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno}); fix that line "
                    f"(one JSON object per line)."
                ) from None
            if not isinstance(row, dict):
                raise DataTypeError(
                    f"{path}:{number}: the line holds a {type(row).__name__}, not an object; a JSONL "
                    f'dataset has one {{"field": value}} object per line: write that line as one.'
                )
    return longest


def _load_folder(path: Path, split: str):
    import datasets

    if any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(
                    f"dataset_split={split!r} is not in {str(path)!r}; choose one of {sorted(loaded)} "
                    f"(--dataset-split)."
                )
            return loaded[split]
        return loaded
    logger.info("%s is not a save_to_disk folder; reading its data files with datasets.load_dataset", path)
    return datasets.load_dataset(str(path), split=split)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _network_error(endpoint: str, timeout: float = NETWORK_PROBE_TIMEOUT_S) -> Optional[str]:
    """None if ``endpoint`` answers within ``timeout`` seconds, else the error as text."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return None  # the server answered; the network works
    except (urllib.error.URLError, OSError, ValueError) as err:
        return f"{type(err).__name__}: {getattr(err, 'reason', err)}"
    return None


def _load_hub(name: str, split: str):
    hint = (
        "Pass a local JSONL, JSON, Parquet or CSV file, a folder saved with Dataset.save_to_disk, "
        "or 'embedded' (the offline default)."
    )
    if _env_flag("HF_HUB_OFFLINE") or _env_flag("HF_DATASETS_OFFLINE"):
        import datasets

        if not datasets.config.HF_HUB_OFFLINE:  # the variable was set after datasets was imported
            raise DataError(
                f"dataset_name={name!r} is not a local file or folder and HF_HUB_OFFLINE is set, "
                f"so it cannot be fetched from the Hugging Face Hub. {hint}"
            )
        try:
            return datasets.load_dataset(name, split=split)
        except Exception as err:  # noqa: BLE001 - datasets raises many types; all mean "not cached"
            raise DataError(
                f"dataset_name={name!r} is not a local path and, with HF_HUB_OFFLINE set, not in "
                f"the local Hugging Face cache either ({type(err).__name__}: {err}). {hint}"
            ) from err
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    error = _network_error(endpoint)
    if error is not None:
        raise DataError(
            f"dataset_name={name!r} is not a local file or folder, so it was looked up on the "
            f"Hugging Face Hub, but {endpoint} cannot be reached (network problem: {error}). "
            f"{hint}"
        )
    import datasets

    return datasets.load_dataset(name, split=split)


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).suffix.lower() in _PATH_LIKE_SUFFIXES


def load_dataset_any(name_or_path: str, split: str = "train", *, field: str = "dataset_split"):
    """A ``datasets.Dataset`` from an embedded name, a local file or folder, or a Hub name.

    ``split`` may be sliced like in ``datasets``: ``"train[:1000]"``, ``"train[:10%]"``.
    A single file or an embedded dataset only has the split ``train``. ``field``: the config field that gave
    ``split``, for the messages (``eval_split`` for an eval set).
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise DataTypeError(
            f"dataset_name must be a string, got {type(name_or_path).__name__} ({name_or_path!r}); pass a file, "
            f"folder or dataset name."
        )
    name_or_path = str(name_or_path)
    if not name_or_path.strip():  # Path('') is '.', which would be read as a dataset folder
        raise DataError(
            f"dataset_name={name_or_path!r} is empty; give a data file, a dataset folder, a Hub dataset "
            f"name, or 'embedded' (the offline default data)."
        )
    split_name, spec = _parse_split(split)
    path = Path(name_or_path).expanduser()
    if name_or_path in corpus.EMBEDDED_NAMES or path.is_file():
        if split_name != "train":
            raise _single_split_error(name_or_path, split, field)
        ds = corpus.load_embedded(name_or_path) if name_or_path in corpus.EMBEDDED_NAMES else _load_file(path)
    elif path.is_dir():
        ds = _load_folder(path, split_name)
    elif _looks_like_path(name_or_path):
        raise DataError(
            f"dataset_name={name_or_path!r}: no such file or folder ({str(path.resolve())!r}); "
            f"check the path, or use 'embedded' for the offline default data."
        )
    else:
        ds = _load_hub(name_or_path, split_name)
    return _apply_slice(ds, spec)


def _single_split_error(name: str, split: str, field: str) -> DataError:
    return DataError(
        f"{field}={split!r}: {name!r} has a single split, 'train'; select a part of it with e.g. 'train[:90%]', or "
        f"hold out an eval set from the training rows with --eval-fraction 0.1."
    )


def select_split(rows: list, split: str, name: str, *, field: str = "dataset_split") -> list:
    """The rows of a single-split dataset held as a list (GRPO's embedded task) at ``split``: ``train`` or a slice of
    it, as ``load_dataset_any`` reads a file.

    >>> select_split(list(range(10)), "train[:20%]", "embedded")
    [0, 1]
    """
    split_name, spec = _parse_split(split)
    if split_name != "train":
        raise _single_split_error(name, split, field)
    return [rows[i] for i in _slice_range(len(rows), spec)] if spec else list(rows)


def held_out_indices(num_rows: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training row indices, eval row indices), each ascending: ``eval_fraction``'s split of ``num_rows`` rows.

    ``ceil(fraction x num_rows)`` rows (``datasets``' ``train_test_split`` count) are drawn for evaluation from a
    numpy generator seeded with ``seed``, so a run, its resume and its ``evaluate()`` hold out the same rows.

    >>> held_out_indices(10, 0.2, seed=0)
    ([1, 3, 4, 5, 6, 7, 8, 9], [0, 2])
    """
    import numpy as np

    num_eval = math.ceil(round(fraction * num_rows, 9))
    if not 0 < num_eval < num_rows:
        raise DataError(
            f"eval_fraction={fraction} of {num_rows} rows leaves {num_rows - num_eval} to train on and {num_eval} to "
            f"evaluate; both need at least one row: use more data or another eval_fraction."
        )
    order = np.random.default_rng([seed, _HELD_OUT_STREAM]).permutation(num_rows)
    return sorted(order[num_eval:].tolist()), sorted(order[:num_eval].tolist())


_HELD_OUT_STREAM = 0xE7A1
"""Mixed into the seed of ``held_out_indices``, so the held-out draw is not the first epoch's shuffle."""


def split_off_eval(ds: Any, fraction: Optional[float], seed: int, part: str) -> Any:
    """``part`` (``train`` or ``eval``) of ``eval_fraction``'s split of a ``datasets.Dataset`` or a list of rows;
    ``ds`` itself when ``fraction`` is None."""
    if fraction is None:
        return ds
    train, held_out = held_out_indices(len(ds), fraction, seed)
    idx = train if part == "train" else held_out
    if hasattr(ds, "select"):
        return ds.select(idx)
    return [ds[i] for i in idx]


def as_dataset(data: Any, source: str = "the data"):
    """A ``datasets.Dataset`` as is, a dict of columns, or a list of row dicts -> ``datasets.Dataset``."""
    import pyarrow as pa
    from datasets import Dataset

    if isinstance(data, Dataset):
        return data
    try:
        if isinstance(data, dict):
            return Dataset.from_dict(data)
        if isinstance(data, list):
            return Dataset.from_list(data)
    except (pa.ArrowException, ValueError, TypeError) as err:
        raise DataTypeError(
            f"{source} cannot be made into a table ({one_line_of(err)}); every value of a column must "
            f"have the same type (e.g. all prompts strings) and every column the same length: fix the rows that differ."
        ) from None
    raise DataTypeError(
        f"{source} has type {type(data).__name__}; pass a datasets.Dataset, a dict of lists or a list of dicts."
    )


def resolve_dataset(data: Any, field: str, split: str = "train"):
    """What a Python caller passed as ``field`` (``train_dataset``, ``eval_dataset``) -> ``datasets.Dataset``.

    A ``Dataset`` as is; an ``IterableDataset`` read once into memory (it must end; the log says how many rows);
    a list of row dicts or a dict of columns; a string: a file, folder or Hub name as ``dataset_name`` takes it. A
    ``DatasetDict`` is refused, naming its splits: pass one of them.
    """
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    if isinstance(data, (str, os.PathLike)):
        return load_dataset_any(str(data), split=split)
    if isinstance(data, (DatasetDict, IterableDatasetDict)):
        raise DataTypeError(
            f"{field} is a {type(data).__name__} with splits {sorted(data)}; pass one split, e.g. "
            f"{field}=dataset[{sorted(data)[0]!r}]."
        )
    if isinstance(data, IterableDataset):
        rows = list(data)
        logger.info("%s: an IterableDataset, read into memory (%d rows)", field, len(rows))
        data = rows
    if isinstance(data, Dataset):
        return data
    return as_dataset(data, source=field)


__all__ = [
    "load_dataset_any",
    "as_dataset",
    "resolve_dataset",
    "from_table",
    "one_line_of",
    "select_split",
    "held_out_indices",
    "split_off_eval",
    "FILE_FORMATS",
]
