"""Preference batches: chosen and rejected sequences collated together into one ``Batch``.

Layout (TRL's ``[chosen; rejected]`` order, so a backend can split per-sequence results
with one ``chunk(2)``): for N examples the batch holds 2N documents,

- document ``i``       = prompt_i + chosen_i,   for i in [0, N);
- document ``N + i``   = prompt_i + rejected_i, for i in [0, N).

Padded: row d is document d (B = 2N). Padding-free: the 2N documents in one row, in that
order, each its own segment (B = 1). Either way the documents are numbered in flattened
(row-major) order, the order of ``Batch.cu_seqlens``.

The labels mask the prompt: only completion tokens are targets (``collate`` with a
``completion_mask``). With the shift convention, position t predicts ``labels[t + 1]``, so
a sequence log-prob is ``Σ_t token_logps[t]`` over the t whose ``labels[t + 1] != -100``.
The first token of a document is never a target, so an empty prompt leaves the first
completion token unscored (nothing precedes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from twinseq.common.data.batching import IGNORE_INDEX, Batch, _as_int_list, collate
from twinseq.common.data.prefix_sharing import SharedGroup, collate_shared
from twinseq.common.errors import DataError
from twinseq.common.objectives.nll import shift_labels, token_nll

PREFERENCE_FIELDS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")


@dataclass
class PreferenceBatch:
    """A ``Batch`` of 2N documents plus the map from document to (example, chosen/rejected)."""

    batch: Batch
    num_examples: int  # N
    doc_example_index: np.ndarray  # int32 [2N]: example of each document (0..N-1, then 0..N-1)
    doc_is_chosen: np.ndarray  # bool  [2N]: True for the first N documents
    target_doc_ids: np.ndarray  # int32 [B, T]: document of the target predicted at t (labels[t+1]); -1: none
    num_target_tokens: np.ndarray  # int32 [2N]: scored completion tokens of each document
    ref_chosen_logps: Optional[np.ndarray] = None  # float64 [N], when the examples carry them (precomputed)
    ref_rejected_logps: Optional[np.ndarray] = None
    num_examples_in_step: Optional[int] = None
    """Pairs of the whole optimizer step (every micro-batch, every rank), the DPO loss's denominator; set by
    ``PreferenceStepIterator`` (an epoch's last step may be short). None: the trainer's full-step count."""

    @property
    def num_docs(self) -> int:
        return 2 * self.num_examples

    @property
    def chosen_num_tokens(self) -> np.ndarray:
        return self.num_target_tokens[: self.num_examples]

    @property
    def rejected_num_tokens(self) -> np.ndarray:
        return self.num_target_tokens[self.num_examples :]


def _document_examples(examples: Sequence[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]:
    """2N ``{"input_ids", "completion_mask"}`` dicts: every chosen document, then every rejected one."""
    chosen: list[dict[str, np.ndarray]] = []
    rejected: list[dict[str, np.ndarray]] = []
    for i, ex in enumerate(examples):
        missing = [f for f in PREFERENCE_FIELDS if f not in ex]
        if missing:
            raise DataError(
                f"example {i} lacks {missing} (fields: {sorted(ex)}); tokenise the preference data "
                f"first, e.g. with twinseq.common.data.prepare.prepare_dpo_dataset."
            )
        prompt = _as_int_list(ex["prompt_input_ids"], "prompt_input_ids", i)
        for side, out in (("chosen", chosen), ("rejected", rejected)):
            completion = _as_int_list(ex[f"{side}_input_ids"], f"{side}_input_ids", i)
            if completion.size == 0:
                raise DataError(
                    f"example {i}: '{side}_input_ids' is empty, so the {side} sequence has no "
                    f"completion token to score; drop such rows upstream (prepare_dpo_dataset does) "
                    f"or raise max_length / max_completion_length."
                )
            mask = np.concatenate([np.zeros(prompt.size, np.int64), np.ones(completion.size, np.int64)])
            out.append({"input_ids": np.concatenate([prompt, completion]), "completion_mask": mask})
    return chosen + rejected


def _global_doc_ids(segment_ids_BT: np.ndarray) -> np.ndarray:
    """int32 [B, T]: flattened document index of each token, -1 on padding."""
    docs_per_row = segment_ids_BT.max(axis=1, initial=0)
    row_offset = np.concatenate([[0], np.cumsum(docs_per_row)[:-1]])
    doc_BT = row_offset[:, None] + segment_ids_BT.astype(np.int64) - 1
    return np.where(segment_ids_BT != 0, doc_BT, -1).astype(np.int32)


def _target_doc_ids(batch: Batch) -> np.ndarray:
    """int32 [B, T]: document of the target ``labels[t + 1]`` predicted at t, -1 where there is none."""
    doc_BT = _global_doc_ids(batch.segment_ids)
    has_target_BT = shift_labels(batch.labels) != IGNORE_INDEX
    target_doc_BT = np.full_like(doc_BT, -1)
    target_doc_BT[:, :-1] = doc_BT[:, 1:]
    # collate never labels a document's first token, so a target and its context share a document.
    assert (doc_BT[has_target_BT] == target_doc_BT[has_target_BT]).all()
    return np.where(has_target_BT, target_doc_BT, -1).astype(np.int32)


def _ref_logps(examples: Sequence[Mapping[str, Any]], field: str) -> Optional[np.ndarray]:
    present = [field in ex for ex in examples]
    if not any(present):
        return None
    if not all(present):
        raise DataError(
            f"{field!r} is set on {sum(present)} of {len(examples)} examples; precompute the "
            f"reference log-probs for every row or for none."
        )
    return np.array([float(ex[field]) for ex in examples], dtype=np.float64)


def _shared_groups(examples: Sequence[Mapping[str, Any]], docs: list[dict[str, np.ndarray]]) -> list[SharedGroup]:
    """One group per example: its prompt, then its chosen (document i) and rejected (document N + i) completions."""
    n, out = len(examples), []
    for i in range(n):
        chosen, rejected = docs[i], docs[n + i]
        p = int((chosen["completion_mask"] == 0).sum())
        completions = (chosen["input_ids"][p:], rejected["input_ids"][p:])
        out.append(SharedGroup(chosen["input_ids"][:p], completions, (i, n + i)))
    return out


def collate_preference(
    examples: Sequence[Mapping[str, Any]],
    *,
    padding_free: bool = False,
    pad_token_id: int = 0,
    pad_to_multiple_of: Optional[int] = None,
    share_prefix: bool = False,
) -> PreferenceBatch:
    """Collate preference rows (``prompt_input_ids``, ``chosen_input_ids``, ``rejected_input_ids``,
    optionally ``ref_chosen_logps`` / ``ref_rejected_logps``) into chosen-then-rejected documents.

    >>> pb = collate_preference([{"prompt_input_ids": [5, 6], "chosen_input_ids": [7, 8],
    ...                           "rejected_input_ids": [9]}], padding_free=True)
    >>> pb.batch.input_ids.tolist(), pb.batch.labels.tolist()
    ([[5, 6, 7, 8, 5, 6, 9]], [[-100, -100, 7, 8, -100, -100, 9]])
    >>> pb.target_doc_ids.tolist(), pb.chosen_num_tokens.tolist(), pb.rejected_num_tokens.tolist()
    ([[-1, 0, 0, -1, -1, 1, -1]], [2], [1])
    """
    if isinstance(examples, Mapping) or not len(examples):
        raise DataError(
            "collate_preference() needs a non-empty list of preference rows (dicts with "
            f"{', '.join(PREFERENCE_FIELDS)}); got {type(examples).__name__}: pass the tokenised rows as a list."
        )
    docs = _document_examples(examples)
    num_examples = len(examples)
    if share_prefix:
        batch, target_doc_ids = collate_shared(
            _shared_groups(examples, docs),
            padding_free=padding_free,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=pad_to_multiple_of,
        )
    else:
        batch = collate(
            docs,
            padding_free=padding_free,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=pad_to_multiple_of,
            completion_only_loss=True,
        )
        target_doc_ids = _target_doc_ids(batch)
    counts = np.bincount(target_doc_ids[target_doc_ids >= 0], minlength=2 * num_examples).astype(np.int32)
    if (counts == 0).any():
        d = int(np.argmin(counts))
        side = "chosen" if d < num_examples else "rejected"
        raise DataError(
            f"example {d % num_examples}: the {side} sequence has no scored completion token (an "
            f"empty prompt leaves a 1-token completion unscored); give it a prompt, e.g. a BOS token."
        )
    return PreferenceBatch(
        batch=batch,
        num_examples=num_examples,
        doc_example_index=np.tile(np.arange(num_examples, dtype=np.int32), 2),
        doc_is_chosen=np.repeat(np.array([True, False]), num_examples),
        target_doc_ids=target_doc_ids,
        num_target_tokens=counts,
        ref_chosen_logps=_ref_logps(examples, "ref_chosen_logps"),
        ref_rejected_logps=_ref_logps(examples, "ref_rejected_logps"),
    )


def sequence_logps_from_tokens(token_logps_BT: np.ndarray, pbatch: PreferenceBatch) -> tuple[np.ndarray, np.ndarray]:
    """Sum target log-probs per document: ``(chosen_logps [N], rejected_logps [N])``, float64.

    ``token_logps_BT[b, t]`` is the log-prob of ``input_ids[b, t + 1]`` predicted at t (the
    shift convention); entries that are not targets are ignored, whatever they hold (even
    NaN or -inf). Naive equivalent, for document d:
    ``sum(token_logps[b, t] for b, t if target_doc_ids[b, t] == d)``.
    """
    token_logps_BT = np.asarray(token_logps_BT, dtype=np.float64)
    if token_logps_BT.shape != pbatch.target_doc_ids.shape:
        raise DataError(
            f"token_logps shape {token_logps_BT.shape} must equal the batch shape "
            f"{pbatch.target_doc_ids.shape} ([B, T], position t scoring input_ids[t + 1]); pass the log-probs "
            f"of this batch."
        )
    has_target = pbatch.target_doc_ids >= 0
    sums = np.bincount(pbatch.target_doc_ids[has_target], weights=token_logps_BT[has_target], minlength=pbatch.num_docs)
    return sums[: pbatch.num_examples], sums[pbatch.num_examples :]


def token_logps_from_logits(logits_BTV: np.ndarray, pbatch: PreferenceBatch) -> np.ndarray:
    """float64 [B, T]: ``log softmax(logits[b, t])[labels[b, t + 1]]`` at targets, 0 elsewhere."""
    logits_BTV = np.asarray(logits_BTV)
    if logits_BTV.shape[:-1] != pbatch.target_doc_ids.shape:
        raise DataError(
            f"logits shape {logits_BTV.shape} must be [B, T, V] with [B, T] = {pbatch.target_doc_ids.shape}; "
            "pass the logits of this batch."
        )
    return -token_nll(logits_BTV, shift_labels(pbatch.batch.labels))


def sequence_logps_from_logits(logits_BTV: np.ndarray, pbatch: PreferenceBatch) -> tuple[np.ndarray, np.ndarray]:
    """``(chosen_logps [N], rejected_logps [N])`` from model logits: the numpy reference a
    backend's DPO forward must match."""
    return sequence_logps_from_tokens(token_logps_from_logits(logits_BTV, pbatch), pbatch)
