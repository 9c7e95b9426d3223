"""Truncation rules (pure functions) and the statistics report."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinseq.common.data.truncation import (DROP_NO_TARGETS, TruncationStats, num_targets, truncate, truncate_dpo,
                                       truncate_sft)

ids_lists = st.lists(st.integers(0, 50), max_size=30)
limits = st.one_of(st.none(), st.integers(1, 40))


def test_truncate_modes():
    assert truncate([1, 2, 3, 4, 5], 3, "keep_start") == [1, 2, 3]
    assert truncate([1, 2, 3, 4, 5], 3, "keep_end") == [3, 4, 5]
    assert truncate([1, 2], 3, "keep_end") == [1, 2]
    assert truncate([1, 2], None) == [1, 2]


def test_truncate_sft_cuts_masks_with_ids():
    row = {"input_ids": [1, 5, 6, 7, 8, 2], "completion_mask": [0, 0, 0, 1, 1, 1]}
    start, removed = truncate_sft(row, 4, "keep_start")
    assert start == {"input_ids": [1, 5, 6, 7], "completion_mask": [0, 0, 0, 1]} and removed == 2
    end, removed = truncate_sft(row, 4, "keep_end")
    assert end == {"input_ids": [6, 7, 8, 2], "completion_mask": [0, 1, 1, 1]} and removed == 2


def test_num_targets_ignores_the_first_position():
    # the shifted loss never predicts position 0, so a lone masked-in token there is no target
    assert num_targets([1, 0, 0], 3) == 0
    assert num_targets([0, 1], 2) == 1
    assert num_targets(None, 1) == 0 and num_targets(None, 5) == 4


def test_dpo_order_prompt_end_then_completion_start_then_total():
    prompt, chosen, rejected = [1, 10, 11, 12, 13], [20, 21, 22, 23], [30, 31]
    p, c, r, removed = truncate_dpo(prompt, chosen, rejected, max_prompt_length=3)
    assert (p, c, r, removed) == ([11, 12, 13], chosen, rejected, 2)
    p, c, r, removed = truncate_dpo(prompt, chosen, rejected, max_completion_length=3)
    assert (p, c, r, removed) == (prompt, [20, 21, 22], [30, 31], 1)
    p, c, r, removed = truncate_dpo(prompt, chosen, rejected, max_prompt_length=3, max_completion_length=3,
                                    max_length=5)
    assert (p, c, r, removed) == ([11, 12, 13], [20, 21], [30, 31], 4)
    # a prompt longer than max_length keeps its start and leaves no room for the completions
    p, c, r, _ = truncate_dpo(prompt, chosen, rejected, max_length=4)
    assert (p, c, r) == ([1, 10, 11, 12], [], [])


@settings(max_examples=200, deadline=None)
@given(ids_lists, ids_lists, ids_lists, limits, limits, limits)
def test_dpo_truncation_properties(prompt, chosen, rejected, max_prompt, max_completion, max_length):
    p, c, r, removed = truncate_dpo(prompt, chosen, rejected, max_prompt_length=max_prompt,
                                    max_completion_length=max_completion, max_length=max_length)
    inf = float("inf")
    # the prompt keeps its end first; only max_length may then cut its start-kept prefix
    q = prompt[max(len(prompt) - max_prompt, 0):] if max_prompt is not None else prompt
    assert p == q[: min(len(q), max_length or inf)]
    room = max_length - len(p) if max_length is not None else inf
    for out, full in ((c, chosen), (r, rejected)):
        assert out == full[: len(out)]
        assert len(out) == min(len(full), max_completion or inf, room)
    assert removed == len(prompt) + len(chosen) + len(rejected) - len(p) - len(c) - len(r) >= 0


@settings(max_examples=200, deadline=None)
@given(ids_lists, st.integers(1, 40), st.sampled_from(["keep_start", "keep_end"]))
def test_sft_truncation_properties(ids, max_length, mode):
    mask = [i % 2 for i in ids]
    out, removed = truncate_sft({"input_ids": ids, "completion_mask": mask}, max_length, mode)
    n = len(out["input_ids"])
    assert n == min(len(ids), max_length) and removed == len(ids) - n
    assert out["completion_mask"] == [i % 2 for i in out["input_ids"]]  # still aligned
    kept = ids[:n] if mode == "keep_start" else ids[len(ids) - n:]
    assert out["input_ids"] == kept


def test_stats_report_and_log(caplog):
    stats = TruncationStats(task="sft")
    stats.record(10, 0)
    stats.record(20, 5)
    stats.record(8, 8)
    stats.drop(DROP_NO_TARGETS)
    assert (stats.examples_seen, stats.examples_truncated, stats.tokens_truncated) == (3, 2, 13)
    assert (stats.examples_dropped, stats.examples_kept) == (1, 2)
    text = str(stats)
    assert "3 examples seen, 2 kept" in text and "13 of 38 tokens" in text and DROP_NO_TARGETS in text
    with caplog.at_level(logging.INFO, logger="twinseq.common.data.truncation"):
        stats.log()
    assert any(DROP_NO_TARGETS in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert stats.to_dict()["dropped"] == {DROP_NO_TARGETS: 1}


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncate_never_lengthens(mode):
    assert truncate([], 3, mode) == []
