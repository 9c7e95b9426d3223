"""Loaders, SFT/DPO tokenisation, truncation with drop accounting, and the trainer entry points."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinseq.common.data.batching import IGNORE_INDEX, collate
from twinseq.common.config import TrainConfig
from twinseq.common.data.prepare import (load_dataset_any, prepare_dpo_dataset, prepare_sft_dataset, tokenize_dpo,
                                 tokenize_sft)
from twinseq.common.data.truncation import (DROP_EMPTY_CHOSEN, DROP_EMPTY_COMPLETION, DROP_NO_TARGETS,
                                       DROP_TOO_SHORT)

ROWS = [
    {"prompt": "Explain `json.dumps`.\n", "completion": "Serialize obj to a JSON formatted str."},
    {"prompt": "What is 2+2?\n", "completion": "4"},
    {"prompt": "Say nothing.\n", "completion": "   "},
]


@pytest.fixture(scope="module")
def small_sft(embedded_sft):
    return embedded_sft.select(range(300))


@pytest.fixture(scope="module")
def full_sft(small_sft, embedded_tokenizer):
    rows, stats = tokenize_sft(small_sft, embedded_tokenizer)
    return rows, stats


# --------------------------------------------------------------------------------------
# loaders
# --------------------------------------------------------------------------------------


def _write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import csv

        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_load_local_files(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    _write(path, ROWS, fmt)
    ds = load_dataset_any(str(path))
    assert ds.column_names == ["prompt", "completion"]
    assert [dict(r) for r in ds] == ROWS
    assert len(load_dataset_any(str(path), split="train[:2]")) == 2
    tail = load_dataset_any(str(path), split="train[1:]")
    assert [r["prompt"] for r in tail] == [ROWS[1]["prompt"], ROWS[2]["prompt"]]


def test_load_messages_jsonl_keeps_structure(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    path = tmp_path / "chat.jsonl"
    _write(path, rows, "jsonl")
    assert load_dataset_any(str(path))[0] == rows[0]


def test_load_saved_folders(tmp_path):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_dataset_any(str(tmp_path / "single"))) == 3
    assert len(load_dataset_any(str(tmp_path / "dict"), split="test")) == 1
    assert len(load_dataset_any(str(tmp_path / "dict"), split="train[:50%]")) == 1


@pytest.mark.parametrize("name", ["embedded", "embedded-sft", "embedded-messages", "embedded-preference"])
def test_load_embedded_names(name, embedded_sft):
    ds = load_dataset_any(name, split="train[:10]")
    assert len(ds) == 10


# --------------------------------------------------------------------------------------
# SFT tokenisation
# --------------------------------------------------------------------------------------


def test_prompt_completion_layout(embedded_tokenizer):
    tok = embedded_tokenizer
    rows, stats = tokenize_sft(ROWS, tok)
    assert stats.examples_seen == 3 and dict(stats.dropped) == {DROP_EMPTY_COMPLETION: 1}
    assert len(rows) == 2
    for row, src in zip(rows, ROWS):
        p, c = tok.encode(src["prompt"]), tok.encode(src["completion"])
        assert row["input_ids"] == [tok.bos_token_id] + p + c + [tok.eos_token_id]
        assert row["completion_mask"] == [0] * (1 + len(p)) + [1] * (len(c) + 1)


def test_text_and_messages(embedded_tokenizer):
    tok = embedded_tokenizer
    rows, _ = tokenize_sft({"text": ["hello world"]}, tok)
    assert rows[0]["input_ids"] == [1] + tok.encode("hello world") + [2]
    assert rows.column_names == ["input_ids"]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows, _ = tokenize_sft({"messages": [messages]}, tok)
    ids, mask = tok.apply_chat_template(messages)
    assert rows[0] == {"input_ids": ids, "assistant_masks": mask}


def test_no_truncation_keeps_everything(full_sft, small_sft):
    rows, stats = full_sft
    assert len(rows) == stats.examples_seen == len(small_sft)
    assert stats.tokens_truncated == 0 and stats.examples_dropped == 0
    assert stats.tokens_seen == sum(len(x) for x in rows["input_ids"])


@settings(max_examples=12, deadline=None)
@given(st.integers(2, 200), st.sampled_from(["keep_start", "keep_end"]))
def test_sft_truncation_invariants(full_sft, small_sft, embedded_tokenizer, max_length, mode):
    """Rows fit, are a prefix/suffix of the untruncated row, every token is accounted for,
    and every kept row still has a loss target."""
    full_rows, _ = full_sft
    rows, stats = tokenize_sft(small_sft, embedded_tokenizer, max_length=max_length, truncation_mode=mode)
    assert stats.examples_seen == len(small_sft) == len(rows) + stats.examples_dropped
    full_ids = list(full_rows["input_ids"])
    assert stats.tokens_truncated == sum(max(len(x) - max_length, 0) for x in full_ids)
    assert stats.examples_truncated == sum(len(x) > max_length for x in full_ids)
    expected_kept = []
    for ids, mask in zip(full_ids, full_rows["completion_mask"]):
        cut = slice(0, max_length) if mode == "keep_start" else slice(max(len(ids) - max_length, 0), None)
        if sum(mask[cut][1:]) > 0:
            expected_kept.append(ids[cut])
    assert list(rows["input_ids"]) == expected_kept
    for mask in rows["completion_mask"]:
        assert len(mask) <= max_length and sum(mask[1:]) >= 1


def test_keep_start_drops_rows_whose_completion_is_cut_off(embedded_tokenizer):
    tok = embedded_tokenizer
    prompt_len = 1 + len(tok.encode(ROWS[0]["prompt"]))
    rows, stats = tokenize_sft(ROWS[:1], tok, max_length=prompt_len)
    assert len(rows) == 0 and dict(stats.dropped) == {DROP_NO_TARGETS: 1}
    rows, stats = tokenize_sft(ROWS[:1], tok, max_length=prompt_len + 1)
    assert len(rows) == 1 and rows[0]["completion_mask"][-1] == 1


def test_keep_end_drops_a_lone_target_at_position_zero(embedded_tokenizer):
    rows, stats = tokenize_sft(ROWS[:1], embedded_tokenizer, max_length=1, truncation_mode="keep_end")
    assert len(rows) == 0 and dict(stats.dropped) == {DROP_NO_TARGETS: 1}


def test_full_loss_keeps_rows_without_completion(embedded_tokenizer):
    """With completion_only_loss=False the prompt tokens are targets too, so nothing is dropped."""
    rows, stats = tokenize_sft(ROWS[:1], embedded_tokenizer, max_length=3, completion_only_loss=False)
    assert len(rows) == 1 and stats.examples_dropped == 0
    rows, stats = tokenize_sft({"text": ["x"]}, embedded_tokenizer, max_length=1)
    assert len(rows) == 0 and dict(stats.dropped) == {DROP_TOO_SHORT: 1}


@pytest.mark.parametrize("max_length,mode", [(8, "keep_start"), (8, "keep_end"), (40, "keep_start")])
def test_collated_rows_always_have_targets(small_sft, embedded_tokenizer, max_length, mode):
    """The TRL #3927 failure: no row reaching the loss has zero targets."""
    rows, _ = tokenize_sft(small_sft, embedded_tokenizer, max_length=max_length, truncation_mode=mode)
    for i in range(0, len(rows), 16):
        examples = [rows[j] for j in range(i, min(i + 16, len(rows)))]
        batch = collate(examples)
        per_row = (batch.labels != IGNORE_INDEX).sum(axis=1)
        assert (per_row > 0).all()


