"""Datasets in, tokenised and truncated rows out: the data side of both trainers.

- ``load_dataset_any(name_or_path, split)`` (``twinseq.common.data.loading``): the embedded
  datasets, local JSONL / JSON / Parquet / CSV files, a folder saved with
  ``Dataset.save_to_disk``, or a Hub name (which needs network; offline it fails at once).
- ``tokenize_sft``: ``prompt``/``completion`` (strings or message lists) -> ``input_ids`` +
  ``completion_mask``; ``text`` -> ``input_ids``; ``messages`` -> ``input_ids`` +
  ``assistant_masks`` (chat template).
- ``tokenize_dpo``: ``prompt``/``chosen``/``rejected`` (strings or message lists; ``prompt``
  may be implicit) -> ``prompt_input_ids``, ``chosen_input_ids``, ``rejected_input_ids``.
- ``prepare_sft_dataset(cfg)`` / ``prepare_dpo_dataset(cfg)``: what a trainer calls.

Which columns make which format is ``twinseq.common.data.formats`` (TRL's format table); chat
rendering is ``twinseq.common.data.chat``; truncation rules and drop reasons live in
``twinseq.common.data.truncation``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from twinseq.common.data import formats
from twinseq.common.data.chat import row_name
from twinseq.common.data.formats import detect_dpo_format, detect_sft_format
from twinseq.common.data.loading import as_dataset, from_table, load_dataset_any, resolve_dataset, split_off_eval
from twinseq.common.data.tokenizer import TwinseqTokenizer, load_tokenizer, tokenizer_from
from twinseq.common.data.truncation import (
    DROP_EMPTY_CHOSEN,
    DROP_EMPTY_COMPLETION,
    DROP_EMPTY_REJECTED,
    DROP_EMPTY_TEXT,
    DROP_NO_ASSISTANT,
    DROP_NO_TARGETS,
    DROP_SAME_PAIR,
    DROP_TOO_SHORT,
    TruncationStats,
    check_length,
    check_preference_limits,
    check_truncation_mode,
    num_targets,
    truncate_dpo,
    truncate_sft,
)
from twinseq.common.errors import DataError, DataTypeError
from twinseq.common.tasks import task_spec

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
            raise DataTypeError(
                f"{row_name(offset + i)}: field {field!r} must be a string, got "
                f"{type(value).__name__} {str(value)[:80]!r}; {fix}"
            )


def _columns_table(columns: dict[str, list]):
    import pyarrow as pa

    types = {"completion_mask": pa.int8(), "assistant_masks": pa.int8()}
    return pa.table({k: pa.array(v, type=pa.list_(types.get(k, pa.int32()))) for k, v in columns.items()})


def _special(tok: TwinseqTokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) a plain text: what ``tokenizer(text)`` adds around it (``text_affixes``: Llama's
    bos, nothing for Qwen), with eos after the text as TRL appends it (once: not again when the tokenizer's own
    suffix holds it)."""
    before, after = tok.text_affixes
    eos = tok.eos_token_id
    return before, after if eos is None or eos in after else [eos] + after


def _ending(ids: list[int], after: list[int], eos: Optional[int]) -> list[int]:
    """``ids + after``, less the eos ``after`` starts with when the text already ends with it (TRL appends
    ``eos_token`` to a text that does not end with it)."""
    if eos is not None and ids[-1:] == [eos] and after[:1] == [eos]:
        after = after[1:]
    return ids + after


def _log_format(task: str, fmt: str, tok: TwinseqTokenizer) -> None:
    template = f"; chat template from {tok.chat_template_source}" if fmt in formats.CONVERSATIONAL else ""
    logger.info("%s data format: %s%s", task, formats.DESCRIPTIONS[fmt], template)


# --------------------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------------------

# An encoder turns a chunk of rows into one entry per row: the tokenised columns, or the
# reason the row is dropped (a key of TruncationStats.dropped).
Encoded = list[Union[dict, str]]
_MIXED_FIX = (
    "pass strings in both 'prompt' and 'completion' (standard), or lists of {'role', 'content'} "
    "messages in both (conversational; or one 'messages' column with the whole conversation)."
)


