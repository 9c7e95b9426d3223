"""Datasets in, tokenised and truncated rows out: the data side of both trainers.

- ``load_dataset_any(name_or_path, split)`` (``twinseq.common.data_loading``): the embedded
  datasets, local JSONL / JSON / Parquet / CSV files, a folder saved with
  ``Dataset.save_to_disk``, or a Hub name (which needs network; offline it fails at once).
- ``tokenize_sft``: ``prompt``/``completion`` -> ``input_ids`` + ``completion_mask``;
  ``text`` -> ``input_ids``; ``messages`` -> ``input_ids`` + ``assistant_masks`` (chat template).
- ``tokenize_dpo``: ``prompt``/``chosen``/``rejected`` -> ``prompt_input_ids``,
  ``chosen_input_ids``, ``rejected_input_ids``.
- ``prepare_sft_dataset(cfg)`` / ``prepare_dpo_dataset(cfg)``: what a trainer calls.

Truncation rules and drop reasons live in ``twinseq.common.truncation``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional

from twinseq.common.data_loading import as_dataset, from_table, load_dataset_any
from twinseq.common.errors import DataError, DataTypeError
from twinseq.common.tokenizer import TwinseqTokenizer, load_tokenizer, row_name, validate_messages
from twinseq.common.truncation import (DROP_EMPTY_CHOSEN, DROP_EMPTY_COMPLETION, DROP_EMPTY_REJECTED,
                                       DROP_EMPTY_TEXT, DROP_NO_ASSISTANT, DROP_NO_TARGETS, DROP_SAME_PAIR,
                                       DROP_TOO_SHORT, TruncationStats,
                                       check_length, check_truncation_mode, num_targets, truncate_dpo,
                                       truncate_sft)

logger = logging.getLogger(__name__)

CHUNK_ROWS = 1000
PROGRESS_MIN_ROWS = 20_000


# --------------------------------------------------------------------------------------
# Tokenisation helpers
# --------------------------------------------------------------------------------------


def _chunks(ds, progress: Optional[bool], desc: str) -> Iterator[tuple[int, dict]]:
    """(offset, batch dict of lists) over ``ds``, with a tqdm bar for large datasets."""
    from tqdm.auto import tqdm

    show = len(ds) >= PROGRESS_MIN_ROWS if progress is None else progress
    with tqdm(total=len(ds), desc=desc, unit="ex", disable=not show) as bar:
        offset = 0
        for batch in ds.iter(batch_size=CHUNK_ROWS):
            yield offset, batch
            n = len(next(iter(batch.values())))
            offset += n
            bar.update(n)


def _check_strings(values: list, field: str, offset: int, fix: str) -> None:
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise DataTypeError(f"{row_name(offset + i)}: field {field!r} must be a string, got "
                                f"{type(value).__name__} {str(value)[:80]!r}; {fix}")


def _missing_columns(columns: list[str], needed: tuple[str, ...], task: str, example: str) -> None:
    missing = [c for c in needed if c not in columns]
    if missing:
        raise DataError(f"{task} data needs the column(s) {missing}, but the dataset has {sorted(columns)}; "
                        f"rename your columns, e.g. {example}.")


def detect_sft_format(columns: list[str]) -> str:
    """``input_ids`` (pre-tokenised) > ``messages`` > ``prompt_completion`` > ``text``, by the columns present."""
    if "input_ids" in columns:
        return "tokenized"
    if "messages" in columns:
        return "messages"
    if "prompt" in columns or "completion" in columns:
        _missing_columns(columns, ("prompt", "completion"), "prompt/completion SFT",
                         "{'prompt': 'Q', 'completion': 'A'}")
        return "prompt_completion"
    if "text" in columns:
        return "text"
    raise DataError(f"SFT data needs a 'messages', a 'prompt'+'completion' or a 'text' column, but the dataset "
                    f"has {sorted(columns)}; rename your columns (for preference data with "
                    f"prompt/chosen/rejected, use task='dpo').")


def _columns_table(columns: dict[str, list]):
    import pyarrow as pa

    types = {"completion_mask": pa.int8(), "assistant_masks": pa.int8()}
    return pa.table({k: pa.array(v, type=pa.list_(types.get(k, pa.int32()))) for k, v in columns.items()})


# --------------------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------------------


def _encode_prompt_completion(batch: dict, offset: int, tok: TwinseqTokenizer) -> list[Optional[dict]]:
    fix = "conversational prompt/completion is not supported; use a 'messages' column instead."
    _check_strings(batch["prompt"], "prompt", offset, fix)
    _check_strings(batch["completion"], "completion", offset, fix)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    out: list[Optional[dict]] = []
    for p, c, comp in zip(tok.encode_batch(batch["prompt"]), tok.encode_batch(batch["completion"]),
                          batch["completion"]):
        if not comp.strip():
            out.append(None)
            continue
        head, tail = bos + p, c + eos
        out.append({"input_ids": head + tail, "completion_mask": [0] * len(head) + [1] * len(tail)})
    return out


def _encode_text(batch: dict, offset: int, tok: TwinseqTokenizer) -> list[Optional[dict]]:
    _check_strings(batch["text"], "text", offset, "tokenise plain text only.")
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return [{"input_ids": bos + ids + eos} if text.strip() else None
            for ids, text in zip(tok.encode_batch(batch["text"]), batch["text"])]


def _encode_tokenized(batch: dict, offset: int, tok: TwinseqTokenizer) -> list[Optional[dict]]:
    """Pre-tokenised rows (``input_ids``, maybe ``completion_mask``), checked against the vocabulary."""
    out: list[Optional[dict]] = []
    for i, ids in enumerate(batch["input_ids"]):
        where = row_name(offset + i)
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise DataTypeError(f"{where}: input_ids must be a list of integers, got {str(ids)[:80]!r}.")
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise DataError(f"{where}: input_ids hold {bad[0]}, outside the tokenizer's vocabulary [0, "
                            f"{tok.vocab_size}); tokenise with the tokenizer the run uses (tokenizer_name_or_path).")
        row = {"input_ids": list(ids)}
        if "completion_mask" in batch:
            mask = batch["completion_mask"][i]
            if not isinstance(mask, (list, tuple)) or len(mask) != len(ids):
                raise DataError(f"{where}: completion_mask must be a list as long as input_ids ({len(ids)}), got "
                                f"{str(mask)[:80]!r}.")
            row["completion_mask"] = list(mask)
        out.append(row if ids else None)
    return out


def _encode_messages(batch: dict, offset: int, tok: TwinseqTokenizer) -> list[Optional[dict]]:
    out: list[Optional[dict]] = []
    for i, messages in enumerate(batch["messages"]):
        validate_messages(messages, index=offset + i)
        # Arrow structs may carry extra keys (e.g. a null 'name'); the template wants role/content
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        ids, mask = tok.apply_chat_template(clean)
        out.append({"input_ids": ids, "assistant_masks": mask})
    return out


_SFT_COLUMNS = {"prompt_completion": ("input_ids", "completion_mask"), "text": ("input_ids",),
                "messages": ("input_ids", "assistant_masks"), "tokenized": ("input_ids",)}
_ENCODERS: dict[str, Callable] = {"prompt_completion": _encode_prompt_completion, "text": _encode_text,
                                  "messages": _encode_messages, "tokenized": _encode_tokenized}


def _loss_mask_field(fmt: str, completion_only_loss: Optional[bool], assistant_only_loss: bool) -> Optional[str]:
    """The mask the collator will apply, which decides whether a row has any target left."""
    if fmt == "prompt_completion" and completion_only_loss is not False:
        return "completion_mask"
    if fmt == "messages" and assistant_only_loss:
        return "assistant_masks"
    if fmt == "tokenized" and completion_only_loss is not False:
        return "completion_mask"
    return None


def _keep_sft_row(row: dict, mask_field: Optional[str], stats: TruncationStats) -> bool:
    if mask_field == "assistant_masks" and not any(row["assistant_masks"]):
        stats.drop(DROP_NO_ASSISTANT)
        return False
    mask = row.get(mask_field) if mask_field else None
    if num_targets(mask, len(row["input_ids"])) == 0:
        stats.drop(DROP_NO_TARGETS if mask is not None else DROP_TOO_SHORT)
        return False
    return True


def tokenize_sft(dataset: Any, tokenizer: TwinseqTokenizer, *, max_length: Optional[int] = None,
                 truncation_mode: str = "keep_start", completion_only_loss: Optional[bool] = None,
                 assistant_only_loss: bool = False, progress: Optional[bool] = None):
    """Tokenise and truncate SFT data; returns ``(datasets.Dataset, TruncationStats)``.

    prompt/completion: ``[bos] + prompt + completion + [eos]``, ``completion_mask`` 1 on
    completion and eos. ``text``: ``[bos] + text + [eos]``. ``messages``: the chat template,
    with ``assistant_masks``. Rows with no loss target left are dropped and counted (an
    empty completion is always dropped).

    >>> rows, stats = tokenize_sft({"prompt": ["Q"], "completion": ["A"]}, tok)  # doctest: +SKIP
    >>> rows[0]  # doctest: +SKIP
    {'input_ids': [1, <Q>, <A>, 2], 'completion_mask': [0, 0, 1, 1]}
    """
    check_truncation_mode(truncation_mode)
    check_length("max_length", max_length)
    ds = as_dataset(dataset)
    fmt = detect_sft_format(ds.column_names)
    mask_field = _loss_mask_field(fmt, completion_only_loss, assistant_only_loss)
    stats = TruncationStats(task="sft")
    names = _SFT_COLUMNS[fmt] + (("completion_mask",) if fmt == "tokenized" and "completion_mask" in ds.column_names
                                 else ())
    columns: dict[str, list] = {name: [] for name in names}
    empty = DROP_EMPTY_COMPLETION if fmt == "prompt_completion" else DROP_EMPTY_TEXT
    for offset, batch in _chunks(ds, progress, "tokenizing sft"):
        for row in _ENCODERS[fmt](batch, offset, tokenizer):
            if row is None:
                stats.record(0, 0)
                stats.drop(empty)
                continue
            n = len(row["input_ids"])
            row, removed = truncate_sft(row, max_length, truncation_mode)
            stats.record(n, removed)
            if _keep_sft_row(row, mask_field, stats):
                for key, value in row.items():
                    columns[key].append(value)
    return from_table(_columns_table(columns)), stats


# --------------------------------------------------------------------------------------
# DPO
# --------------------------------------------------------------------------------------


def _dpo_row(prompt_ids: list, chosen_ids: list, rejected_ids: list, limits: dict,
             stats: TruncationStats) -> Optional[dict]:
    n = len(prompt_ids) + len(chosen_ids) + len(rejected_ids)
    prompt_ids, chosen_ids, rejected_ids, removed = truncate_dpo(prompt_ids, chosen_ids, rejected_ids, **limits)
    stats.record(n, removed)
    # with an empty prompt the first completion token has nothing to be predicted from
    first = 0 if prompt_ids else 1
    if len(chosen_ids) <= first:
        stats.drop(DROP_EMPTY_CHOSEN)
        return None
    if len(rejected_ids) <= first:
        stats.drop(DROP_EMPTY_REJECTED)
        return None
    return {"prompt_input_ids": prompt_ids, "chosen_input_ids": chosen_ids, "rejected_input_ids": rejected_ids}


def tokenize_dpo(dataset: Any, tokenizer: TwinseqTokenizer, *, max_prompt_length: Optional[int] = None,
                 max_completion_length: Optional[int] = None, max_length: Optional[int] = None,
                 truncation_mode: str = "keep_start", progress: Optional[bool] = None):
    """Tokenise and truncate preference data; returns ``(datasets.Dataset, TruncationStats)``.

    ``prompt_input_ids = [bos] + prompt``, ``chosen_input_ids = chosen + [eos]`` (same for
    rejected), then the DPO truncation rule of ``twinseq.common.truncation.truncate_dpo``.
    ``tokens_seen`` counts the prompt once plus both completions.
    """
    check_truncation_mode(truncation_mode)
    if truncation_mode != "keep_start":
        raise DataError(f"truncation_mode={truncation_mode!r} is not supported for DPO: max_length keeps the "
                        f"start of prompt + completion. To keep the end of the prompt, set max_prompt_length.")
    for name, value in (("max_prompt_length", max_prompt_length), ("max_completion_length", max_completion_length),
                        ("max_length", max_length)):
        check_length(name, value)
    ds = as_dataset(dataset)
    _missing_columns(ds.column_names, ("prompt", "chosen", "rejected"), "DPO",
                     "{'prompt': 'Q', 'chosen': 'good A', 'rejected': 'bad A'}")
    limits = dict(max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                  max_length=max_length)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stats = TruncationStats(task="dpo")
    columns: dict[str, list] = {"prompt_input_ids": [], "chosen_input_ids": [], "rejected_input_ids": []}
    for offset, batch in _chunks(ds, progress, "tokenizing dpo"):
        for field in ("prompt", "chosen", "rejected"):
            _check_strings(batch[field], field, offset, "conversational preference data is not supported; "
                                                         "pass plain strings.")
        encoded = [tokenizer.encode_batch(batch[f]) for f in ("prompt", "chosen", "rejected")]
        for p, c, r, c_text, r_text in zip(*encoded, batch["chosen"], batch["rejected"]):
            if not c_text.strip() or not r_text.strip() or c_text == r_text:
                stats.record(0, 0)
                stats.drop(DROP_EMPTY_COMPLETION if not c_text.strip() or not r_text.strip() else DROP_SAME_PAIR)
                continue
            row = _dpo_row(bos + p, c + eos, r + eos, limits, stats)
            if row is not None:
                for key, value in row.items():
                    columns[key].append(value)
    return from_table(_columns_table(columns)), stats


# --------------------------------------------------------------------------------------
# Trainer entry points
# --------------------------------------------------------------------------------------


def _dataset_name(cfg, task: str) -> str:
    if cfg.data.dataset_name == "embedded":
        return "embedded-preference" if task == "dpo" else "embedded-sft"
    return cfg.data.dataset_name


def _raise_if_empty(rows, stats: TruncationStats, cfg) -> None:
    if len(rows) == 0:
        raise DataError(f"no example of dataset_name={cfg.data.dataset_name!r} survives tokenisation and truncation "
                        f"(max_length={cfg.data.max_length}):\n{stats}\nraise max_length or fix the data.")


def prepare_sft_dataset(cfg) -> tuple[Any, TwinseqTokenizer, TruncationStats]:
    """``TrainConfig`` -> (rows with ``input_ids`` + mask columns, tokenizer, stats). No packing.

    With ``packing`` and a strategy that keeps every token (``bfd_split``, ``wrapped``) the
    rows are not truncated: the packer splits them, which still loses the target at each cut
    (counted in ``PackingStats.num_targets_lost``). Plain ``bfd`` cuts overflow at the start
    of each sequence, which is what ``keep_start`` truncation here does, counted and checked.
    """
    d = cfg.data
    max_length = d.max_length
    if d.packing and d.packing_strategy != "bfd":
        logger.info("packing_strategy=%r keeps every token (not the target at each cut): not truncating to "
                    "max_length before packing", d.packing_strategy)
        max_length = None
    tokenizer = load_tokenizer(d.tokenizer_name_or_path)
    dataset = load_dataset_any(_dataset_name(cfg, "sft"), split=d.dataset_split)
    rows, stats = tokenize_sft(dataset, tokenizer, max_length=max_length, truncation_mode=d.truncation_mode,
                               completion_only_loss=d.completion_only_loss, assistant_only_loss=d.assistant_only_loss,
                               progress=False if cfg.disable_tqdm else None)
    stats.log()
    _raise_if_empty(rows, stats, cfg)
    return rows, tokenizer, stats


def prepare_dpo_dataset(cfg) -> tuple[Any, TwinseqTokenizer, TruncationStats]:
    """``TrainConfig`` -> (rows with prompt/chosen/rejected ``*_input_ids``, tokenizer, stats)."""
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer_name_or_path)
    dataset = load_dataset_any(_dataset_name(cfg, "dpo"), split=d.dataset_split)
    rows, stats = tokenize_dpo(dataset, tokenizer, max_prompt_length=d.max_prompt_length,
                               max_completion_length=d.max_completion_length, max_length=d.max_length,
                               truncation_mode=d.truncation_mode, progress=False if cfg.disable_tqdm else None)
    stats.log()
    _raise_if_empty(rows, stats, cfg)
    return rows, tokenizer, stats


__all__ = ["load_dataset_any", "tokenize_sft", "tokenize_dpo", "prepare_sft_dataset", "prepare_dpo_dataset",
           "detect_sft_format"]
