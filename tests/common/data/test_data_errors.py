"""Bad input fails fast with an error naming the field, the value and the fix."""

from __future__ import annotations

import json
import time

import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.data.prepare import load_dataset_any, prepare_dpo_dataset, tokenize_dpo, tokenize_sft
from twinseq.common.data.lengths import main as lengths_main
from twinseq.common.data.lengths import profile_lengths
from twinseq.common.data.tokenizer import load_tokenizer

PC = {"prompt": ["Q?\n"], "completion": ["A."]}
PREF = {"prompt": ["Q?\n"], "chosen": ["good"], "rejected": ["bad"]}


def test_unknown_truncation_mode(embedded_tokenizer):
    with pytest.raises(ValueError, match=r"truncation_mode='keep_middle'.*'keep_start', 'keep_end'"):
        tokenize_sft(PC, embedded_tokenizer, max_length=8, truncation_mode="keep_middle")


@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_max_length(embedded_tokenizer, value):
    with pytest.raises(ValueError, match=rf"max_length={value}.*positive.*None"):
        tokenize_sft(PC, embedded_tokenizer, max_length=value)


def test_non_integer_max_length(embedded_tokenizer):
    with pytest.raises(TypeError, match=r"max_length=12.5 must be an int"):
        tokenize_sft(PC, embedded_tokenizer, max_length=12.5)


def test_non_positive_max_prompt_length(embedded_tokenizer):
    with pytest.raises(ValueError, match=r"max_prompt_length=0.*positive"):
        tokenize_dpo(PREF, embedded_tokenizer, max_prompt_length=0)


def test_dpo_keep_end_is_refused(embedded_tokenizer):
    with pytest.raises(ValueError, match=r"truncation_mode='keep_end'.*DPO.*max_prompt_length"):
        tokenize_dpo(PREF, embedded_tokenizer, max_length=8, truncation_mode="keep_end")


def test_missing_sft_columns_lists_what_was_found(embedded_tokenizer):
    with pytest.raises(ValueError, match=r"'messages'.*'prompt'\+'completion'.*'text'.*\['answer', 'question'\]"):
        tokenize_sft({"question": ["q"], "answer": ["a"]}, embedded_tokenizer)


def test_prompt_without_completion(embedded_tokenizer):
    with pytest.raises(ValueError, match=r"\['completion'\].*\['prompt'\]"):
        tokenize_sft({"prompt": ["q"]}, embedded_tokenizer)


def test_non_string_prompt(embedded_tokenizer):
    data = {"prompt": [[{"role": "user", "content": "q"}]], "completion": ["a"]}
    with pytest.raises(TypeError, match=r"row 0 \(line 1 of a JSONL file\): field 'prompt' must be a string, got list.*'messages'"):
        tokenize_sft(data, embedded_tokenizer)
    with pytest.raises(TypeError, match=r"row 0 .*: field 'completion' must be a string, got int"):
        tokenize_sft({"prompt": ["q"], "completion": [7]}, embedded_tokenizer)


def test_mixed_column_types(embedded_tokenizer):
    data = {"prompt": ["ok", [{"role": "user", "content": "q"}]], "completion": ["a", "b"]}
    with pytest.raises(TypeError, match=r"cannot be made into a table.*same type"):
        tokenize_sft(data, embedded_tokenizer)