def _encode_prompt_completion(batch: dict, offset: int, tok: TwinseqTokenizer, _: bool) -> Encoded:
    _check_strings(batch["prompt"], "prompt", offset, _MIXED_FIX)
    _check_strings(batch["completion"], "completion", offset, _MIXED_FIX)
    bos, eos = _special(tok)
    out: Encoded = []
    for p, c, comp in zip(
        tok.encode_batch(batch["prompt"]), tok.encode_batch(batch["completion"]), batch["completion"]
    ):
        if not comp.strip():
            out.append(DROP_EMPTY_COMPLETION)
            continue
        head, tail = bos + p, _ending(c, eos, tok.eos_token_id)
        out.append({"input_ids": head + tail, "completion_mask": [0] * len(head) + [1] * len(tail)})
    return out


def _encode_conversational_prompt_completion(
    batch: dict, offset: int, tok: TwinseqTokenizer, assistant_masks: bool
) -> Encoded:
    """Prompt and completion message lists -> ``input_ids`` = prompt ids + completion ids.

    The prompt text (``render_prompt``) and the completion text (the rest of the rendered
    conversation) are tokenised separately, so the prompt ids are the ids a generation call
    starts from; ``completion_mask`` is 1 on the completion ids. No bos/eos is added: the
    template writes them.
    """
    out: Encoded = []
    for i, (prompt, completion) in enumerate(zip(batch["prompt"], batch["completion"])):
        index = offset + i
        prompt = tok.validate_messages(prompt, index, "prompt")
        completion = tok.validate_messages(completion, index, "completion")
        if formats.is_empty_conversation(completion):
            out.append(DROP_EMPTY_COMPLETION)
            continue
        prompt_text, completion_text = tok.render_prompt_completion(prompt, completion, index)
        spans = tok.render_chat(prompt + completion, index=index, field="completion")[1] if assistant_masks else ()
        (p_ids, c_ids), mask = tok.encode_with_spans([prompt_text, completion_text], spans)
        row = {"input_ids": p_ids + c_ids, "completion_mask": [0] * len(p_ids) + [1] * len(c_ids)}
        if assistant_masks:
            row["assistant_masks"] = mask
        out.append(row)
    return out


def _encode_text(batch: dict, offset: int, tok: TwinseqTokenizer, _: bool) -> Encoded:
    _check_strings(batch["text"], "text", offset, "tokenise plain text only.")
    bos, eos = _special(tok)
    return [
        {"input_ids": bos + _ending(ids, eos, tok.eos_token_id)} if text.strip() else DROP_EMPTY_TEXT
        for ids, text in zip(tok.encode_batch(batch["text"]), batch["text"])
    ]


def _encode_tokenized(batch: dict, offset: int, tok: TwinseqTokenizer, _: bool) -> Encoded:
    """Pre-tokenised rows (``input_ids``, maybe ``completion_mask``), checked against the vocabulary."""
    out: Encoded = []
    for i, ids in enumerate(batch["input_ids"]):
        where = row_name(offset + i)
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise DataTypeError(
                f"{where}: input_ids must be a list of integers, got {str(ids)[:80]!r}; tokenise the text, or "
                "give a 'text' column instead."
            )
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise DataError(
                f"{where}: input_ids hold {bad[0]}, outside the tokenizer's vocabulary [0, "
                f"{tok.vocab_size}); tokenise with the tokenizer the run uses (tokenizer_name_or_path)."
            )
        row = {"input_ids": list(ids)}
        if "completion_mask" in batch:
            mask = batch["completion_mask"][i]
            if not isinstance(mask, (list, tuple)) or len(mask) != len(ids):
                raise DataError(
                    f"{where}: completion_mask must be a list as long as input_ids ({len(ids)}), got "
                    f"{str(mask)[:80]!r}; give one 0/1 per token, or drop the column."
                )
            row["completion_mask"] = list(mask)
        out.append(row if ids else DROP_EMPTY_TEXT)
    return out


def _encode_messages(batch: dict, offset: int, tok: TwinseqTokenizer, _: bool) -> Encoded:
    out: Encoded = []
    for i, messages in enumerate(batch["messages"]):
        ids, mask = tok.apply_chat_template(messages, index=offset + i)
        out.append({"input_ids": ids, "assistant_masks": mask})
    return out


