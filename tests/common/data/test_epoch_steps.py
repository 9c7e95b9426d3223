"""Epochs in the step sources (issue 26, item 3), without a framework.

Invariants:
- an epoch is one pass over every row exactly once, across every rank and micro-batch, in a permutation drawn from
  the seed and the epoch number; ``steps_per_epoch = ceil(num_rows / rows_per_step)``;
- the epoch's last step takes the rows left (never the next epoch's), spread over every rank's
  ``gradient_accumulation_steps`` micro-batches; a slot without a row is a padding-only micro-batch; the step total
  ``num_items_in_batch`` counts that short step only;
- a full step keeps the layout of before: micro-batch m of rank r holds rows ``[(m * ws + r) * bs, ... + bs)`` of the
  epoch's order (the golden trajectories depend on it);
- a resume from any step continues with the same micro-batches;
- DPO: the same, by pairs, with the step's pair count on every micro-batch; GRPO: a generation's prompts come from
  one epoch, the incomplete tail is left out (TRL's ``RepeatSampler``);
- ``max_steps=-1`` resolves to ``ceil(num_train_epochs * steps_per_epoch)``; a positive ``max_steps`` wins.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.data.batching import IGNORE_INDEX
from twinseq.common.data.preference_steps import PreferenceStepIterator, with_ref_logps
from twinseq.common.data.prompts import PromptSource
from twinseq.common.data.sft_steps import StepIterator, empty_micro_batch
from twinseq.common.errors import ConfigError, DataError
from twinseq.common.run.runner import _merge_window
from twinseq.common.run.schedule import describe_run_length, resolve_max_steps, with_resolved_max_steps

NUM_ROWS = 11
FIRST = 100  # row i starts with token FIRST + i: a micro-batch's rows are read back from its first column


def _rows(n: int = NUM_ROWS) -> dict[str, list[list[int]]]:
    return {"input_ids": [[FIRST + i, 3, 4, 5][: 2 + i % 3] for i in range(n)]}


def _cfg(**kw) -> TrainConfig:
    return TrainConfig.from_flat(**{"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, **kw})


def _row_ids(batch) -> list[int]:
    return [int(r[0]) - FIRST for r, seg in zip(batch.input_ids, batch.segment_ids) if seg[0] != 0]


def _epoch(iterators) -> list[list[list]]:
    """One epoch of every rank: [step][rank] -> that rank's micro-batches."""
    return [[it.next_step() for it in iterators] for _ in range(iterators[0].steps_per_epoch)]


@pytest.mark.parametrize("world_size, bs, ga", [(1, 2, 2), (2, 2, 2), (3, 2, 2), (2, 1, 3), (1, 4, 1), (4, 3, 2)])
def test_each_epoch_is_every_row_once_with_a_short_last_step(world_size, bs, ga):
    cfg = _cfg(per_device_train_batch_size=bs, gradient_accumulation_steps=ga)
    its = [StepIterator(_rows(), cfg, pad_token_id=0, world_size=world_size, rank=r) for r in range(world_size)]
    rows_per_step = world_size * ga * bs
    assert its[0].steps_per_epoch == math.ceil(NUM_ROWS / rows_per_step)
    orders = []
    for epoch in range(3):
        seen = []
        for step, per_rank in enumerate(_epoch(its)):
            assert all(len(micro) == ga for micro in per_rank), "every rank runs ga micro-batches, short step or not"
            rows = [i for micro in per_rank for b in micro for i in _row_ids(b)]
            full = step < its[0].steps_per_epoch - 1
            assert len(rows) == (rows_per_step if full else NUM_ROWS - step * rows_per_step)
            labels = sum(b.num_label_tokens for micro in per_rank for b in micro)
            assert {b.num_items_in_batch for micro in per_rank for b in micro} == {labels}
            sizes = [len(_row_ids(per_rank[r][m])) for m in range(ga) for r in range(world_size)]
            assert max(sizes) - min(sizes) <= 1 and max(sizes) <= bs, sizes  # spread, never above bs
            seen += rows
        assert sorted(seen) == list(range(NUM_ROWS)), f"epoch {epoch}: {seen}"
        assert all(it.state.epoch == epoch + 1 and it.state.position == 0 for it in its)
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]  # a new permutation per epoch


def test_a_slot_without_a_row_is_a_padding_only_micro_batch():
    # 2 ranks x 2 micro-batches x 2 rows = 8 rows per step; 9 rows leave 1 for the second step: slot 0 only
    its = [StepIterator(_rows(9), _cfg(), pad_token_id=7, world_size=2, rank=r) for r in range(2)]
    _, last = _epoch(its)
    assert [[len(_row_ids(b)) for b in micro] for micro in last] == [[1, 0], [0, 0]]
    empty = last[1][0]
    assert empty.num_tokens == empty.num_label_tokens == 0 and empty.cu_seqlens.tolist() == [0]
    assert (empty.labels == IGNORE_INDEX).all() and (empty.input_ids == 7).all()
    assert empty.num_items_in_batch == last[0][0].num_label_tokens
    assert empty_micro_batch(0, 3, pad_to_multiple_of=8).shape == (1, 8)


def test_full_steps_keep_the_layout_of_before():
    """Micro-batch m of rank r holds rows [(m * ws + r) * bs, ... + bs) of the epoch's permutation."""
    ws, bs, ga, seed = 2, 2, 2, 5
    rows = _rows(40)
    its = [StepIterator(rows, _cfg(seed=seed), pad_token_id=0, world_size=ws, rank=r) for r in range(ws)]
    order = np.random.default_rng([seed, 0]).permutation(40)
    for step in range(4):
        per_rank = [it.next_step() for it in its]
        base = step * ws * ga * bs
        for m in range(ga):
            for r in range(ws):
                start = base + (m * ws + r) * bs
                assert _row_ids(per_rank[r][m]) == order[start : start + bs].tolist()