def test_messages_assistant_only_drops_truncated_answers(embedded_tokenizer):
    messages = load_dataset_any("embedded-messages", split="train[:100]")
    rows, stats = tokenize_sft(messages, embedded_tokenizer, max_length=12, assistant_only_loss=True)
    assert stats.examples_seen == 100 and len(rows) + stats.examples_dropped == 100
    assert stats.examples_dropped > 0
    for mask in rows["assistant_masks"]:
        assert sum(mask[1:]) >= 1 and len(mask) <= 12


# --------------------------------------------------------------------------------------
# DPO tokenisation
# --------------------------------------------------------------------------------------


def test_dpo_layout_and_limits(embedded_preference, embedded_tokenizer):
    tok = embedded_tokenizer
    data = embedded_preference.select(range(200))
    full, _ = tokenize_dpo(data, tok)
    row = full[0]
    src = data[0]
    assert row["prompt_input_ids"] == [1] + tok.encode(src["prompt"])
    assert row["chosen_input_ids"] == tok.encode(src["chosen"]) + [2]
    assert row["rejected_input_ids"] == tok.encode(src["rejected"]) + [2]

    rows, stats = tokenize_dpo(data, tok, max_prompt_length=8, max_completion_length=40, max_length=32)
    assert stats.examples_seen == 200 == len(rows) + stats.examples_dropped
    for p, c, r in zip(rows["prompt_input_ids"], rows["chosen_input_ids"], rows["rejected_input_ids"]):
        assert len(p) <= 8 and 1 <= len(c) <= 40 and 1 <= len(r) <= 40
        assert len(p) + len(c) <= 32 and len(p) + len(r) <= 32
    removed = sum(len(a) + len(b) + len(c) for a, b, c in zip(*[full[k] for k in full.column_names]))
    removed -= sum(len(a) + len(b) + len(c) for a, b, c in zip(*[rows[k] for k in rows.column_names]))
    assert stats.examples_dropped == 0 and stats.tokens_truncated == removed