_ENCODERS: dict[str, Callable] = {
    formats.PROMPT_COMPLETION: _encode_prompt_completion,
    formats.TEXT: _encode_text,
    formats.MESSAGES: _encode_messages,
    formats.TOKENIZED: _encode_tokenized,
    formats.CONVERSATIONAL_PROMPT_COMPLETION: _encode_conversational_prompt_completion,
}


def _sft_columns(fmt: str, column_names: list[str], assistant_only_loss: bool) -> tuple[str, ...]:
    if fmt == formats.TEXT:
        return ("input_ids",)
    if fmt == formats.MESSAGES:
        return ("input_ids", "assistant_masks")
    if fmt == formats.TOKENIZED:
        return ("input_ids",) + (("completion_mask",) if "completion_mask" in column_names else ())
    extra = ("assistant_masks",) if fmt == formats.CONVERSATIONAL_PROMPT_COMPLETION and assistant_only_loss else ()
    return ("input_ids", "completion_mask") + extra


def _loss_mask_fields(fmt: str, completion_only_loss: Optional[bool], assistant_only_loss: bool) -> tuple[str, ...]:
    """The masks the collator will apply, which decide whether a row has any target left."""
    fields: tuple[str, ...] = ()
    if (
        fmt in (formats.PROMPT_COMPLETION, formats.CONVERSATIONAL_PROMPT_COMPLETION, formats.TOKENIZED)
        and completion_only_loss is not False
    ):
        fields += ("completion_mask",)
    if fmt in (formats.MESSAGES, formats.CONVERSATIONAL_PROMPT_COMPLETION) and assistant_only_loss:
        fields += ("assistant_masks",)
    return fields


def _keep_sft_row(row: dict, mask_fields: tuple[str, ...], stats: TruncationStats) -> bool:
    if "assistant_masks" in mask_fields and not any(row["assistant_masks"]):
        stats.drop(DROP_NO_ASSISTANT)
        return False
    masks = [row[f] for f in mask_fields if f in row]
    mask = [min(bits) for bits in zip(*masks)] if masks else None
    if num_targets(mask, len(row["input_ids"])) == 0:
        stats.drop(DROP_NO_TARGETS if mask is not None else DROP_TOO_SHORT)
        return False
    return True


def tokenize_sft(
    dataset: Any,
    tokenizer: TwinseqTokenizer,
    *,
    max_length: Optional[int] = None,
    truncation_mode: str = "keep_start",
    completion_only_loss: Optional[bool] = None,
    assistant_only_loss: bool = False,
    progress: Optional[bool] = None,
):
    """Tokenise and truncate SFT data; returns ``(datasets.Dataset, TruncationStats)``.

    Formats (``twinseq.common.data.formats``): standard prompt/completion gives
    ``[bos] + prompt + completion + [eos]`` with ``completion_mask`` 1 on completion and
    eos; ``text`` gives ``[bos] + text + [eos]`` (``[bos]``: the special ids ``tokenizer(text)`` adds,
    ``TwinseqTokenizer.text_affixes``, none for a tokenizer that adds none); ``messages`` the chat template with
    ``assistant_masks``; conversational prompt/completion the chat template with
    ``completion_mask`` 1 on the completion (and ``assistant_masks`` when
    ``assistant_only_loss``). Rows with no loss target left are dropped and counted (an
    empty completion is always dropped).

    >>> rows, stats = tokenize_sft({"prompt": ["Q"], "completion": ["A"]}, tok)  # doctest: +SKIP
    >>> rows[0]  # doctest: +SKIP
    {'input_ids': [1, <Q>, <A>, 2], 'completion_mask': [0, 0, 1, 1]}
    """
    check_truncation_mode(truncation_mode)
    check_length("max_length", max_length)
    ds = as_dataset(dataset)
    fmt = formats.detect_sft_format(ds.column_names, formats.column_kinds(ds))
    _log_format("sft", fmt, tokenizer)
    mask_fields = _loss_mask_fields(fmt, completion_only_loss, assistant_only_loss)
    stats = TruncationStats(task="sft")
    columns: dict[str, list] = {name: [] for name in _sft_columns(fmt, ds.column_names, assistant_only_loss)}
    for offset, batch in _chunks(ds, progress, "tokenizing sft"):
        for row in _ENCODERS[fmt](batch, offset, tokenizer, assistant_only_loss):
            if isinstance(row, str):
                stats.record(0, 0)
                stats.drop(row)
                continue
            n = len(row["input_ids"])
            row, removed = truncate_sft(row, max_length, truncation_mode)
            stats.record(n, removed)
            if _keep_sft_row(row, mask_fields, stats):
                for key, value in row.items():
                    columns[key].append(value)
    return from_table(_columns_table(columns)), stats


