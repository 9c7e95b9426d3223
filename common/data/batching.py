"""Collation: examples -> ``Batch``, the one data contract both backends consume.

A ``Batch`` holds numpy arrays only. Padded and padding-free batches are the same thing
with a different B, T and masks; both give the same per-document loss.

Conventions (docs/architecture.md, "The batch contract"):

- ``labels`` are aligned with ``input_ids`` (not shifted); -100 means "no loss".
- The label of the first token of every document is -100, so a document's first token is
  never the target of the previous document's last token, and ``num_items_in_batch``
  counts exactly the targets the shifted loss uses.
- ``position_ids`` restart at 0 per document; ``segment_ids`` number the documents of a
  row 1..k, and padding is segment 0, position 0, label -100, token ``pad_token_id``.
- ``cu_seqlens`` are the cumulative document lengths in flattened (row-major) order,
  padding excluded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from twinseq.common.errors import DataError, DataTypeError
from twinseq.common.objectives.nll import IGNORE_INDEX


@dataclass
class Batch:
    input_ids: np.ndarray  # int32 [B, T]
    labels: np.ndarray  # int32 [B, T]
    position_ids: np.ndarray  # int32 [B, T]
    segment_ids: np.ndarray  # int32 [B, T]
    cu_seqlens: np.ndarray  # int32 [num_docs + 1]
    num_items_in_batch: int
    parent_ids: Optional[np.ndarray] = None
    """int32 [B, T] or None: the segment each token may attend to besides its own (a shared prompt), 0 = none;
    built by ``common.data.prefix_sharing.collate_shared``."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens."""
        return int((self.segment_ids != 0).sum())

    @property
    def num_label_tokens(self) -> int:
        """Targets in this micro-batch alone (``num_items_in_batch`` may cover a whole step)."""
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max()) if len(self.cu_seqlens) > 1 else 0

    @property
    def is_padding_free(self) -> bool:
        return self.input_ids.shape[0] == 1 and int(self.segment_ids.max(initial=0)) > 1

    def with_num_items(self, num_items_in_batch: int) -> "Batch":
        """The same batch, normalised over a larger step (accumulation, ranks)."""
        return dataclasses.replace(self, num_items_in_batch=int(num_items_in_batch))

    def attention_allowed(self) -> np.ndarray:
        """bool [B, T, T]: the reference document-causal mask of the contract.

        ``allowed[b, i, j]`` iff ``segment_ids[b, i] == segment_ids[b, j] != 0`` (or, with ``parent_ids``,
        ``segment_ids[b, j] == parent_ids[b, i] != 0``) and ``position_ids[b, j] <= position_ids[b, i]``.
        O(T^2): for tests and small T only.
        """
        seg, pos = self.segment_ids, self.position_ids
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
        if self.parent_ids is not None:
            same |= (self.parent_ids[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
        return same & (pos[:, None, :] <= pos[:, :, None])

    @property
    def shares_prefix(self) -> bool:
        """True when some token attends to a parent segment (a shared prompt)."""
        return self.parent_ids is not None and bool((self.parent_ids != 0).any())


def _as_int_list(value: Any, field: str, index: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise DataError(
            f"example {index}: field {field!r} must be a flat list of integers, got an array "
            f"of shape {arr.shape}; flatten it or fix the tokenisation step."
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.bool_):
            return arr.astype(np.int64)
        raise DataError(
            f"example {index}: field {field!r} must hold integers, got dtype {arr.dtype} "
            f"(first value {arr.flat[0]!r}); tokenise the text before collating."
        )
    return arr.astype(np.int64, copy=False)


def _example_labels(
    ex: Mapping[str, Any], ids: np.ndarray, index: int, completion_only_loss: Optional[bool], assistant_only_loss: bool
) -> np.ndarray:
    labels = _as_int_list(ex["labels"], "labels", index).copy() if "labels" in ex else ids.copy()
    if len(labels) != len(ids):
        raise DataError(
            f"example {index}: 'labels' has length {len(labels)} but 'input_ids' has "
            f"{len(ids)}; give labels aligned with input_ids (unshifted, the same length), or leave them out."
        )
    use_completion = completion_only_loss if completion_only_loss is not None else "completion_mask" in ex
    if use_completion:
        if "completion_mask" not in ex:
            raise DataError(
                f"example {index}: completion_only_loss=True needs a 'completion_mask' field; "
                f"tokenise prompt/completion data, or set completion_only_loss=False."
            )
        mask = _as_int_list(ex["completion_mask"], "completion_mask", index)
        if len(mask) != len(ids):
            raise DataError(
                f"example {index}: 'completion_mask' has length {len(mask)} but 'input_ids' "
                f"has {len(ids)}; give one mask value per token (re-tokenise the example)."
            )
        labels[mask == 0] = IGNORE_INDEX
    if assistant_only_loss:
        if "assistant_masks" not in ex:
            raise DataError(
                f"example {index}: assistant_only_loss=True needs an 'assistant_masks' field; "
                f"tokenise conversational 'messages' data with a chat template."
            )
        mask = _as_int_list(ex["assistant_masks"], "assistant_masks", index)
        if len(mask) != len(ids):
            raise DataError(
                f"example {index}: 'assistant_masks' has length {len(mask)} but 'input_ids' "
                f"has {len(ids)}; give one mask value per token (re-tokenise the example)."
            )
        labels[mask == 0] = IGNORE_INDEX
    return labels


def _doc_lengths(ex: Mapping[str, Any], n: int, index: int) -> np.ndarray:
    if "seq_lengths" not in ex:
        return np.array([n] if n else [], dtype=np.int64)
    lengths = _as_int_list(ex["seq_lengths"], "seq_lengths", index)
    if (lengths < 0).any() or int(lengths.sum()) != n:
        raise DataError(
            f"example {index}: 'seq_lengths' {lengths.tolist()[:8]} must be non-negative and sum "
            f"to len(input_ids)={n}; run pack_dataset again instead of editing packed rows."
        )
    return lengths[lengths > 0]


def _round_up(n: int, multiple: Optional[int]) -> int:
    if not multiple:
        return n
    return -(-n // multiple) * multiple


def collate(
    examples: Sequence[Mapping[str, Any]],
    *,
    padding_free: bool = False,
    pad_token_id: int = 0,
    padding_side: str = "right",
    pad_to_multiple_of: Optional[int] = None,
    completion_only_loss: Optional[bool] = None,
    assistant_only_loss: bool = False,
    num_items_in_batch: Optional[int] = None,
) -> Batch:
    """Build a ``Batch`` from tokenised examples.

    Each example has ``input_ids`` and optionally ``labels``, ``completion_mask``,
    ``assistant_masks`` and ``seq_lengths`` (a packed row of several documents).

    - padded (``padding_free=False``): one row per example, padded to the longest (rounded
      up to ``pad_to_multiple_of``) on ``padding_side``.
    - padding-free: every document in one row ``[1, total]``, rounded up to
      ``pad_to_multiple_of`` (e.g. ``2 * cp`` for context parallelism).

    >>> b = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}], padding_free=True)
    >>> b.input_ids.tolist(), b.labels.tolist()
    ([[5, 6, 7, 8, 9]], [[-100, 6, 7, -100, 9]])
    >>> b.position_ids.tolist(), b.segment_ids.tolist(), b.cu_seqlens.tolist()
    ([[0, 1, 2, 0, 1]], [[1, 1, 1, 2, 2]], [0, 3, 5])
    """
    if isinstance(examples, Mapping) or not len(examples):
        raise DataError(
            "collate() needs a non-empty list of examples (dicts with 'input_ids'); "
            f"got {type(examples).__name__} of length {len(examples) if hasattr(examples, '__len__') else '?'}; "
            "pass a list such as [{'input_ids': [5, 6, 7]}]."
        )
    if padding_side not in ("right", "left"):
        raise DataError(f"padding_side={padding_side!r} is not valid; choose 'right' or 'left'.")
    if pad_to_multiple_of is not None and pad_to_multiple_of <= 0:
        raise DataError(
            f"pad_to_multiple_of={pad_to_multiple_of!r} is not valid; pass a positive integer, or None for no padding."
        )

    ids_rows, label_rows, doc_rows = [], [], []
    for i, ex in enumerate(examples):
        if "input_ids" not in ex:
            raise DataError(
                f"example {i} has no 'input_ids' field (fields: {sorted(ex)}); tokenise the "
                f"dataset first, e.g. with twinseq.common.data.prepare.tokenize_sft."
            )
        ids = _as_int_list(ex["input_ids"], "input_ids", i)
        ids_rows.append(ids)
        label_rows.append(_example_labels(ex, ids, i, completion_only_loss, assistant_only_loss))
        doc_rows.append(_doc_lengths(ex, len(ids), i))

    if padding_free:
        ids_rows = [np.concatenate(ids_rows)]
        label_rows = [np.concatenate(label_rows)]
        doc_rows = [np.concatenate(doc_rows)]
        if padding_side == "left":
            raise DataError("padding_side='left' has no meaning with padding_free=True; use 'right'.")

    num_rows = len(ids_rows)
    width = _round_up(max(len(r) for r in ids_rows), pad_to_multiple_of)
    input_ids = np.full((num_rows, width), pad_token_id, dtype=np.int32)
    labels = np.full((num_rows, width), IGNORE_INDEX, dtype=np.int32)
    position_ids = np.zeros((num_rows, width), dtype=np.int32)
    segment_ids = np.zeros((num_rows, width), dtype=np.int32)
    for r, (ids, lab, docs) in enumerate(zip(ids_rows, label_rows, doc_rows)):
        n = len(ids)
        start = width - n if padding_side == "left" else 0
        sl = slice(start, start + n)
        doc_starts = np.cumsum(docs) - docs
        pos = np.arange(n) - np.repeat(doc_starts, docs)
        lab = lab.copy()
        lab[doc_starts] = IGNORE_INDEX
        input_ids[r, sl] = ids
        labels[r, sl] = lab
        position_ids[r, sl] = pos
        segment_ids[r, sl] = np.repeat(np.arange(1, len(docs) + 1), docs)
    all_docs = np.concatenate(doc_rows)
    cu_seqlens = np.concatenate([[0], np.cumsum(all_docs)]).astype(np.int32)
    local_items = int((labels != IGNORE_INDEX).sum())
    return Batch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        segment_ids=segment_ids,
        cu_seqlens=cu_seqlens,
        num_items_in_batch=local_items if num_items_in_batch is None else int(num_items_in_batch),
    )


def check_batch(batch: Any, vocab_size: int) -> None:
    """Raise unless ``batch`` is a ``Batch`` whose token ids and labels fit a vocabulary of ``vocab_size``:
    the one check both backends run before a batch reaches an embedding (where a bad id would be an
    ``IndexError`` in torch and a silent clamp in JAX).

    >>> check_batch(collate([{"input_ids": [5, 6, 7]}]), vocab_size=8)
    >>> try:
    ...     check_batch(collate([{"input_ids": [5, 9]}]), vocab_size=8)
    ... except DataError as err:
    ...     print(str(err)[:60])
    input_ids hold 9 at [row 0, position 1], outside the vocabul
    """
    if not isinstance(batch, Batch):
        raise DataTypeError(
            f"batch must be a twinseq.common.data.batching.Batch (from collate), got "
            f"{type(batch).__name__}; build it with twinseq.common.data.batching.collate(examples)."
        )
    for name, values, allowed in (("input_ids", batch.input_ids, None), ("labels", batch.labels, IGNORE_INDEX)):
        values = np.asarray(values)
        bad = (values < 0) | (values >= vocab_size)
        if allowed is not None:
            bad &= values != allowed
        if bad.any():
            row, pos = (int(i) for i in np.argwhere(bad)[0])
            raise DataError(
                f"{name} hold {int(values[row, pos])} at [row {row}, position {pos}], outside the "
                f"vocabulary [0, {vocab_size}){'' if allowed is None else f' (and not {allowed})'}; "
                f"fix the tokenisation or use a model whose vocab_size covers the tokenizer."
            )
    check_parents(batch)


def check_parents(batch: Batch) -> None:
    """Raise ``DataError`` unless ``batch.parent_ids`` follows the contract: a parent is a segment of the same
    row that lies wholly before its children, has no parent itself, and whose positions all precede the child's.
    """
    par, seg, pos = batch.parent_ids, batch.segment_ids, batch.position_ids
    if par is None:
        return
    if np.shape(par) != np.shape(seg):
        raise DataError(
            f"parent_ids has shape {np.shape(par)}, segment_ids {np.shape(seg)}; give one parent segment id per "
            f"token (0 = none), as common.data.prefix_sharing.collate_shared builds it."
        )
    for r in range(seg.shape[0]):
        for child in np.unique(seg[r][(par[r] != 0) & (seg[r] != 0)]):
            idx = np.nonzero(seg[r] == child)[0]
            parents = np.unique(par[r, idx])
            p = int(parents[0])
            where = f"row {r}, segment {int(child)}"
            if parents.size != 1:
                raise DataError(f"{where}: parent_ids {parents.tolist()} differ within the segment; give one parent.")
            pidx = np.nonzero(seg[r] == p)[0]
            if p == child or pidx.size == 0 or pidx.max() >= idx.min():
                raise DataError(
                    f"{where}: parent_ids name segment {p}, not an earlier segment of the row; put a parent wholly "
                    f"before its children (build the batch with common.data.prefix_sharing.collate_shared)."
                )
            if (par[r, pidx] != 0).any():
                raise DataError(
                    f"{where}: parent segment {p} has a parent itself (parent_ids != 0 on it); prefixes are one level "
                    f"deep: set parent_ids to 0 on the parent's tokens."
                )
            if pos[r, pidx].max() >= pos[r, idx].min():
                raise DataError(
                    f"{where}: the parent's positions reach {int(pos[r, pidx].max())}, the child starts at "
                    f"{int(pos[r, idx].min())}; a child continues its parent's positions: start the child's "
                    f"position_ids after the parent's."
                )


def pad_batch(batch: Batch, rows: int, multiple: int) -> Batch:
    """The same documents padded to ``rows`` rows and a multiple of ``multiple`` columns.

    Padding is segment 0, position 0, label -100 and token 0, so losses and counts are
    unchanged (padding is never attended to nor scored). Used to bucket shapes (one compile per
    bucket) and to split rows into context-parallel chunks.

    >>> b = pad_batch(collate([{"input_ids": [5, 6, 7]}]), rows=2, multiple=4)
    >>> b.input_ids.tolist(), b.segment_ids.tolist()
    ([[5, 6, 7, 0], [0, 0, 0, 0]], [[1, 1, 1, 0], [0, 0, 0, 0]])
    """
    b, t = batch.shape
    width = _round_up(t, multiple)
    if rows < b:
        raise DataError(
            f"a micro-batch of {b} rows does not fit in rows={rows}; raise rows (per_device_train_batch_size) "
            f"to at least {b}."
        )
    if (b, t) == (rows, width):
        return batch

    def pad(a: np.ndarray, value: int) -> np.ndarray:
        return np.pad(a, ((0, rows - b), (0, width - t)), constant_values=value)

    return dataclasses.replace(
        batch,
        input_ids=pad(batch.input_ids, 0),
        labels=pad(batch.labels, IGNORE_INDEX),
        position_ids=pad(batch.position_ids, 0),
        segment_ids=pad(batch.segment_ids, 0),
        parent_ids=None if batch.parent_ids is None else pad(batch.parent_ids, 0),
    )


def split_documents(batch: Batch) -> list[dict[str, np.ndarray]]:
    """Undo collation: one ``{"input_ids", "labels"}`` dict per document, in flattened order.

    Used by tests to run the same documents one by one and compare with the packed batch.
    """
    docs = []
    for r in range(batch.input_ids.shape[0]):
        seg = batch.segment_ids[r]
        for s in np.unique(seg[seg != 0]):
            idx = np.nonzero(seg == s)[0]
            docs.append({"input_ids": batch.input_ids[r, idx], "labels": batch.labels[r, idx]})
    return docs