def test_unknown_message_role(embedded_tokenizer):
    conv = [[{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    with pytest.raises(ValueError, match=r"row 0 .*: messages\[0\]\['role'\]='human'.*'user'"):
        tokenize_sft({"messages": conv}, embedded_tokenizer)


def test_message_without_content(embedded_tokenizer):
    with pytest.raises(TypeError, match=r"messages\[0\] must be a dict with 'role' and 'content'"):
        tokenize_sft({"messages": [[{"role": "user"}]]}, embedded_tokenizer)


def test_dpo_row_missing_chosen(embedded_tokenizer):
    with pytest.raises(ValueError, match=r"DPO data needs the column\(s\) \['chosen'\].*\['prompt', 'rejected'\]"):
        tokenize_dpo({"prompt": ["q"], "rejected": ["r"]}, embedded_tokenizer)


def test_unsupported_file_extension(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello\n")
    with pytest.raises(ValueError, match=r"unsupported extension '\.txt'.*\.jsonl.*\.parquet.*\.csv"):
        load_dataset_any(str(path))


def test_nonexistent_local_path(tmp_path):
    with pytest.raises(ValueError, match=r"no such file or folder.*missing\.jsonl"):
        load_dataset_any(str(tmp_path / "missing.jsonl"))


def test_malformed_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "q", "completion": "a"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        load_dataset_any(str(path))


def test_bad_split():
    with pytest.raises(ValueError, match=r"dataset_split='validation'.*single split, 'train'"):
        load_dataset_any("embedded", split="validation")
    with pytest.raises(ValueError, match=r"dataset_split='train\[:x\]' is not valid"):
        load_dataset_any("embedded", split="train[:x]")


def test_hub_name_fails_fast_without_network(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"'acme/some-dataset'.*Hugging Face Hub.*127\.0\.0\.1:9 cannot be reached"
                                         r".*network problem.*local JSONL"):
        load_dataset_any("acme/some-dataset")
    assert time.monotonic() - start < 10


def test_hub_name_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"'acme/some-dataset'.*HF_HUB_OFFLINE.*local JSONL"):
        load_dataset_any("acme/some-dataset")
    assert time.monotonic() - start < 10


def test_tokenizer_hub_name_names_the_expected_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ValueError, match=r"'acme/tok'.*expected a directory '.*acme/tok' containing "
                                         r"tokenizer\.json.*never downloads"):
        load_tokenizer("acme/tok")


def test_tokenizer_folder_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match=r"folder without a tokenizer\.json"):
        load_tokenizer(str(tmp_path))


def test_everything_dropped_is_an_error():
    cfg = TrainConfig.from_flat(task="dpo", dataset_split="train[:20]", max_length=4, max_prompt_length=None)
    with pytest.raises(ValueError, match=r"(?s)no example .* survives.*max_length=4.*dropped: 20.*raise max_length"):
        prepare_dpo_dataset(cfg)


def test_profiler_arguments():
    with pytest.raises(ValueError, match=r"batch_size=0"):
        profile_lengths([1, 2], [4], batch_size=0)
    with pytest.raises(ValueError, match=r"positive token counts"):
        profile_lengths([], [4])
    with pytest.raises(ValueError, match=r"--candidates='128,abc'.*comma-separated"):
        lengths_main(["embedded", "--candidates", "128,abc"])


def test_empty_texts_and_identical_pairs_are_dropped_and_counted(embedded_tokenizer):
    from twinseq.common.data.truncation import DROP_EMPTY_TEXT, DROP_SAME_PAIR

    rows, stats = tokenize_sft({"text": ["hello world", "", "   ", "bye"]}, embedded_tokenizer)
    assert len(rows) == 2 and stats.dropped == {DROP_EMPTY_TEXT: 2} and "dropped: 2 (empty_text)" in str(stats)
    rows, stats = tokenize_dpo({"prompt": ["q", "q2"], "chosen": ["same", "a"], "rejected": ["same", "b"]},
                               embedded_tokenizer)
    assert len(rows) == 1 and stats.dropped == {DROP_SAME_PAIR: 1}


def test_pre_tokenised_rows_are_checked_against_the_vocabulary(embedded_tokenizer):
    rows, stats = tokenize_sft({"input_ids": [[1, 5, 6], [1, 7]], "completion_mask": [[0, 1, 1], [0, 1]]},
                               embedded_tokenizer)
    assert rows["input_ids"] == [[1, 5, 6], [1, 7]] and rows["completion_mask"] == [[0, 1, 1], [0, 1]]
    with pytest.raises(ValueError, match=r"row 1 \(line 2 of a JSONL file\): input_ids hold -3"):
        tokenize_sft({"input_ids": [[1, 5], [1, -3]]}, embedded_tokenizer)
    with pytest.raises(ValueError, match=r"input_ids hold 8192, outside the tokenizer's vocabulary \[0, 8192\)"):
        tokenize_sft({"input_ids": [[1, 8192]]}, embedded_tokenizer)


def test_json_top_level_and_line_numbers(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('{"prompt": "q", "completion": "a"}')
    with pytest.raises(TypeError, match="the top level is a dict"):
        load_dataset_any(str(path))
    path.write_text('[{"prompt": "q", "completion": "a"},\n{"prompt": "q2" "completion": "b"}]')
    with pytest.raises(ValueError, match=r"rows\.json:2:17: not valid JSON"):
        load_dataset_any(str(path))
    lines = tmp_path / "rows.jsonl"
    lines.write_text('{"prompt": "q", "completion": "a"}\n\n3\n')
    with pytest.raises(TypeError, match=r"rows\.jsonl:3: the line holds a int"):
        load_dataset_any(str(lines))