# --------------------------------------------------------------------------------------
# DPO
# --------------------------------------------------------------------------------------


def _dpo_row(
    prompt_ids: list, chosen_ids: list, rejected_ids: list, limits: dict, stats: TruncationStats
) -> Optional[dict]:
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


_PREFERENCE_FIX = (
    "pass strings in every one of 'prompt', 'chosen' and 'rejected' (standard), or lists of "
    "{'role', 'content'} messages in every one (conversational)."
)


def _standard_preference(batch: dict, offset: int, implicit: bool) -> list[Union[tuple[str, str, str], str]]:
    """String rows -> ``(prompt, chosen, rejected)`` texts or a drop reason; extracts implicit prompts."""
    fields = ("chosen", "rejected") if implicit else ("prompt", "chosen", "rejected")
    for field in fields:
        _check_strings(batch[field], field, offset, _PREFERENCE_FIX)
    out: list[Union[tuple[str, str, str], str]] = []
    for i, (chosen, rejected) in enumerate(zip(batch["chosen"], batch["rejected"])):
        if not chosen.strip() or not rejected.strip():
            out.append(DROP_EMPTY_COMPLETION)
        elif chosen == rejected:
            out.append(DROP_SAME_PAIR)
        elif implicit:
            out.append(formats.split_implicit_prompt(chosen, rejected, offset + i))
        else:
            out.append((batch["prompt"][i], chosen, rejected))
    return out


def _conversational_preference(
    batch: dict, offset: int, tok: TwinseqTokenizer, implicit: bool
) -> list[Union[tuple[str, str, str], str]]:
    prompts = [None] * len(batch["chosen"]) if implicit else batch["prompt"]
    return [
        formats.conversational_preference(tok, p, c, r, offset + i, DROP_EMPTY_COMPLETION, DROP_SAME_PAIR)
        for i, (p, c, r) in enumerate(zip(prompts, batch["chosen"], batch["rejected"]))
    ]