def test_dpo_drops_pairs_without_completion(embedded_tokenizer):
    data = {"prompt": ["a b c d e f g h i j k l"], "chosen": ["yes"], "rejected": ["no"]}
    rows, stats = tokenize_dpo(data, embedded_tokenizer, max_length=4)
    assert len(rows) == 0 and dict(stats.dropped) == {DROP_EMPTY_CHOSEN: 1}


# --------------------------------------------------------------------------------------
# trainer entry points
# --------------------------------------------------------------------------------------


def test_prepare_sft_dataset(tmp_path):
    path = tmp_path / "train.jsonl"
    _write(path, ROWS, "jsonl")
    rows, tok, stats = prepare_sft_dataset(TrainConfig.from_flat(dataset_name=str(path), max_length=64))
    assert rows.column_names == ["input_ids", "completion_mask"] and len(rows) == 2
    assert stats.examples_seen == 3 and tok.vocab_size == 8192
    batch = collate(list(rows), pad_token_id=tok.pad_token_id)
    assert batch.input_ids.shape[0] == 2


def test_prepare_sft_embedded_and_packing_strategies(embedded_sft):
    cfg = TrainConfig.from_flat(dataset_split="train[:200]", max_length=32)
    rows, _, stats = prepare_sft_dataset(cfg)
    assert max(len(x) for x in rows["input_ids"]) <= 32 and stats.tokens_truncated > 0
    split_cfg = TrainConfig.from_flat(dataset_split="train[:200]", max_length=32, packing=True, packing_strategy="bfd_split")
    rows, _, stats = prepare_sft_dataset(split_cfg)
    assert stats.tokens_truncated == 0 and max(len(x) for x in rows["input_ids"]) > 32


def test_prepare_dpo_dataset(embedded_preference):
    cfg = TrainConfig.from_flat(task="dpo", dataset_split="train[:100]", max_length=64, max_prompt_length=16)
    rows, tok, stats = prepare_dpo_dataset(cfg)
    assert rows.column_names == ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"]
    assert len(rows) + stats.examples_dropped == 100
    assert all(len(p) <= 16 for p in rows["prompt_input_ids"])


def test_progress_bar_on_request(embedded_tokenizer, capsys):
    tokenize_sft(ROWS[:2], embedded_tokenizer, progress=True)
    assert "tokenizing sft" in capsys.readouterr().err


def test_rows_are_int32_lists(full_sft):
    rows, _ = full_sft
    assert str(rows.features["input_ids"].feature.dtype) == "int32"
    assert np.asarray(rows[0]["input_ids"]).dtype.kind == "i"


def test_a_jsonl_line_longer_than_arrows_block_loads(tmp_path):
    """One long document per line (the GPU max-length probe's 393,216-token document is ~2.3 MB on one line):
    Arrow's JSON reader fails on a line longer than its 1 MiB block unless the block is sized to the line."""
    ids = list(range(3, 8192)) * 60  # ~2.6 MB of JSON on one line
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"input_ids": ids}) + "\n" + json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    ds = load_dataset_any(str(path))
    assert len(ds) == 2 and ds[0]["input_ids"] == ids and ds[1]["input_ids"] == [5, 6, 7]