def test_a_resume_in_the_middle_of_the_second_epoch_continues_with_the_same_batches():
    cfg = _cfg(per_device_train_batch_size=3, gradient_accumulation_steps=1, seed=2)
    straight = StepIterator(_rows(), cfg, pad_token_id=0)
    assert straight.steps_per_epoch == 4
    steps = [straight.next_step() for _ in range(10)]
    first = StepIterator(_rows(), cfg, pad_token_id=0)
    for _ in range(6):  # step 6: halfway through epoch 2
        first.next_step()
    state = first.state_dict()
    assert (state["epoch"], state["position"], state["steps_done"]) == (1, 6, 6)
    resumed = StepIterator(_rows(), cfg, pad_token_id=0)
    resumed.load_state_dict(state)
    for want in steps[6:]:
        got = resumed.next_step()
        assert [_row_ids(b) for b in got] == [_row_ids(b) for b in want]
        assert [b.num_items_in_batch for b in got] == [b.num_items_in_batch for b in want]


def _pairs(n: int) -> dict[str, list[list[int]]]:
    return {
        "prompt_input_ids": [[1, FIRST + i] for i in range(n)],
        "chosen_input_ids": [[8, 9][: 1 + i % 2] for i in range(n)],
        "rejected_input_ids": [[10] for _ in range(n)],
    }


def test_a_dpo_epoch_is_every_pair_once_and_the_short_step_counts_its_pairs():
    rows = with_ref_logps(_pairs(9), np.arange(9.0), -np.arange(9.0))
    it = PreferenceStepIterator(rows, _cfg(task="dpo"), pad_token_id=0)
    assert it.steps_per_epoch == 3 and it.examples_per_step == 4
    for _ in range(2):
        steps = [it.next_step() for _ in range(3)]
        assert [[pb.num_examples for pb in s] for s in steps] == [[2, 2], [2, 2], [1, 0]]
        assert [{pb.num_examples_in_step for pb in s} for s in steps] == [{4}, {4}, {1}]
        chosen = [pb.batch.input_ids[: pb.num_examples] for s in steps for pb in s if pb.num_examples]
        pairs = [int(row[1]) - FIRST for rows_ in chosen for row in rows_]
        assert sorted(pairs) == list(range(9))
    empty = steps[-1][1]
    assert empty.num_docs == 0 and empty.batch.num_tokens == 0 and (empty.target_doc_ids == -1).all()
    assert empty.ref_chosen_logps.shape == empty.ref_rejected_logps.shape == (0,)
    assert empty.batch.num_items_in_batch == steps[-1][0].batch.num_label_tokens


def test_grpo_generations_come_from_one_epoch_and_leave_the_tail_out():
    rows = [{"prompt": str(i)} for i in range(10)]
    src = PromptSource(rows, 3, num_iterations=2, seed=1)
    assert src.steps_per_epoch == 3 * 2  # 10 // 3 generations of 3 prompts, 2 steps each
    for epoch in range(2):
        generations = [src.next_step()[0]["prompts"] for _ in range(src.steps_per_epoch)][::2]
        drawn = [int(p["prompt"]) for g in generations for p in g]
        assert len(drawn) == len(set(drawn)) == 9, (epoch, drawn)
    assert src.epoch == 1
    with pytest.raises(DataError, match="draws 4 prompts per generation.*the data has 3"):
        PromptSource(rows[:3], 4)


@pytest.mark.parametrize("max_steps, epochs, steps_per_epoch, want", [
    (7, 2.0, 6, 7),  # a positive max_steps wins (HF)
    (-1, 2.0, 6, 12),
    (-1, 0.5, 7, 4),  # ceil(3.5)
    (-1, 0.1, 30, 3),  # not ceil(3.0000000000000004)
    (-1, 1e-6, 5, 1),
])
def test_max_steps_minus_one_resolves_from_the_epochs(max_steps, epochs, steps_per_epoch, want):
    cfg = TrainConfig.from_flat(max_steps=max_steps, num_train_epochs=epochs)
    assert resolve_max_steps(cfg, steps_per_epoch) == want


def test_the_resolved_config_feeds_the_schedule():
    class Source:
        steps_per_epoch = 6

    cfg = TrainConfig.from_flat(max_steps=-1, num_train_epochs=2, warmup_ratio=0.25)
    resolved = with_resolved_max_steps(cfg, Source())
    assert (resolved.max_steps, resolved.effective_warmup_steps, resolved.num_train_epochs) == (12, 3, 2.0)
    assert cfg.max_steps == -1  # the caller's config is not changed
    fixed = TrainConfig.from_flat(max_steps=5)
    assert with_resolved_max_steps(fixed, Source()) is fixed
    assert describe_run_length(cfg, 6) == "12 optimizer steps = 2 epochs of 6 steps (num_train_epochs=2, max_steps=-1)"


@pytest.mark.parametrize("values, fragment", [
    (dict(max_steps=0), "max_steps=0 is not valid: pass a positive number of optimizer steps"),
    (dict(max_steps=-2), "max_steps=-2 is not valid"),
    (dict(num_train_epochs=0), "num_train_epochs=0"),
    (dict(num_train_epochs=-1.0), "num_train_epochs=-1.0"),
])
def test_bad_lengths_are_refused(values, fragment):
    with pytest.raises(ConfigError, match=fragment):
        TrainConfig.from_flat(**values)


def test_a_logged_window_keeps_the_epoch_of_its_last_step():
    window = [{"step": s, "epoch": s / 4, "loss": 1.0, "num_tokens": 10, "step_seconds": 1.0} for s in (5, 6)]
    assert _merge_window(window)["epoch"] == 1.5