def tokenize_dpo(
    dataset: Any,
    tokenizer: TwinseqTokenizer,
    *,
    max_prompt_length: Optional[int] = None,
    max_completion_length: Optional[int] = None,
    max_length: Optional[int] = None,
    truncation_mode: str = "keep_start",
    progress: Optional[bool] = None,
):
    """Tokenise and truncate preference data; returns ``(datasets.Dataset, TruncationStats)``.

    Standard (strings): ``prompt_input_ids = [bos] + prompt``, ``chosen_input_ids = chosen +
    [eos]`` (same for rejected; no second eos after a text that ends with it, as TRL). Conversational (message
    lists): the prompt rendered with the generation prompt, and each completion the rest of its rendered
    conversation, with no bos/eos added (the template writes its own). Without a ``prompt`` column the prompt
    is the shared start of chosen and rejected. Then the DPO truncation rule of
    ``twinseq.common.data.truncation.truncate_dpo``. ``tokens_seen`` counts the prompt once plus
    both completions.
    """
    check_preference_limits(
        "DPO",
        truncation_mode,
        max_prompt_length=max_prompt_length,
        max_completion_length=max_completion_length,
        max_length=max_length,
    )
    ds = as_dataset(dataset)
    fmt = formats.detect_dpo_format(ds.column_names, formats.column_kinds(ds))
    _log_format("dpo", fmt, tokenizer)
    conversational = fmt in formats.CONVERSATIONAL
    implicit = fmt in (formats.IMPLICIT_PREFERENCE, formats.CONVERSATIONAL_IMPLICIT_PREFERENCE)
    limits = dict(
        max_prompt_length=max_prompt_length, max_completion_length=max_completion_length, max_length=max_length
    )
    bos, eos = ([], []) if conversational else _special(tokenizer)
    stats = TruncationStats(task="dpo")
    columns: dict[str, list] = {"prompt_input_ids": [], "chosen_input_ids": [], "rejected_input_ids": []}
    for offset, batch in _chunks(ds, progress, "tokenizing dpo"):
        rows = (
            _conversational_preference(batch, offset, tokenizer, implicit)
            if conversational
            else _standard_preference(batch, offset, implicit)
        )
        kept = [r for r in rows if not isinstance(r, str)]
        encoded = [tokenizer.encode_batch([r[k] for r in kept]) for k in range(3)]
        for reason in (r for r in rows if isinstance(r, str)):
            stats.record(0, 0)
            stats.drop(reason)
        for p, c, r in zip(*encoded):
            ending = tokenizer.eos_token_id  # eos once: not again after a text that ends with it (TRL's add_eos)
            row = _dpo_row(bos + p, _ending(c, eos, ending), _ending(r, eos, ending), limits, stats)
            if row is not None:
                for key, value in row.items():
                    columns[key].append(value)
    return from_table(_columns_table(columns)), stats


# Trainer entry points
# --------------------------------------------------------------------------------------


def _dataset_name(cfg, task: str, name: Optional[str] = None) -> str:
    """``name`` (None: ``dataset_name``), with ``embedded`` read as the task's embedded dataset."""
    name = cfg.data.dataset_name if name is None else name
    if name == "embedded":
        return f"embedded-{task_spec(task).data}"
    return name


def _raise_if_empty(rows, stats: TruncationStats, cfg) -> None:
    if len(rows) == 0:
        raise DataError(
            f"no example of dataset_name={cfg.data.dataset_name!r} survives tokenisation and truncation "
            f"(max_length={cfg.data.max_length}):\n{stats}\nraise max_length or fix the data."
        )


def prepare_sft_dataset(
    cfg, dataset: Any = None, tokenizer: Any = None, *, held_out: bool = False
) -> tuple[Any, TwinseqTokenizer, TruncationStats]:
    """``TrainConfig`` -> (rows with ``input_ids`` + mask columns, tokenizer, stats). No packing.

    ``dataset`` / ``tokenizer``: objects a Python caller passed (``common.run.inputs.RunInputs``) instead of
    ``dataset_name`` / the model folder's tokenizer. ``held_out=True``: ``dataset`` is the eval set
    (``eval_dataset``), tokenised as it is (no ``eval_fraction`` split).

    With ``packing`` and a strategy that keeps every token (``bfd_split``, ``wrapped``) the
    rows are not truncated: the packer splits them, which still loses the target at each cut
    (counted in ``PackingStats.num_targets_lost``). Plain ``bfd`` cuts overflow at the start
    of each sequence, which is what ``keep_start`` truncation here does, counted and checked.
    """
    d = cfg.data
    max_length = d.max_length
    if d.packing and d.packing_strategy != "bfd":
        logger.info(
            "packing_strategy=%r keeps every token (not the target at each cut): not truncating to "
            "max_length before packing",
            d.packing_strategy,
        )
        max_length = None
    tokenizer = run_tokenizer(cfg, tokenizer)
    dataset = as_dataset(dataset, "eval_dataset") if held_out else _run_dataset(cfg, "sft", dataset)
    rows, stats = tokenize_sft(
        dataset,
        tokenizer,
        max_length=max_length,
        truncation_mode=d.truncation_mode,
        completion_only_loss=d.completion_only_loss,
        assistant_only_loss=d.assistant_only_loss,
        progress=False if cfg.disable_tqdm else None,
    )
    stats.log()
    _raise_if_empty(rows, stats, cfg)
    return rows, tokenizer, stats


