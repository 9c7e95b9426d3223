"""Split documents are counted honestly: ``PackingStats.num_targets_lost`` is what packing costs the loss.

A target is a label != -100 after ``collate``, shifted as the loss shifts it
(``twinseq.common.objectives.nll.num_tokens``). The invariant, for every strategy and any labels or
loss masks: targets of the examples collated one document each, minus targets of the
packed rows collated with their ``seq_lengths``, equals ``num_targets_lost``. With every
token a target it is also ``num_cuts`` for ``bfd_split``/``wrapped`` and
``num_tokens_dropped`` for ``bfd``.
"""

import dataclasses
import logging

import datasets
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from twinseq.common.data.batching import collate
from twinseq.common.config import TrainConfig
from twinseq.common.data.sft_steps import StepIterator
from twinseq.common.objectives.nll import num_tokens
from twinseq.common.data.packing import STRATEGIES, pack_dataset, plan_packing

datasets.disable_progress_bars()
SETTINGS = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------- helpers

def count_targets(rows, **flags) -> int:
    """Targets the loss sums over, for ``rows`` collated as the trainer collates them."""
    rows = [r for r in rows if len(r["input_ids"])]
    return num_tokens(collate(rows, padding_free=True, **flags).labels) if rows else 0


def example_rows(examples):
    return [{k: v[i] for k, v in examples.items()} for i in range(len(examples["input_ids"]))]


def packed_rows(packed):
    names = [k for k in packed if k not in ("source_indices", "source_offsets")]
    return [{k: packed[k][r] for k in names} for r in range(len(packed["input_ids"]))]


def is_target_by_hand(examples, i, t, completion_only_loss=None, assistant_only_loss=False) -> bool:
    """Token t of example i is a target in collate's rules (ignoring the document-start rule)."""
    ok = examples["labels"][i][t] != -100 if "labels" in examples else True
    use_completion = "completion_mask" in examples if completion_only_loss is None else completion_only_loss
    if use_completion:
        ok = ok and examples["completion_mask"][i][t] != 0
    if assistant_only_loss:
        ok = ok and examples["assistant_masks"][i][t] != 0
    return ok


def check_lost_targets(examples, seq_length, strategy, packed, stats, **flags):
    """The invariants of ``num_targets_lost`` and ``num_cuts`` for one packing; asserts."""
    before = count_targets(example_rows(examples), **flags)
    after = count_targets(packed_rows(packed), **flags)
    assert before - after == stats.num_targets_lost, (before, after, stats.num_targets_lost)
    # The same number by hand: a continuation fragment's first token, or bfd's dropped tail.
    offsets = [(s, o) for srcs, offs in zip(packed["source_indices"], packed["source_offsets"])
               for s, o in zip(srcs, offs)]
    cuts = [(s, o) for s, o in offsets if o > 0]
    assert stats.num_cuts == len(cuts)
    lengths = [len(ids) for ids in examples["input_ids"]]
    if strategy == "bfd":
        assert not cuts
        lost = [(i, t) for i, n in enumerate(lengths) for t in range(seq_length, n)]
    else:
        lost = cuts
    assert stats.num_targets_lost == sum(is_target_by_hand(examples, i, t, **flags) for i, t in lost)


# --------------------------------------------------------------------------- properties

@st.composite
def labelled_instances(draw, max_seq_length=12, max_examples=25):
    """(seq_length, examples, flags): random lengths, random -100 labels and loss masks."""
    seq_length = draw(st.integers(1, max_seq_length))
    special = st.sampled_from([0, 1, seq_length, seq_length + 1, 2 * seq_length, 2 * seq_length + 1])
    lengths = draw(st.lists(st.one_of(special, st.integers(0, 3 * seq_length)), min_size=1, max_size=max_examples))
    bits = st.lists(st.integers(0, 1), min_size=sum(lengths), max_size=sum(lengths))
    ends = np.cumsum(lengths)
    split = lambda flat: [list(flat[e - n:e]) for n, e in zip(lengths, ends)]  # noqa: E731
    ids = split(list(range(sum(lengths))))
    examples = {"input_ids": ids}
    flags = {"completion_only_loss": None, "assistant_only_loss": False}
    if draw(st.booleans()):
        ignored = split(draw(bits))
        examples["labels"] = [[-100 if b else t for t, b in zip(row, mask)] for row, mask in zip(ids, ignored)]
    if draw(st.booleans()):
        examples["completion_mask"] = split(draw(bits))
        flags["completion_only_loss"] = draw(st.sampled_from([None, True, False]))
    if draw(st.booleans()):
        examples["assistant_masks"] = split(draw(bits))
        flags["assistant_only_loss"] = draw(st.booleans())
    return seq_length, examples, flags


