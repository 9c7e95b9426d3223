"""From tokenised rows to optimizer steps: packing, shuffling, micro-batches, resumable position.

Both trainers consume the same ``StepIterator``, so for one config and seed they see the
same micro-batches in the same order, and ``num_items_in_batch`` is the label count of the
whole optimizer step (every micro-batch on every rank), never of one micro-batch.

Epochs. An epoch is one pass over every row exactly once, in a permutation drawn from the seed and the epoch
number (``numpy.random.default_rng([seed, epoch])``), so the order is the same on every rank and after a resume.
A step never crosses into the next epoch: an epoch is ``steps_per_epoch = ceil(num_rows / rows_per_step)`` steps,
and its last one takes the rows that remain (a DataLoader's ``drop_last=False``), a smaller step whose
``num_items_in_batch`` counts those rows only. The position (epoch, row, steps done) is the resumable state.

Layout of one step: ``rows_per_step = world_size * gradient_accumulation_steps * per_device_train_batch_size``
rows are taken from the epoch's order and split over the step's ``gradient_accumulation_steps * world_size``
micro-batch slots, in order, as evenly as possible (``numpy.array_split``); slot ``m * world_size + r`` is
micro-batch ``m`` of rank ``r``. A full step gives every slot ``bs`` rows: micro-batch ``m`` of rank ``r`` gets rows
``[(m * world_size + r) * bs, ... + bs)``. A short last step gives slots sizes that differ by one at most, so every
rank still runs ``gradient_accumulation_steps`` micro-batches (FSDP's collectives and DeepSpeed's accumulation
boundary stay in step); a slot left without a row (fewer rows than slots) is a padding-only micro-batch
(``empty_micro_batch``: no document, no label), which adds nothing to the loss, the gradients or any count.
Every rank computes the step total locally from the same deterministic stream, so no collective is needed for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

from twinseq.common.config import TrainConfig
from twinseq.common.data.batching import IGNORE_INDEX, Batch, collate
from twinseq.common.data.packing import pack_dataset
from twinseq.common.data.prepare import prepare_sft_dataset
from twinseq.common.errors import DataError, DataTypeError

logger = logging.getLogger(__name__)

_ROW_FIELDS = ("input_ids", "labels", "completion_mask", "assistant_masks", "seq_lengths")


def _columns(rows: Any) -> dict[str, list[np.ndarray]]:
    """Dataset or dict of lists -> the collatable columns as lists of numpy arrays."""
    if hasattr(rows, "column_names"):
        names = [c for c in rows.column_names if c in _ROW_FIELDS]
        data = {c: rows[c] for c in names}
    elif isinstance(rows, Mapping):
        data = {c: rows[c] for c in rows if c in _ROW_FIELDS}
    else:
        raise DataTypeError(
            f"rows must be a datasets.Dataset or a dict of lists, got {type(rows).__name__}; pass one of those."
        )
    if "input_ids" not in data:
        columns = rows.column_names if hasattr(rows, "column_names") else list(rows)
        raise DataError(f"rows have no 'input_ids' column (columns: {sorted(columns)}); tokenise first.")
    return {c: [np.asarray(v) for v in col] for c, col in data.items()}


@dataclass
class DataState:
    epoch: int = 0
    """Epochs completed: the permutation in use is the one of this epoch."""
    position: int = 0
    """Rows of this epoch's permutation already taken."""
    steps_done: int = 0


def empty_micro_batch(pad_token_id: int, num_items_in_batch: int, pad_to_multiple_of: Optional[int] = None) -> Batch:
    """A micro-batch slot that got no row (a short last step): one row of padding, no document and no label, so it
    adds 0 to the loss, the gradients and every count, while its rank still runs the step's micro-steps.

    >>> b = empty_micro_batch(0, num_items_in_batch=7, pad_to_multiple_of=4)
    >>> b.shape, b.num_tokens, b.num_label_tokens, b.cu_seqlens.tolist()
    ((1, 4), 0, 0, [0])
    """
    width = pad_to_multiple_of or 1
    return Batch(
        input_ids=np.full((1, width), pad_token_id, np.int32),
        labels=np.full((1, width), IGNORE_INDEX, np.int32),
        position_ids=np.zeros((1, width), np.int32),
        segment_ids=np.zeros((1, width), np.int32),
        cu_seqlens=np.zeros(1, np.int32),
        num_items_in_batch=int(num_items_in_batch),
    )