def _run_dataset(cfg, task: str, given: Any = None, part: str = "train"):
    """The training rows: the object a Python caller passed (``train_dataset``), else ``dataset_name``, less the
    rows ``eval_fraction`` holds out; ``part='eval'``: those held-out rows."""
    if given is not None:
        ds = resolve_dataset(given, "train_dataset", split=cfg.data.dataset_split)
    else:
        ds = load_dataset_any(_dataset_name(cfg, task), split=cfg.data.dataset_split)
    return split_off_eval(ds, cfg.data.eval_fraction, cfg.seed, part)


def eval_dataset(cfg, task: str, given: Any = None, train_dataset: Any = None) -> Any:
    """The untokenised eval set of a run, or None when it has none: the object a Python caller passed
    (``eval_dataset``), else the rows ``eval_fraction`` holds out of the training data (``train_dataset`` or
    ``dataset_name``), else ``eval_dataset_name`` (None: ``dataset_name``) at ``eval_split`` (None: ``train``).

    A Python ``eval_dataset`` beside ``eval_fraction`` is refused: the run would hold rows out for nothing."""
    d = cfg.data
    if given is not None:
        if d.eval_fraction is not None:
            raise DataError(
                f"eval_dataset= was passed and eval_fraction={d.eval_fraction} holds out training rows as an eval "
                f"set too; drop one of them."
            )
        return resolve_dataset(given, "eval_dataset", split=d.eval_split or "train")
    if d.eval_fraction is not None:
        return _run_dataset(cfg, task, train_dataset, part="eval")
    if d.eval_dataset_name is None and d.eval_split is None:
        return None
    name = _dataset_name(cfg, task, d.eval_dataset_name)
    return load_dataset_any(name, split=d.eval_split or "train", field="eval_split")


def run_tokenizer(cfg, given: Any = None) -> TwinseqTokenizer:
    """The tokenizer of a run: the one a Python caller passed (``processing_class``), else
    ``tokenizer_name_or_path`` when given, else the model folder's own (a ``--model-config`` folder holding a
    ``tokenizer.json``, as a Hugging Face checkpoint does), else the embedded one. The log says which."""
    if given is not None:
        return tokenizer_from(given)
    name = cfg.data.tokenizer_name_or_path
    if name is None:
        folder = Path(cfg.model.model_config)
        name = str(folder) if (folder / "tokenizer.json").is_file() else "embedded"
        if folder.is_dir():
            logger.info(
                "tokenizer: %s",
                f"the model folder's own ({folder})"
                if name != "embedded"
                else f"the embedded one ({folder} has no tokenizer.json; --tokenizer-name-or-path picks another)",
            )
    return load_tokenizer(name)


def preference_tokenize_args(cfg) -> dict[str, Any]:
    """The truncation limits and the progress switch that preference tokenisation (DPO's, KTO's) takes from a
    ``TrainConfig``."""
    d = cfg.data
    return dict(
        max_prompt_length=d.max_prompt_length,
        max_completion_length=d.max_completion_length,
        max_length=d.max_length,
        truncation_mode=d.truncation_mode,
        progress=False if cfg.disable_tqdm else None,
    )


def prepare_dpo_dataset(
    cfg, dataset: Any = None, tokenizer: Any = None, *, held_out: bool = False
) -> tuple[Any, TwinseqTokenizer, TruncationStats]:
    """``TrainConfig`` -> (rows with prompt/chosen/rejected ``*_input_ids``, tokenizer, stats); ``dataset`` /
    ``tokenizer`` / ``held_out`` as in ``prepare_sft_dataset``."""
    tokenizer = run_tokenizer(cfg, tokenizer)
    dataset = as_dataset(dataset, "eval_dataset") if held_out else _run_dataset(cfg, "dpo", dataset)
    rows, stats = tokenize_dpo(dataset, tokenizer, **preference_tokenize_args(cfg))
    stats.log()
    _raise_if_empty(rows, stats, cfg)
    return rows, tokenizer, stats


__all__ = [
    "load_dataset_any",
    "tokenize_sft",
    "tokenize_dpo",
    "prepare_sft_dataset",
    "prepare_dpo_dataset",
    "eval_dataset",
    "detect_sft_format",
    "detect_dpo_format",
]
