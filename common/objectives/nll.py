"""Loss math, the numpy reference both backends are tested against.

Conventions (docs/architecture.md, "The batch contract"):

- ``labels`` are aligned with ``input_ids`` (unshifted); -100 means "no loss".
- Position t predicts ``labels[t + 1]``: the shift happens here, inside the loss.
- The loss is ``sum of the NLL over valid targets / num_items_in_batch``, where
  ``num_items_in_batch`` counts the labels != -100 of the whole optimizer step (every
  micro-batch, every rank). Summing the micro-batch losses of a step therefore gives the
  exact step mean, whatever the split (ANCHORS failure 8).
- A micro-batch with no valid target has loss exactly 0.

Everything is computed in float64 so that it can serve as the reference for float32 tests.
"""

from __future__ import annotations

import logging

import numpy as np

from twinseq.common.errors import DataError
from twinseq.common.tasks import TaskSpec, register_task

IGNORE_INDEX = -100
"""The label of a position that is not scored (Hugging Face's and PyTorch's convention)."""

logger = logging.getLogger(__name__)


def shift_labels(labels_BT: np.ndarray) -> np.ndarray:
    """Targets of each position: ``targets[:, t] = labels[:, t + 1]``, the last is -100.

    >>> shift_labels(np.array([[-100, 6, 7, -100, 9]])).tolist()
    [[6, 7, -100, 9, -100]]
    """
    labels_BT = np.asarray(labels_BT)
    if labels_BT.ndim != 2:
        raise DataError(
            f"labels must have shape [B, T], got shape {labels_BT.shape}; add a batch dimension with labels[None]."
        )
    targets_BT = np.full_like(labels_BT, IGNORE_INDEX)
    targets_BT[:, :-1] = labels_BT[:, 1:]
    return targets_BT


