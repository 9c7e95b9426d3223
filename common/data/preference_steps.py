"""Preference rows to optimizer steps: the DPO analogue of ``common.data.sft_steps.StepIterator``.

Both DPO trainers consume ``PreferenceStepIterator``, so for one config and seed they see
the same pairs in the same order. Shuffling, the step layout across ranks and micro-batches,
and the resumable position are ``StepIterator``'s own (this class inherits them); only the
columns and the collator differ: each micro-batch is a ``PreferenceBatch`` (chosen documents
first, then rejected, see ``common.data.preference_batching``).

The DPO loss is a mean over *pairs*, so a micro-batch's loss is normalised by the pairs of
the whole optimizer step (``PreferenceBatch.num_examples_in_step``: ``examples_per_step``, or fewer in an epoch's
last, short step), never by its own count: the summed micro-batch gradients then equal the full batch's (ANCHORS
failure 8, for pairs). Epochs are ``StepIterator``'s: one pass over every pair, the last step taking the pairs left;
a micro-batch slot left without a pair is a padding-only ``PreferenceBatch`` of 0 pairs, which adds nothing.

Reference log-probs computed once before training (``precompute_ref_log_probs``) live in the
rows as the columns ``ref_chosen_logps`` / ``ref_rejected_logps`` (TRL's names);
``collate_preference`` carries them into the batch.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from twinseq.common.config import TrainConfig
from twinseq.common.data.batching import IGNORE_INDEX
from twinseq.common.data.preference_batching import PREFERENCE_FIELDS, PreferenceBatch, collate_preference
from twinseq.common.data.prefix_sharing import shares_prefix
from twinseq.common.data.sft_steps import DataState, StepIterator, empty_micro_batch
from twinseq.common.errors import DataError, DataTypeError

logger = logging.getLogger(__name__)

REF_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")


def preference_columns(rows: Any) -> dict[str, list]:
    """Dataset or dict of lists -> the preference columns (and reference log-probs, if present)."""
    if hasattr(rows, "column_names"):
        names = list(rows.column_names)
    elif isinstance(rows, Mapping):
        names = list(rows)
    else:
        raise DataTypeError(
            f"rows must be a datasets.Dataset or a dict of lists, got {type(rows).__name__}; pass one of those."
        )
    missing = [f for f in PREFERENCE_FIELDS if f not in names]
    if missing:
        raise DataError(
            f"preference rows lack the column(s) {missing} (columns: {sorted(names)}); tokenise with "
            f"twinseq.common.data.prepare.prepare_dpo_dataset first."
        )
    present_refs = [f for f in REF_FIELDS if f in names]
    if len(present_refs) == 1:
        raise DataError(
            f"rows carry {present_refs[0]!r} but not its pair; precompute both reference columns "
            f"{REF_FIELDS} or neither."
        )
    out: dict[str, list] = {f: [np.asarray(v) for v in rows[f]] for f in PREFERENCE_FIELDS}
    for f in present_refs:
        out[f] = [float(v) for v in rows[f]]
    return out


def with_ref_logps(rows: Any, ref_chosen_logps: np.ndarray, ref_rejected_logps: np.ndarray) -> Any:
    """``rows`` plus the float64 columns ``ref_chosen_logps`` / ``ref_rejected_logps`` (one per row).

    ``rows`` is a ``datasets.Dataset`` (columns added, existing ones replaced) or a dict of lists
    (a new dict is returned).
    """
    chosen = np.asarray(ref_chosen_logps, dtype=np.float64)
    rejected = np.asarray(ref_rejected_logps, dtype=np.float64)
    num_rows = len(rows) if hasattr(rows, "column_names") else len(rows[PREFERENCE_FIELDS[0]])
    if chosen.shape != (num_rows,) or rejected.shape != (num_rows,):
        raise DataError(
            f"reference log-probs must have one value per row ({num_rows}); got {chosen.shape} and {rejected.shape}: "
            "pass one log-prob per row."
        )
    if not (np.isfinite(chosen).all() and np.isfinite(rejected).all()):
        bad = np.concatenate([chosen[~np.isfinite(chosen)], rejected[~np.isfinite(rejected)]])
        raise DataError(
            f"ref_chosen_logps/ref_rejected_logps hold non-finite values ({bad.tolist()[:3]}); check the "
            f"reference model."
        )
    if hasattr(rows, "column_names"):
        rows = rows.remove_columns([f for f in REF_FIELDS if f in rows.column_names])
        return rows.add_column(REF_FIELDS[0], chosen.tolist()).add_column(REF_FIELDS[1], rejected.tolist())
    return {**rows, REF_FIELDS[0]: chosen.tolist(), REF_FIELDS[1]: rejected.tolist()}


def iter_preference_batches(
    rows: Any,
    batch_size: int,
    *,
    padding_free: bool = False,
    pad_token_id: int = 0,
    pad_to_multiple_of: Optional[int] = None,
) -> Iterator[tuple[np.ndarray, PreferenceBatch]]:
    """Every row once, in order, ``batch_size`` pairs at a time: yields ``(row_indices, PreferenceBatch)``.

    Used to precompute reference log-probs in one pass (the last batch may be smaller).
    Reference columns already in ``rows`` are not carried (they are what is being computed).
    """
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size!r} must be >= 1; pass a positive number of pairs per batch.")
    columns = preference_columns(rows)
    num_rows = len(columns[PREFERENCE_FIELDS[0]])
    for start in range(0, num_rows, batch_size):
        idx = np.arange(start, min(start + batch_size, num_rows))
        examples = [{f: columns[f][i] for f in PREFERENCE_FIELDS} for i in idx]
        yield (
            idx,
            collate_preference(
                examples, padding_free=padding_free, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of
            ),
        )


class PreferenceStepIterator(StepIterator):
    """Yield, per optimizer step, this rank's list of ``gradient_accumulation_steps`` ``PreferenceBatch``.

    ``examples_per_step`` (pairs over every micro-batch and rank) is the denominator of each
    micro-batch's DPO loss; every micro-batch holds ``per_device_train_batch_size`` pairs, except in an epoch's
    last step, which spreads the pairs left over the micro-batches (as ``StepIterator`` does) and carries their
    count as ``num_examples_in_step``.

    >>> rows = {"prompt_input_ids": [[1, 5], [1, 6], [1, 7]], "chosen_input_ids": [[8], [9], [10]],
    ...         "rejected_input_ids": [[11], [12], [13]]}
    >>> cfg = TrainConfig.from_flat(task="dpo", per_device_train_batch_size=1, gradient_accumulation_steps=2)
    >>> it = PreferenceStepIterator(rows, cfg, pad_token_id=0)
    >>> step = it.next_step(); len(step), step[0].num_docs, it.examples_per_step
    (2, 2, 2)
    """

    def __init__(
        self,
        rows: Any,
        cfg: TrainConfig,
        pad_token_id: int,
        *,
        world_size: int = 1,
        rank: int = 0,
        seed: Optional[int] = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise DataError(f"rank={rank} must be in [0, world_size={world_size}); pass this process's rank.")
        if cfg.data.packing:
            raise DataError(
                "packing=True does not apply to DPO: packing would cut pairs apart (TRL: packing is "
                "SFT-only). Use --padding-free to put every pair of a micro-batch in one row."
            )
        self.cfg, self.pad_token_id = cfg, pad_token_id
        self.world_size, self.rank = world_size, rank
        self.seed = cfg.seed if seed is None else seed
        self.columns = preference_columns(rows)
        self.num_rows = len(self.columns[PREFERENCE_FIELDS[0]])
        if self.num_rows == 0:
            raise DataError(
                f"the preference data of dataset_name={cfg.data.dataset_name!r} is empty after tokenisation and "
                f"truncation (max_length={cfg.data.max_length}); check dataset_name and max_length."
            )
        self.state = DataState()
        self._order = self._permutation(0)
        self.share_prefix = shares_prefix(cfg)

    @property
    def examples_per_step(self) -> int:
        return self.rows_per_step

    @property
    def has_ref_logps(self) -> bool:
        return REF_FIELDS[0] in self.columns

    def _collate_pairs(self, idx: np.ndarray) -> PreferenceBatch:
        c = self.cfg.data
        return collate_preference(
            [self._example(i) for i in idx],
            padding_free=c.padding_free,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=c.pad_to_multiple_of,
            share_prefix=self.share_prefix,
        )

    def _empty_pairs(self) -> PreferenceBatch:
        """A micro-batch slot without a pair (a short last step): 0 pairs, one row of padding."""
        batch = empty_micro_batch(self.pad_token_id, 0, self.cfg.data.pad_to_multiple_of)
        ref = np.zeros(0, np.float64) if self.has_ref_logps else None
        return PreferenceBatch(
            batch=batch,
            num_examples=0,
            doc_example_index=np.zeros(0, np.int32),
            doc_is_chosen=np.zeros(0, bool),
            target_doc_ids=np.full(batch.shape, -1, np.int32),
            num_target_tokens=np.zeros(0, np.int32),
            ref_chosen_logps=ref,
            ref_rejected_logps=ref,
        )

    def next_step(self) -> list[PreferenceBatch]:  # type: ignore[override]
        ws, ga = self.world_size, self.cfg.data.gradient_accumulation_steps
        slots = self._slots()
        all_micro = [self._collate_pairs(idx) if len(idx) else self._empty_pairs() for idx in slots]
        # Label tokens of the whole step, for Batch.num_items_in_batch (the contract; DPO itself divides by pairs).
        total = sum(int((pb.batch.labels != IGNORE_INDEX).sum()) for pb in all_micro)
        pairs = sum(len(idx) for idx in slots)
        self.state.steps_done += 1
        mine = [all_micro[m * ws + self.rank] for m in range(ga)]
        for pb in mine:
            pb.batch = pb.batch.with_num_items(total)
            pb.num_examples_in_step = pairs
        return mine


def build_preference_iterator(
    cfg: TrainConfig, rows: Any, pad_token_id: int, *, world_size: int = 1, rank: int = 0
) -> PreferenceStepIterator:
    """``PreferenceStepIterator`` over ``rows`` (from ``prepare_dpo_dataset``, maybe with reference columns)."""
    iterator = PreferenceStepIterator(rows, cfg, pad_token_id=pad_token_id, world_size=world_size, rank=rank)
    if cfg.dpo.precompute_ref_log_probs and not iterator.has_ref_logps:
        raise DataError(
            "precompute_ref_log_probs=True but the rows carry no ref_chosen_logps/ref_rejected_logps; "
            "compute them first (the backends' precompute_ref_logps does)."
        )
    logger.info(
        "DPO data: %d pairs, %d pairs per optimizer step, %d steps per epoch",
        iterator.num_rows,
        iterator.examples_per_step,
        iterator.steps_per_epoch,
    )
    return iterator