class StepIterator:
    """Yield, per optimizer step, this rank's list of ``gradient_accumulation_steps`` batches.

    >>> rows = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}
    >>> cfg = TrainConfig.from_flat(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_length=8)
    >>> it = StepIterator(rows, cfg, pad_token_id=0, seed=0)
    >>> step = it.next_step(); len(step), step[0].num_items_in_batch == sum(b.num_label_tokens for b in step)
    (2, True)
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
        self.cfg, self.pad_token_id = cfg, pad_token_id
        self.world_size, self.rank = world_size, rank
        self.seed = cfg.seed if seed is None else seed
        if cfg.data.packing:
            d = cfg.data
            assert d.max_length is not None  # TrainConfig refuses packing without max_length
            rows = pack_dataset(
                rows,
                d.max_length,
                strategy=d.packing_strategy,
                completion_only_loss=d.completion_only_loss,
                assistant_only_loss=d.assistant_only_loss,
            )
        self.columns = _columns(rows)
        self.num_rows = len(self.columns["input_ids"])
        if self.num_rows == 0:
            raise DataError(
                f"the training data of dataset_name={cfg.data.dataset_name!r} is empty after tokenisation, "
                f"truncation and filtering (max_length={cfg.data.max_length}); check dataset_name and max_length."
            )
        self.state = DataState()
        self._order = self._permutation(0)

    @property
    def rows_per_step(self) -> int:
        d = self.cfg.data
        return self.world_size * d.gradient_accumulation_steps * d.per_device_train_batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of one pass over the rows, the last one short when ``rows_per_step`` does not divide
        ``num_rows`` (Hugging Face's count: ``ceil(num_rows / rows_per_step)``)."""
        return -(-self.num_rows // self.rows_per_step)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def _take(self) -> np.ndarray:
        """The next step's rows: ``rows_per_step`` of this epoch's order, or the rows it has left (the epoch's last,
        short step); then the next epoch's order, once this one is used up."""
        start = self.state.position
        idx = self._order[start : start + self.rows_per_step]
        self.state.position += len(idx)
        if self.state.position >= self.num_rows:
            self.state.epoch += 1
            self.state.position = 0
            self._order = self._permutation(self.state.epoch)
        return idx

    def _slots(self) -> list[np.ndarray]:
        """The next step's rows over its ``gradient_accumulation_steps * world_size`` micro-batch slots (slot
        ``m * world_size + r``: micro-batch m of rank r), in order, as evenly as possible; some may be empty."""
        return np.array_split(self._take(), self.cfg.data.gradient_accumulation_steps * self.world_size)

    def _example(self, i: int) -> dict[str, np.ndarray]:
        return {c: col[i] for c, col in self.columns.items()}

    def _collate(self, idx: np.ndarray, num_items: Optional[int]) -> Batch:
        c = self.cfg.data
        return collate(
            [self._example(i) for i in idx],
            padding_free=c.padding_free,
            pad_token_id=self.pad_token_id,
            padding_side=c.padding_side,
            pad_to_multiple_of=c.pad_to_multiple_of,
            completion_only_loss=c.completion_only_loss,
            assistant_only_loss=c.assistant_only_loss,
            num_items_in_batch=num_items,
        )

    def next_step(self) -> list[Batch]:
        d, ws = self.cfg.data, self.world_size
        ga = d.gradient_accumulation_steps
        # Step total over every micro-batch of every rank: the denominator of the loss.
        all_micro = [
            self._collate(idx, None) if len(idx) else empty_micro_batch(self.pad_token_id, 0, d.pad_to_multiple_of)
            for idx in self._slots()
        ]
        total = sum(b.num_label_tokens for b in all_micro)
        if total == 0:
            logger.warning("optimizer step %d has no label tokens; its loss is 0", self.state.steps_done)
        self.state.steps_done += 1
        return [all_micro[m * ws + self.rank].with_num_items(total) for m in range(ga)]

    def __iter__(self):
        return self

    def __next__(self) -> list[Batch]:
        return self.next_step()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.state.epoch,
            "position": self.state.position,
            "steps_done": self.state.steps_done,
            "seed": self.seed,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["num_rows"] != self.num_rows or state["seed"] != self.seed:
            raise DataError(
                f"cannot resume: the checkpoint's data had num_rows={state['num_rows']}, "
                f"seed={state['seed']} but this run has num_rows={self.num_rows}, seed={self.seed}; "
                f"resume with the same dataset, max_length, packing and seed."
            )
        self.state = DataState(state["epoch"], state["position"], state["steps_done"])
        self._order = self._permutation(self.state.epoch)


def count_label_tokens(batches: list[Batch]) -> int:
    return int(sum((b.labels != IGNORE_INDEX).sum() for b in batches))


def build_step_iterator(
    cfg: TrainConfig, *, world_size: int = 1, rank: int = 0, dataset: Any = None, tokenizer: Any = None
):
    """Load, tokenise, truncate (``common.data.prepare``) and wrap the SFT data (``dataset`` / ``tokenizer``: a
    Python caller's objects instead of the config's names).

    Returns (iterator, tokenizer, stats)."""
    rows, tokenizer, stats = prepare_sft_dataset(cfg, dataset, tokenizer)
    iterator = StepIterator(rows, cfg, pad_token_id=tokenizer.pad_token_id, world_size=world_size, rank=rank)
    return iterator, tokenizer, stats