def check_targets(targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool mask of the valid targets; raises for a target outside ``[0, vocab_size)`` other than -100."""
    valid = targets != IGNORE_INDEX
    bad = valid & ((targets < 0) | (targets >= vocab_size))
    if bad.any():
        raise DataError(
            f"labels hold {np.asarray(targets[bad]).ravel()[:4].tolist()}, outside the vocabulary "
            f"[0, {vocab_size}) and not the ignore index {IGNORE_INDEX}; fix the tokenisation "
            f"or the model's vocab_size."
        )
    return valid


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Stable float64 log-softmax over the last axis (max-subtracted)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_nll(logits_BTV: np.ndarray, targets_BT: np.ndarray) -> np.ndarray:
    """float64 [B, T]: ``-log softmax(logits[b, t])[targets[b, t]]``, 0 where the target is -100.

    ``targets`` are already shifted (see ``shift_labels``).
    """
    logits_BTV = np.asarray(logits_BTV)
    targets_BT = np.asarray(targets_BT)
    if logits_BTV.shape[:-1] != targets_BT.shape:
        raise DataError(
            f"logits shape {logits_BTV.shape} does not match targets shape {targets_BT.shape}; "
            f"pass logits [B, T, V] for targets [B, T]."
        )
    valid = check_targets(targets_BT, logits_BTV.shape[-1])
    logp = log_softmax(logits_BTV)
    safe = np.where(valid, targets_BT, 0)
    picked = np.take_along_axis(logp, safe[..., None].astype(np.int64), axis=-1)[..., 0]
    return np.where(valid, -picked, 0.0)


def check_num_items(num_items_in_batch: int, num_valid: int) -> None:
    """Raise unless ``num_items_in_batch`` can be the label count of the step that holds a micro-batch
    of ``num_valid`` targets (every backend's loss checks it here, on the host)."""
    if num_items_in_batch is None or int(num_items_in_batch) != num_items_in_batch or num_items_in_batch < 0:
        raise DataError(
            f"num_items_in_batch={num_items_in_batch!r} must be a non-negative integer: pass the count "
            f"of labels != -100 over the whole optimizer step."
        )
    if num_items_in_batch < num_valid:
        raise DataError(
            f"num_items_in_batch={num_items_in_batch} is smaller than the {num_valid} valid targets "
            f"of this micro-batch alone; it must count the labels != -100 of the whole optimizer "
            f"step (all micro-batches, all ranks): pass e.g. Batch.num_items_in_batch."
        )
    if num_items_in_batch == 0:
        logger.warning(
            "num_items_in_batch=0: the whole optimizer step has no valid label; the loss is 0 "
            "and the gradients are zero."
        )


def nll_loss(logits_BTV: np.ndarray, labels_BT: np.ndarray, num_items_in_batch: int) -> float:
    """Sum of the next-token NLL over valid targets, divided by ``num_items_in_batch``.

    ``labels`` are unshifted. Returns 0.0 (with a warning) when ``num_items_in_batch`` is 0.
    """
    targets_BT = shift_labels(labels_BT)
    nll_BT = token_nll(logits_BTV, targets_BT)
    check_num_items(num_items_in_batch, int((targets_BT != IGNORE_INDEX).sum()))
    return float(nll_BT.sum() / max(int(num_items_in_batch), 1))


def per_document_loss(logits_BTV: np.ndarray, labels_BT: np.ndarray, segment_ids_BT: np.ndarray) -> dict:
    """NLL sum and target count per document, in flattened (row-major) document order.

    A target belongs to the document of the token it names (``segment_ids[:, t + 1]``).
    Returns arrays of length D (the number of (row, segment) pairs with segment != 0):
    ``{"row", "segment", "nll_sum" (float64), "count"}``. Padded and padding-free batches of
    the same documents give the same ``nll_sum`` and ``count``, in the same order.

    >>> logits = np.zeros((1, 5, 4))
    >>> out = per_document_loss(logits, np.array([[-100, 1, 2, -100, 3]]), np.array([[1, 1, 1, 2, 2]]))
    >>> out["segment"].tolist(), out["count"].tolist(), np.round(out["nll_sum"] / np.log(4), 6).tolist()
    ([1, 2], [2, 1], [2.0, 1.0])
    """
    targets_BT = shift_labels(labels_BT)
    nll_BT = token_nll(logits_BTV, targets_BT)
    segment_ids_BT = np.asarray(segment_ids_BT)
    if segment_ids_BT.shape != targets_BT.shape:
        raise DataError(
            f"segment_ids shape {segment_ids_BT.shape} must equal labels shape {targets_BT.shape}; pass the "
            "segment_ids of the same batch."
        )
    target_seg_BT = np.zeros_like(segment_ids_BT)
    target_seg_BT[:, :-1] = segment_ids_BT[:, 1:]
    valid_BT = targets_BT != IGNORE_INDEX
    rows, segs, sums, counts = [], [], [], []
    for r in range(segment_ids_BT.shape[0]):
        for s in np.unique(segment_ids_BT[r][segment_ids_BT[r] != 0]):
            in_doc = valid_BT[r] & (target_seg_BT[r] == s)
            rows.append(r)
            segs.append(int(s))
            sums.append(float(nll_BT[r][in_doc].sum()))
            counts.append(int(in_doc.sum()))
    return {
        "row": np.array(rows, dtype=np.int64),
        "segment": np.array(segs, dtype=np.int64),
        "nll_sum": np.array(sums, dtype=np.float64),
        "count": np.array(counts, dtype=np.int64),
    }


def num_tokens(labels_BT: np.ndarray) -> int:
    """Number of scored targets: shifted labels != -100 (what the loss sums over)."""
    return int((shift_labels(labels_BT) != IGNORE_INDEX).sum())


def mean_token_accuracy(logits_BTV: np.ndarray, labels_BT: np.ndarray) -> float:
    """Fraction of valid targets that are the argmax of the logits (first index on ties), as TRL.

    0.0 when there is no valid target.
    """
    targets_BT = shift_labels(labels_BT)
    valid = check_targets(targets_BT, np.shape(logits_BTV)[-1])
    if not valid.any():
        return 0.0
    correct = np.argmax(np.asarray(logits_BTV), axis=-1) == targets_BT
    return float(correct[valid].mean())


def entropy(logits_BTV: np.ndarray, labels_BT: np.ndarray) -> float:
    """Mean entropy (nats) of the predicted distribution over the valid target positions, as TRL.

    0.0 when there is no valid target.
    """
    targets_BT = shift_labels(labels_BT)
    valid = check_targets(targets_BT, np.shape(logits_BTV)[-1])
    if not valid.any():
        return 0.0
    logp = log_softmax(np.asarray(logits_BTV)[valid])
    return float(-(np.exp(logp) * logp).sum(axis=-1).mean())


def metrics(logits_BTV: np.ndarray, labels_BT: np.ndarray) -> dict:
    """The logged loss metrics, in the same dict the backends return with ``return_metrics=True``."""
    return {
        "mean_token_accuracy": mean_token_accuracy(logits_BTV, labels_BT),
        "entropy": entropy(logits_BTV, labels_BT),
        "num_tokens": num_tokens(labels_BT),
    }


SFT_TASK = register_task(
    TaskSpec(
        name="sft",
        trainer="SFTTrainer",
        builder="trainer:build_sft",
        order=0,
        learning_rate=2e-5,
        peft_learning_rate=1e-4,
        evaluator="twinseq.common.run.eval_set:sft_evaluator",
    )
)
"""Supervised fine-tuning: the token-normalised NLL of the completion (TRL's ``SFTTrainer``)."""
