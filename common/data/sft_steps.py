"""From tokenised rows to optimizer steps: packing, shuffling, micro-batches, resumable position.

Both trainers consume the same ``StepIterator``, so for one config and seed they see the
same micro-batches in the same order, and ``num_items_in_batch`` is the label count of the
whole optimizer step (every micro-batch on every rank), never of one micro-batch.

Layout of one step: ``world_size * gradient_accumulation_steps * per_device_train_batch_size``
rows are taken from the shuffled stream; micro-batch ``m`` of rank ``r`` gets rows
``[(m * world_size + r) * bs, ... + bs)``. Every rank computes the step total locally from
the same deterministic stream, so no collective is needed for it.
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
        raise DataTypeError(f"rows must be a datasets.Dataset or a dict of lists, got {type(rows).__name__}.")
    if "input_ids" not in data:
        raise DataError(f"rows have no 'input_ids' column (columns: {sorted(data)}); tokenise first.")
    return {c: [np.asarray(v) for v in col] for c, col in data.items()}


@dataclass
class DataState:
    epoch: int = 0
    position: int = 0
    steps_done: int = 0


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
            raise DataError(f"rank={rank} must be in [0, world_size={world_size}).")
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
                "the training data is empty after tokenisation, truncation and filtering; "
                "check dataset_name and max_length."
            )
        self.state = DataState()
        self._order = self._permutation(0)

    @property
    def rows_per_step(self) -> int:
        d = self.cfg.data
        return self.world_size * d.gradient_accumulation_steps * d.per_device_train_batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def _take(self, n: int) -> np.ndarray:
        out = []
        while n > 0:
            chunk = self._order[self.state.position : self.state.position + n]
            out.append(chunk)
            n -= len(chunk)
            self.state.position += len(chunk)
            if self.state.position >= self.num_rows:
                self.state.epoch += 1
                self.state.position = 0
                self._order = self._permutation(self.state.epoch)
        return np.concatenate(out)

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
        bs, ga = d.per_device_train_batch_size, d.gradient_accumulation_steps
        idx = self._take(self.rows_per_step).reshape(ga, ws, bs)
        # Step total over every micro-batch of every rank: the denominator of the loss.
        all_micro = [self._collate(idx[m, r], None) for m in range(ga) for r in range(ws)]
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


def build_step_iterator(cfg: TrainConfig, *, world_size: int = 1, rank: int = 0):
    """Load, tokenise, truncate (``common.data.prepare``) and wrap the SFT data.

    Returns (iterator, tokenizer, stats)."""
    rows, tokenizer, stats = prepare_sft_dataset(cfg)
    iterator = StepIterator(rows, cfg, pad_token_id=tokenizer.pad_token_id, world_size=world_size, rank=rank)
    return iterator, tokenizer, stats