@SETTINGS
@given(labelled_instances(), st.sampled_from(STRATEGIES))
@example((4, {"input_ids": [[0, 1, 2, 3, 4, 5, 6, 7, 8]], "completion_mask": [[0, 0, 0, 0, 1, 1, 1, 1, 1]]},
          {"completion_only_loss": None, "assistant_only_loss": False}), "bfd_split")  # cuts at 4 (target), 8
@example((4, {"input_ids": [[0, 1, 2, 3, 4, 5]], "labels": [[0, 1, 2, 3, -100, 5]]},
          {"completion_only_loss": None, "assistant_only_loss": False}), "wrapped")  # the cut token is no target
def test_targets_before_minus_after_is_the_reported_loss(instance, strategy):
    seq_length, examples, flags = instance
    packed, stats = pack_dataset(examples, seq_length, strategy, return_source=True, return_stats=True, **flags)
    check_lost_targets(examples, seq_length, strategy, packed, stats, **flags)


@SETTINGS
@given(labelled_instances(), st.sampled_from(STRATEGIES))
def test_with_every_token_a_target_the_loss_is_one_per_cut_or_the_dropped_tokens(instance, strategy):
    seq_length, examples, _ = instance
    examples = {"input_ids": examples["input_ids"]}
    packed, stats = pack_dataset(examples, seq_length, strategy, return_source=True, return_stats=True)
    check_lost_targets(examples, seq_length, strategy, packed, stats)
    lengths = np.array([len(ids) for ids in examples["input_ids"]])
    if strategy == "bfd":
        assert stats.num_cuts == 0 and stats.num_targets_lost == stats.num_tokens_dropped
    else:
        assert stats.num_targets_lost == stats.num_cuts == stats.num_fragments - int((lengths > 0).sum())
        assert stats.num_tokens_dropped == 0
    if strategy == "bfd_split":
        assert stats.num_cuts == int(np.maximum(-(-lengths // seq_length) - 1, 0).sum())
    # plan_packing sees lengths only; here that is the whole truth, so both agree.
    assert plan_packing(lengths, seq_length, strategy).stats == stats


@SETTINGS
@given(labelled_instances(), st.sampled_from(STRATEGIES))
def test_the_plan_count_is_an_upper_bound_of_the_labelled_count(instance, strategy):
    seq_length, examples, flags = instance
    _, stats = pack_dataset(examples, seq_length, strategy, return_stats=True, **flags)
    plan_stats = plan_packing([len(x) for x in examples["input_ids"]], seq_length, strategy).stats
    assert stats.num_targets_lost <= plan_stats.num_targets_lost
    assert dataclasses.replace(stats, num_targets_lost=plan_stats.num_targets_lost) == plan_stats


def test_the_check_fails_when_the_count_is_off_by_one():
    """The property above is not vacuous: one target more or fewer is caught."""
    examples = {"input_ids": [list(range(10)), [10, 11, 12]], "completion_mask": [[0] * 5 + [1] * 5, [0, 1, 1]]}
    for strategy in STRATEGIES:
        packed, stats = pack_dataset(examples, 4, strategy, return_source=True, return_stats=True)
        check_lost_targets(examples, 4, strategy, packed, stats, completion_only_loss=None, assistant_only_loss=False)
        for delta in (-1, 1):
            wrong = dataclasses.replace(stats, num_targets_lost=stats.num_targets_lost + delta)
            with pytest.raises(AssertionError):
                check_lost_targets(examples, 4, strategy, packed, wrong, completion_only_loss=None,
                                   assistant_only_loss=False)


# --------------------------------------------------------------------------- worked numbers

@pytest.mark.parametrize("strategy, seq_lengths, num_fragments, num_cuts, num_targets_lost, num_tokens_dropped", [
    # 10 = 4 + 4 + 2 (2 cuts); best fit puts the 1 after the 3, and the 2 alone.
    ("bfd_split", [[4], [4], [3, 1], [2]], 5, 2, 2, 0),
    # 0..9 | 10 11 12 | 13: rows of 4 cut example 0 at 4 and 8, example 1 at 12.
    ("wrapped", [[4], [4], [2, 2], [1, 1]], 6, 3, 3, 0),
    # The tail 4..9 of example 0 is dropped: 6 tokens, 6 targets.
    ("bfd", [[4], [3, 1]], 3, 0, 6, 6),
])
def test_worked_example_without_labels(strategy, seq_lengths, num_fragments, num_cuts, num_targets_lost,
                                       num_tokens_dropped):
    packed, stats = pack_dataset({"input_ids": [list(range(10)), [10, 11, 12], [13]]}, 4, strategy,
                                 return_stats=True)
    assert packed["seq_lengths"] == seq_lengths
    assert (stats.num_fragments, stats.num_cuts, stats.num_targets_lost, stats.num_tokens_dropped) == \
        (num_fragments, num_cuts, num_targets_lost, num_tokens_dropped)


@pytest.mark.parametrize("flags, strategy, num_targets_lost", [
    # Example 0 is 5 prompt + 5 completion tokens; rows of 4 cut it at tokens 4 (prompt) and 8.
    ({}, "bfd_split", 1),
    ({"completion_only_loss": False}, "bfd_split", 2),   # the mask is ignored: both cut tokens are targets
    ({}, "wrapped", 2),                                   # cuts at 4 (prompt), 8, and example 1's token 2
    ({"completion_only_loss": False}, "wrapped", 3),
    ({}, "bfd", 5),                                       # dropped tokens 4..9: 5..9 are completion
    ({"completion_only_loss": False}, "bfd", 6),
])
def test_worked_example_with_a_completion_mask(flags, strategy, num_targets_lost):
    examples = {"input_ids": [list(range(10)), [10, 11, 12]], "completion_mask": [[0] * 5 + [1] * 5, [0, 1, 1]]}
    _, stats = pack_dataset(examples, 4, strategy, return_stats=True, **flags)
    assert stats.num_targets_lost == num_targets_lost


def test_assistant_masks_count_only_with_assistant_only_loss():
    examples = {"input_ids": [list(range(6))], "assistant_masks": [[1, 1, 1, 1, 0, 0]]}
    assert pack_dataset(examples, 4, "bfd_split", return_stats=True)[1].num_targets_lost == 1
    _, stats = pack_dataset(examples, 4, "bfd_split", return_stats=True, assistant_only_loss=True)
    assert stats.num_targets_lost == 0


def test_a_loss_flag_without_its_mask_column_is_refused():
    with pytest.raises(ValueError, match=r"completion_only_loss=True needs a 'completion_mask' column"):
        pack_dataset({"input_ids": [[1, 2, 3]]}, 2, "bfd_split", completion_only_loss=True)
    with pytest.raises(ValueError, match=r"assistant_only_loss=True needs a 'assistant_masks' column"):
        pack_dataset({"input_ids": [[1, 2, 3]]}, 2, "bfd_split", assistant_only_loss=True)
    with pytest.raises(TypeError, match=r"completion_only_loss='yes' must be True, False or None"):
        pack_dataset({"input_ids": [[1, 2, 3]]}, 2, "bfd_split", completion_only_loss="yes")


# --------------------------------------------------------------------------- datasets layouts

def labelled_dataset(num_examples=300, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 70, num_examples)
    ids = [rng.integers(0, 1000, n).tolist() for n in lengths]
    labels = [[-100 if rng.random() < 0.3 else t for t in row] for row in ids]
    masks = [(rng.random(n) < 0.6).astype(int).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels, "completion_mask": masks})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shuffled_and_chunked_datasets_count_the_rows_they_pack(strategy):
    """An indices mapping (shuffle) and several Arrow chunks read the right label of each cut."""
    ds = labelled_dataset()
    shuffled = ds.shuffle(seed=1)
    chunked = datasets.concatenate_datasets([ds.select(range(100)), ds.select(range(100, 300))])
    assert chunked.data.table.column("labels").num_chunks > 1
    for source in (shuffled, chunked):
        packed, stats = pack_dataset(source, 32, strategy, return_source=True, return_stats=True)
        check_lost_targets(source.to_dict(), 32, strategy, packed.to_dict(), stats, completion_only_loss=None,
                           assistant_only_loss=False)
        assert stats.num_targets_lost > 0


def test_windows_and_splits_count_each_part():
    ds = labelled_dataset()
    _, whole = pack_dataset(ds, 32, "bfd_split", window=50, return_stats=True)
    per_window = sum(pack_dataset(ds.select(range(a, a + 50)), 32, "bfd_split", return_stats=True)[1].num_targets_lost
                     for a in range(0, len(ds), 50))
    assert whole.num_targets_lost == per_window > 0
    dd = datasets.DatasetDict({"train": ds, "test": ds.select(range(40))})
    _, stats = pack_dataset(dd, 32, "wrapped", return_stats=True)
    assert stats["train"].num_targets_lost == pack_dataset(ds, 32, "wrapped", return_stats=True)[1].num_targets_lost


# --------------------------------------------------------------------------- what the log says

def test_summary_and_dict_show_cuts_and_lost_targets(caplog):
    with caplog.at_level(logging.INFO, logger="twinseq.common.data.packing"):
        _, stats = pack_dataset({"input_ids": [list(range(10)), [10, 11, 12], [13]]}, 4, "wrapped", return_stats=True)
    assert "2 split at 3 cuts, lost 3 loss targets" in stats.summary()
    assert any(stats.summary() in r.getMessage() for r in caplog.records)
    assert stats.to_dict()["num_cuts"] == 3 and stats.to_dict()["num_targets_lost"] == 3


def test_bfd_warning_names_the_lost_targets(caplog):
    examples = {"input_ids": [list(range(10))], "completion_mask": [[0] * 5 + [1] * 5]}
    with caplog.at_level(logging.WARNING, logger="twinseq.common.data.packing"):
        pack_dataset(examples, 4, "bfd")
    assert "dropping 6 of 10 tokens (60.00 %) and 5 loss targets" in caplog.records[0].getMessage()


@pytest.mark.parametrize("completion_only_loss, lost", [(None, 1), (False, 2)])
def test_trainer_packing_logs_the_targets_its_collator_loses(caplog, completion_only_loss, lost):
    """StepIterator packs with the config's loss flags, so the logged count is the trained one."""
    rows = {"input_ids": [list(range(1, 11)), [11, 12, 13]], "completion_mask": [[0] * 5 + [1] * 5, [0, 1, 1]]}
    cfg = TrainConfig.from_flat(per_device_train_batch_size=1, gradient_accumulation_steps=1, max_length=4, packing=True,
                      packing_strategy="bfd_split", completion_only_loss=completion_only_loss)
    with caplog.at_level(logging.INFO, logger="twinseq.common.data.packing"):
        it = StepIterator(rows, cfg, pad_token_id=0, seed=0)
    assert any(f"lost {lost} loss targets" in r.getMessage() for r in caplog.records)
    packed = [{c: col[i] for c, col in it.columns.items()} for i in range(it.num_rows)]
    flags = {"completion_only_loss": completion_only_loss}
    assert count_targets(example_rows(rows), **flags) - count_targets(packed, **flags) == lost
