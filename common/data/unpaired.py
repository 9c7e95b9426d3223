"""Unpaired preference data (KTO): rows of prompt, one completion and a boolean label, to optimizer steps.

Formats (TRL's): unpaired preference, ``prompt``/``completion`` strings or message lists with a boolean ``label``
(True: the completion is desirable); or paired preference (``prompt``/``chosen``/``rejected``, the prompt maybe
implicit), which is unpaired as TRL's ``unpair_preference_dataset`` does: each block of up to 1000 pairs becomes
its chosen rows (label True), then its rejected rows (label False).

Tokenised rows hold ``prompt_input_ids``, ``completion_input_ids``, ``label`` and, for the KL estimate,
``kl_completion_input_ids``: another row's completion, fixed once by TRL's rule, a rotation by one within each
block of ``per_device_train_batch_size`` rows in the dataset's order (row i takes row i-1's completion, the
block's first row its last's). twinseq shuffles rows into micro-batches, so a micro-batch's mismatched pairs are
its rows' prompts with completions of the data set, not of that micro-batch (TRL keeps the data's order for this;
either is an estimate of the same KL). A block of one row pairs the row with itself, as in TRL.

Truncation is DPO's rule with one completion (``truncation.truncate_dpo``); a KL sequence is cut to
``max_length`` at its completion's end. Rows whose completion is left empty are dropped and counted.

A micro-batch is a ``KTOBatch``, the ``PreferenceBatch`` layout with the completions as the first N documents and
the mismatched pairs as the next N (none for ``apo_zero_unpaired``), so the backends' sequence log-probs, live
references and precomputed columns (``ref_logps``, ``ref_KL_logps``: TRL's names) work as for DPO.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from twinseq.common.config import TrainConfig
from twinseq.common.data import formats
from twinseq.common.data.batching import collate
from twinseq.common.data.loading import as_dataset, from_table
from twinseq.common.data.preference_batching import PreferenceBatch, _target_doc_ids
from twinseq.common.data.preference_steps import PreferenceStepIterator
from twinseq.common.data.prepare import (
    CHUNK_ROWS,
    _check_strings,
    _chunks,
    _columns_table,
    _ending,
    _log_format,
    _raise_if_empty,
    _run_dataset,
    _special,
    preference_tokenize_args,
    run_tokenizer,
    tokenize_dpo,
)
from twinseq.common.data.sft_steps import DataState, empty_micro_batch
from twinseq.common.data.tokenizer import TwinseqTokenizer
from twinseq.common.data.truncation import (
    DROP_EMPTY_COMPLETION,
    TruncationStats,
    check_preference_limits,
    truncate_dpo,
)
from twinseq.common.errors import DataError
from twinseq.common.objectives.kto import weight_advice

logger = logging.getLogger(__name__)

UNPAIRED_FIELDS = ("prompt_input_ids", "completion_input_ids", "label")
KL_FIELD = "kl_completion_input_ids"
UNCUT_FIELD = "uncut_completion_input_ids"
REF_FIELDS = ("ref_logps", "ref_KL_logps")
UNPAIRED, CONVERSATIONAL_UNPAIRED = "unpaired_preference", "conversational_unpaired_preference"
_DESCRIPTIONS = {
    UNPAIRED: "standard unpaired preference ('prompt'/'completion' strings, boolean 'label')",
    CONVERSATIONAL_UNPAIRED: "conversational unpaired preference ('prompt'/'completion' message lists, boolean "
    "'label', chat template)",
}
_UNPAIRED_FIX = (
    "pass strings in both 'prompt' and 'completion' (standard), or lists of {'role', 'content'} messages in both "
    "(conversational)."
)


def detect_kto_format(columns: list[str], kinds: Optional[dict[str, str]] = None) -> str:
    """Unpaired (standard or conversational), or a paired preference format (``formats.detect_dpo_format``)."""
    kinds = kinds or {}
    if "chosen" in columns or "rejected" in columns:
        return formats.detect_dpo_format(columns, kinds)
    missing = [c for c in ("prompt", "completion", "label") if c not in columns]
    if missing:
        raise DataError(
            f"KTO data needs the columns 'prompt', 'completion' and a boolean 'label' (unpaired), or "
            f"'prompt'/'chosen'/'rejected' (paired, unpaired as TRL does), but the dataset has {sorted(columns)} "
            f"and lacks {missing}; rename your columns, e.g. {{'prompt': 'Q', 'completion': 'A', 'label': True}}."
        )
    conversational = formats._conversational(kinds, ("prompt", "completion"))
    return CONVERSATIONAL_UNPAIRED if conversational else UNPAIRED


def _check_labels(values: list, offset: int) -> None:
    for i, v in enumerate(values):
        if not isinstance(v, (bool, np.bool_)):
            raise DataError(
                f"row {offset + i}: label={v!r} ({type(v).__name__}) must be a bool (True: the completion is "
                f"desirable, False: undesirable); convert the column, e.g. label = (score > 0)."
            )


def _encode_unpaired(batch: dict, offset: int, tok: TwinseqTokenizer, conversational: bool) -> list:
    """A chunk of unpaired rows -> (prompt ids, completion ids, label) or a drop reason, per row."""
    _check_labels(batch["label"], offset)
    if not conversational:
        _check_strings(batch["prompt"], "prompt", offset, _UNPAIRED_FIX)
        _check_strings(batch["completion"], "completion", offset, _UNPAIRED_FIX)
        bos, eos = _special(tok)
        out: list = []
        for p, c, text, label in zip(
            tok.encode_batch(batch["prompt"]),
            tok.encode_batch(batch["completion"]),
            batch["completion"],
            batch["label"],
        ):
            out.append(
                DROP_EMPTY_COMPLETION if not text.strip() else (bos + p, _ending(c, eos, tok.eos_token_id), label)
            )
        return out
    texts: list = []
    for i, (prompt, completion) in enumerate(zip(batch["prompt"], batch["completion"])):
        prompt = tok.validate_messages(prompt, offset + i, "prompt")
        completion = tok.validate_messages(completion, offset + i, "completion")
        texts.append(
            DROP_EMPTY_COMPLETION
            if formats.is_empty_conversation(completion)
            else tok.render_prompt_completion(prompt, completion, offset + i)
        )
    kept = [t for t in texts if not isinstance(t, str)]
    p_ids, c_ids = tok.encode_batch([t[0] for t in kept]), tok.encode_batch([t[1] for t in kept])
    encoded = iter(zip(p_ids, c_ids, [lab for t, lab in zip(texts, batch["label"]) if not isinstance(t, str)]))
    return [t if isinstance(t, str) else next(encoded) for t in texts]


def unpair_rows(paired: Any) -> dict[str, list]:
    """Tokenised preference rows -> unpaired columns, TRL's order: per block of up to 1000 pairs, the chosen rows
    (label True), then the rejected rows (label False)."""
    prompts, chosen, rejected = (
        list(paired[f]) for f in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
    )
    out: dict[str, list] = {f: [] for f in UNPAIRED_FIELDS}
    for start in range(0, len(prompts), CHUNK_ROWS):
        block = slice(start, start + CHUNK_ROWS)
        for side, label in ((chosen, True), (rejected, False)):
            out["prompt_input_ids"] += prompts[block]
            out["completion_input_ids"] += side[block]
            out["label"] += [label] * len(prompts[block])
    return out


def add_kl_completions(columns: dict[str, list], block: int) -> dict[str, list]:
    """``columns`` plus ``kl_completion_input_ids``: each block of ``block`` rows' completions rotated by one. The
    completions rotated are the ones before the ``max_length`` cut (``UNCUT_FIELD``, when ``tokenize_kto`` kept
    them, and dropped here): a mismatched pair is cut for its own prompt (``kl_sequence``), as TRL's collator cuts
    it, not for the prompt its completion came with."""
    columns = dict(columns)
    completions = columns.pop(UNCUT_FIELD, None) or columns["completion_input_ids"]
    kl: list = []
    for start in range(0, len(completions), block):
        part = completions[start : start + block]
        kl += part[-1:] + part[:-1]
    return {**columns, KL_FIELD: kl}


def _cut_rows(rows: list[tuple[list, list, bool, int]], max_length: Optional[int], stats: TruncationStats) -> dict:
    """Unpaired rows (prompt, completion, label), already cut by ``max_prompt_length`` / ``max_completion_length``,
    cut to ``max_length`` (keep the start of prompt + completion, TRL's collator); a row left without a scored
    completion token is dropped and counted. The columns keep each completion before this cut (``UNCUT_FIELD``).
    Each row's fourth item is the tokens the first cut removed, recorded with this one's."""
    columns: dict[str, list] = {f: [] for f in (*UNPAIRED_FIELDS, UNCUT_FIELD)}
    for prompt, completion, label, removed_before in rows:
        cut_prompt, cut, _, removed = truncate_dpo(prompt, completion, [], max_length=max_length)
        stats.record(len(prompt) + len(completion) + removed_before, removed_before + removed)
        if len(cut) <= (0 if cut_prompt else 1):  # an empty prompt leaves the first token unscored
            stats.drop(DROP_EMPTY_COMPLETION)
            continue
        for key, value in zip((*UNPAIRED_FIELDS, UNCUT_FIELD), (cut_prompt, cut, bool(label), completion)):
            columns[key].append(value)
    return columns


def tokenize_kto(
    dataset: Any,
    tokenizer: TwinseqTokenizer,
    *,
    max_prompt_length: Optional[int] = None,
    max_completion_length: Optional[int] = None,
    max_length: Optional[int] = None,
    truncation_mode: str = "keep_start",
    progress: Optional[bool] = None,
) -> tuple[dict[str, list], TruncationStats]:
    """Tokenise and truncate KTO data: columns ``prompt_input_ids``, ``completion_input_ids``, ``label`` (and
    ``UNCUT_FIELD``, each completion before the ``max_length`` cut, which ``add_kl_completions`` reads and drops).

    Standard rows: ``[bos] + prompt`` and ``completion + [eos]`` (as DPO); conversational: the prompt rendered
    with the generation prompt and the completion the rest of the rendered conversation. Paired data goes
    through ``tokenize_dpo`` (its drops are counted per pair) and is then unpaired (``unpair_rows``). The stats
    count rows: a row is cut by ``max_prompt_length`` / ``max_completion_length`` (the end of the prompt, the start
    of the completion), then prompt + completion to ``max_length``.
    """
    check_preference_limits(
        "KTO",
        truncation_mode,
        max_prompt_length=max_prompt_length,
        max_completion_length=max_completion_length,
        max_length=max_length,
    )
    ds = as_dataset(dataset)
    fmt = detect_kto_format(ds.column_names, formats.column_kinds(ds))
    stats = TruncationStats(task="kto")
    rows: list[tuple[list, list, bool, int]] = []
    if fmt not in _DESCRIPTIONS:
        paired, pair_stats = tokenize_dpo(
            ds,
            tokenizer,
            max_prompt_length=max_prompt_length,
            max_completion_length=max_completion_length,
            progress=progress,
        )
        for reason, count in pair_stats.dropped.items():  # a dropped pair is two rows that never were
            stats.examples_seen += 2 * count
            stats.dropped[f"{reason} (pairs, 2 rows each)"] += 2 * count
        logger.info(
            "kto: %d preference pairs unpaired into %d rows (TRL's unpair_preference_dataset)",
            len(paired),
            2 * len(paired),
        )
        unpaired = unpair_rows(paired)
        rows = [(p, c, lab, 0) for p, c, lab in zip(*(unpaired[f] for f in UNPAIRED_FIELDS))]
        # tokens cut by max_prompt_length / max_completion_length: tokenize_dpo's count (the prompt once per pair)
        stats.tokens_seen += pair_stats.tokens_truncated
        stats.tokens_truncated += pair_stats.tokens_truncated
        return _cut_rows(rows, max_length, stats), stats
    logger.info("kto data format: %s", _DESCRIPTIONS[fmt])
    if fmt == CONVERSATIONAL_UNPAIRED:
        _log_format("kto", formats.CONVERSATIONAL_PROMPT_COMPLETION, tokenizer)
    for offset, batch in _chunks(ds, progress, "tokenizing kto"):
        for row in _encode_unpaired(batch, offset, tokenizer, fmt == CONVERSATIONAL_UNPAIRED):
            if isinstance(row, str):
                stats.record(0, 0)
                stats.drop(row)
                continue
            prompt, completion, label = row
            prompt, completion, _, removed = truncate_dpo(
                prompt, completion, [], max_prompt_length=max_prompt_length, max_completion_length=max_completion_length
            )
            rows.append((prompt, completion, label, removed))
    return _cut_rows(rows, max_length, stats), stats


def prepare_kto_dataset(
    cfg: TrainConfig, dataset: Any = None, tokenizer: Any = None, *, held_out: bool = False
) -> tuple[Any, TwinseqTokenizer, TruncationStats]:
    """``TrainConfig`` -> (rows with the unpaired columns and, for 'kto', ``kl_completion_input_ids``, tokenizer,
    stats). Logs TRL's weight advice when the labels are unbalanced."""
    tokenizer = run_tokenizer(cfg, tokenizer)
    dataset = as_dataset(dataset, "eval_dataset") if held_out else _run_dataset(cfg, "kto", dataset)
    columns, stats = tokenize_kto(dataset, tokenizer, **preference_tokenize_args(cfg))
    stats.log()
    if cfg.kto.kto_loss_type == "kto":
        columns = add_kl_completions(columns, cfg.data.per_device_train_batch_size)
    columns.pop(UNCUT_FIELD, None)  # apo_zero_unpaired: no mismatched pairs to build
    labels = columns.pop("label")
    rows = from_table(_columns_table(columns).append_column("label", pa.array(labels, pa.bool_())))
    columns["label"] = labels
    _raise_if_empty(rows, stats, cfg)
    advice = None if held_out else weight_advice(columns["label"], cfg.kto.desirable_weight, cfg.kto.undesirable_weight)
    if advice:
        logger.warning("kto: %s", advice)
    return rows, tokenizer, stats


# --------------------------------------------------------------------------------------
# Micro-batches
# --------------------------------------------------------------------------------------


@dataclass
class KTOBatch(PreferenceBatch):
    """A ``PreferenceBatch`` of N completions then M mismatched pairs (M = N, or 0 without the KL term);
    ``ref_chosen_logps`` / ``ref_rejected_logps`` hold the precomputed ``ref_logps`` / ``ref_KL_logps``."""

    labels: np.ndarray = None  # type: ignore[assignment]  # bool [N]
    num_kl: int = 0

    @property
    def num_docs(self) -> int:
        return self.num_examples + self.num_kl


def kl_sequence(prompt: np.ndarray, completion: np.ndarray, max_length: Optional[int]) -> np.ndarray:
    """The mismatched completion, cut so that prompt + completion fits ``max_length`` (kept rows' prompts are
    shorter than it, so one completion token always remains)."""
    return completion if max_length is None else completion[: max(max_length - len(prompt), 1)]


def collate_unpaired(
    examples: list[dict[str, Any]],
    *,
    with_kl: bool,
    max_length: Optional[int] = None,
    padding_free: bool = False,
    pad_token_id: int = 0,
    pad_to_multiple_of: Optional[int] = None,
) -> KTOBatch:
    """Collate unpaired rows (``UNPAIRED_FIELDS``, with ``kl_completion_input_ids`` when ``with_kl``) into a
    ``KTOBatch``: every completion, then every mismatched pair, each its own document."""
    if not examples:
        raise DataError(
            f"collate_unpaired() needs a non-empty list of tokenised KTO rows, got {type(examples).__name__} of "
            f"length 0; pass at least one row."
        )
    docs = []
    for i, ex in enumerate(examples):
        prompt = np.asarray(ex["prompt_input_ids"], np.int64)
        completion = np.asarray(ex["completion_input_ids"], np.int64)
        if completion.size == 0:
            raise DataError(f"row {i}: 'completion_input_ids' is empty; drop such rows (prepare_kto_dataset does).")
        docs.append((prompt, completion))
    if with_kl:
        for ex in examples:
            prompt = np.asarray(ex["prompt_input_ids"], np.int64)
            docs.append((prompt, kl_sequence(prompt, np.asarray(ex[KL_FIELD], np.int64), max_length)))
    documents = [
        {
            "input_ids": np.concatenate([p, c]),
            "completion_mask": np.r_[np.zeros(p.size, np.int64), np.ones(c.size, np.int64)],
        }
        for p, c in docs
    ]
    batch = collate(
        documents,
        padding_free=padding_free,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        completion_only_loss=True,
    )
    n, m = len(examples), len(examples) if with_kl else 0
    target_doc_ids = _target_doc_ids(batch)
    counts = np.bincount(target_doc_ids[target_doc_ids >= 0], minlength=n + m).astype(np.int32)
    if (counts == 0).any():
        raise DataError(
            f"row {int(np.argmin(counts)) % n}: a sequence has no scored completion token (an empty prompt leaves a "
            f"1-token completion unscored); give it a prompt, e.g. a BOS token."
        )
    refs = [np.array([float(ex[f]) for ex in examples]) if f in examples[0] else None for f in REF_FIELDS]
    return KTOBatch(
        batch=batch,
        num_examples=n,
        doc_example_index=np.r_[np.arange(n), np.arange(m)].astype(np.int32),
        doc_is_chosen=np.r_[np.ones(n, bool), np.zeros(m, bool)],
        target_doc_ids=target_doc_ids,
        num_target_tokens=counts,
        ref_chosen_logps=refs[0],
        ref_rejected_logps=refs[1] if with_kl else (None if refs[0] is None else np.zeros(0)),
        labels=np.array([bool(ex["label"]) for ex in examples]),
        num_kl=m,
    )


def _columns(rows: Any) -> dict[str, list]:
    names = list(rows.column_names) if hasattr(rows, "column_names") else list(rows)
    missing = [f for f in UNPAIRED_FIELDS if f not in names]
    if missing:
        raise DataError(
            f"KTO rows lack the column(s) {missing} (columns: {sorted(names)}); tokenise with "
            f"twinseq.common.data.unpaired.prepare_kto_dataset first."
        )
    out: dict[str, list] = {f: [np.asarray(v) for v in rows[f]] for f in UNPAIRED_FIELDS if f != "label"}
    out["label"] = [bool(v) for v in rows["label"]]
    for f in (KL_FIELD, *REF_FIELDS):
        if f in names:
            out[f] = [np.asarray(v) for v in rows[f]] if f == KL_FIELD else [float(v) for v in rows[f]]
    return out


class KTOStepIterator(PreferenceStepIterator):
    """Per optimizer step, this rank's ``gradient_accumulation_steps`` ``KTOBatch`` micro-batches: DPO's step
    iterator (shuffling, epochs, the resumable position, ``num_examples_in_step`` the rows of the whole step, the
    denominator of each micro-batch's loss) over unpaired rows."""

    def __init__(
        self, rows: Any, cfg: TrainConfig, pad_token_id: int, *, with_kl: bool, world_size: int = 1, rank: int = 0
    ) -> None:
        if cfg.data.packing:
            raise DataError(
                "packing=True does not apply to KTO (a row's completion and its mismatched pair are scored "
                "separately); use --padding-free to put a micro-batch's sequences in one row."
            )
        self.cfg, self.pad_token_id, self.with_kl = cfg, pad_token_id, with_kl
        self.world_size, self.rank, self.seed = world_size, rank, cfg.seed
        self.columns = _columns(rows)
        if with_kl and KL_FIELD not in self.columns:
            raise DataError(
                f"kto_loss_type='kto' needs the column {KL_FIELD!r} (the mismatched completions), and the rows have "
                f"{sorted(self.columns)}; prepare the rows with prepare_kto_dataset under the same config, or use "
                f"--kto-loss-type apo_zero_unpaired."
            )
        self.num_rows = len(self.columns["label"])
        if self.num_rows == 0:
            raise DataError(
                f"the KTO data of dataset_name={cfg.data.dataset_name!r} is empty after tokenisation; check "
                f"dataset_name and max_length."
            )
        self.state = DataState()
        self._order = self._permutation(0)

    @property
    def has_ref_logps(self) -> bool:
        return REF_FIELDS[0] in self.columns

    def _collate_pairs(self, idx: np.ndarray) -> KTOBatch:
        c = self.cfg.data
        return collate_unpaired(
            [self._example(i) for i in idx],
            with_kl=self.with_kl,
            max_length=c.max_length,
            padding_free=c.padding_free,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=c.pad_to_multiple_of,
        )

    def _empty_pairs(self) -> KTOBatch:
        batch = empty_micro_batch(self.pad_token_id, 0, self.cfg.data.pad_to_multiple_of)
        ref = np.zeros(0) if self.has_ref_logps else None
        return KTOBatch(
            batch=batch,
            num_examples=0,
            doc_example_index=np.zeros(0, np.int32),
            doc_is_chosen=np.zeros(0, bool),
            target_doc_ids=np.full(batch.shape, -1, np.int32),
            num_target_tokens=np.zeros(0, np.int32),
            ref_chosen_logps=ref,
            ref_rejected_logps=ref,
            labels=np.zeros(0, bool),
        )


def iter_unpaired_batches(rows: Any, batch_size: int, *, with_kl: bool, cfg: TrainConfig, pad_token_id: int):
    """Every row once, in order, ``batch_size`` rows at a time: ``(row_indices, KTOBatch)`` (to precompute the
    reference's log-probs; reference columns already present are not carried)."""
    columns = {k: v for k, v in _columns(rows).items() if k not in REF_FIELDS}
    n = len(columns["label"])
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        yield (
            idx,
            collate_unpaired(
                [{k: v[i] for k, v in columns.items()} for i in idx],
                with_kl=with_kl,
                max_length=cfg.data.max_length,
                padding_free=cfg.data.padding_free,
                pad_token_id=pad_token_id,
                pad_to_multiple_of=cfg.data.pad_to_multiple_of,
            ),
        )


def with_kto_ref_logps(rows: Any, ref_logps: np.ndarray, ref_kl_logps: Optional[np.ndarray]) -> Any:
    """``rows`` (a ``datasets.Dataset``) plus ``ref_logps`` and, with the KL term, ``ref_KL_logps`` columns."""
    for name, values in (("ref_logps", ref_logps), ("ref_KL_logps", ref_kl_logps)):
        if values is None:
            continue
        values = np.asarray(values, np.float64)
        if values.shape != (len(rows),) or not np.isfinite(values).all():
            raise DataError(
                f"{name} must hold one finite value per row ({len(rows)}), got shape {values.shape}; pass the "
                f"reference's sequence log-probs of these rows, in order."
            )
        if name in rows.column_names:
            rows = rows.remove_columns([name])
        rows = rows.add_column(name, values.tolist())
    return rows


def build_kto_iterator(
    cfg: TrainConfig, rows: Any, pad_token_id: int, *, with_kl: bool, world_size: int = 1, rank: int = 0
) -> KTOStepIterator:
    iterator = KTOStepIterator(rows, cfg, pad_token_id, with_kl=with_kl, world_size=world_size, rank=rank)
    if cfg.dpo.precompute_ref_log_probs and not iterator.has_ref_logps:
        raise DataError(
            "precompute_ref_log_probs=True but the KTO rows carry no ref_logps; compute them first (the backends' "
            "precompute_kto_ref_logps does)."
        )
    labels = np.asarray(iterator.columns["label"])
    logger.info(
        "KTO data: %d rows (%d desirable, %d undesirable), %d rows per optimizer step, %d steps per epoch",
        iterator.num_rows,
        int(labels.sum()),
        int((~labels).sum()),
        iterator.examples_per_step,
        iterator.steps_per_epoch,
    )
    return iterator
