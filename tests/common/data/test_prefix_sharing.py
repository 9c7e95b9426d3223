"""Prefix sharing in the batch contract: a shared row stands for exactly the unshared documents.

The invariant that makes every backend's shared forward exact: each scored token of a shared row sees the same
(token, position) keys as the same token of its unshared document, and predicts the same target from the same
(token, position). Attention outputs depend only on those, layer by layer, so log-probs and gradients agree.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinseq.common.data.batching import check_batch
from twinseq.common.data.preference_batching import collate_preference
from twinseq.common.data.prefix_sharing import SharedGroup, collate_shared, group_consecutive, unshared_documents
from twinseq.common.errors import DataError
from twinseq.common.objectives.grpo import collate_completions

VOCAB = 50


def _visible(batch, r: int, t: int, allowed) -> Counter:
    keys = np.nonzero(allowed[r, t])[0]
    return Counter(zip(batch.input_ids[r, keys].tolist(), batch.position_ids[r, keys].tolist()))


def _scored(cb, allowed) -> dict[tuple[int, int], tuple]:
    """(completion n, column c) -> (target, predicting token, its position, the keys it sees)."""
    b = cb.batch
    rows, cols = np.nonzero(cb.target_doc_ids >= 0)
    out = {}
    for k, (r, t) in enumerate(zip(rows, cols)):
        key = (int(cb.token_row_n[k]), int(cb.token_col_n[k]))
        out[key] = (
            int(b.labels[r, t + 1]),
            int(b.input_ids[r, t]),
            int(b.position_ids[r, t]),
            _visible(b, r, t, allowed),
        )
    return out


groups_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
        st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=4),
    ),
    min_size=1,
    max_size=3,
)


def _flatten(groups):
    prompts, completions = [], []
    for prompt, comps in groups:
        for c in comps:
            prompts.append(prompt)
            completions.append(c)
    return prompts, completions


@settings(max_examples=60, deadline=None)
@given(groups=groups_strategy, padding_free=st.booleans())
def test_shared_tokens_see_what_unshared_tokens_see(groups, padding_free):
    prompts, completions = _flatten(groups)
    shared = collate_completions(prompts, completions, padding_free=padding_free, share_prefix=True)
    plain = collate_completions(prompts, completions, padding_free=padding_free)
    check_batch(shared.batch, VOCAB)
    got, want = _scored(shared, shared.batch.attention_allowed()), _scored(plain, plain.batch.attention_allowed())
    assert got == want
    # no token lost or duplicated: the shared batch stands for exactly the unshared documents
    docs = unshared_documents(shared.batch)
    assert [d["input_ids"].tolist() for d in docs] == [list(p) + list(c) for p, c in zip(prompts, completions)]
    assert shared.batch.num_items_in_batch == plain.batch.num_items_in_batch == sum(map(len, completions))


@settings(max_examples=30, deadline=None)
@given(groups=groups_strategy)
def test_shared_row_costs_one_prompt_per_group(groups):
    prompts, completions = _flatten(groups)
    shared = collate_completions(prompts, completions, padding_free=True, share_prefix=True)
    expected = 0
    for run in group_consecutive(prompts):
        p = len(prompts[run[0]])
        shares = p > 1 and len(run) > 1
        expected += (p - 1 if shares else 0) + sum(len(completions[i]) + (1 if shares else p) for i in run)
    assert shared.batch.num_tokens == expected


def test_dropping_the_parent_changes_what_tokens_see():
    """Negative control: without ``parent_ids`` the completions lose the prompt, and the invariant catches it."""
    prompts, completions = [[3, 4, 5]] * 2, [[6, 7], [8]]
    shared = collate_completions(prompts, completions, padding_free=True, share_prefix=True)
    plain = collate_completions(prompts, completions, padding_free=True)
    orphan = shared.batch
    orphan.parent_ids = np.zeros_like(orphan.parent_ids)
    assert _scored(shared, orphan.attention_allowed()) != _scored(plain, plain.batch.attention_allowed())


def test_preference_rows_share_their_prompt():
    rows = [
        {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5], "rejected_input_ids": [6]},
        {"prompt_input_ids": [1, 9], "chosen_input_ids": [7], "rejected_input_ids": [8, 8, 8]},
    ]
    for padding_free in (False, True):
        shared = collate_preference(rows, padding_free=padding_free, share_prefix=True)
        plain = collate_preference(rows, padding_free=padding_free)
        assert shared.num_target_tokens.tolist() == plain.num_target_tokens.tolist()
        # each pair writes its prompt once, plus one copy of the prompt's last token for the second completion
        assert shared.batch.num_tokens == plain.batch.num_tokens - sum(len(r["prompt_input_ids"]) - 1 for r in rows)
        assert _preference_targets(shared) == _preference_targets(plain)


def _preference_targets(pb) -> list[tuple]:
    """(document, target, predicting position, the keys it sees) of every scored token."""
    allowed = pb.batch.attention_allowed()
    rs, ts = np.nonzero(pb.target_doc_ids >= 0)
    return sorted(
        (int(pb.target_doc_ids[r, t]), int(pb.batch.labels[r, t + 1]), int(pb.batch.position_ids[r, t]))
        + tuple(sorted(_visible(pb.batch, r, t, allowed).items()))
        for r, t in zip(rs, ts)
    )


def test_a_single_token_prompt_or_a_lone_completion_is_not_shared():
    shared = collate_shared(
        [SharedGroup(np.array([1]), (np.array([4]), np.array([5])), (0, 1))]
        + [SharedGroup(np.array([2, 3]), (np.array([6]),), (2,))],
        padding_free=True,
    )[0]
    assert not shared.shares_prefix
    assert shared.input_ids.tolist() == [[1, 4, 1, 5, 2, 3, 6]]


@pytest.mark.parametrize(
    "parent_ids, match",
    [
        ([[0, 0, 3, 3, 3, 1, 1]], "not an earlier segment"),
        ([[0, 0, 1, 2, 2, 1, 1]], "differ within the segment"),
        ([[0, 0, 1, 1]], "shape"),
    ],
)
def test_bad_parent_ids_are_refused(parent_ids, match):
    b = collate_completions([[1, 5, 6]] * 2, [[7, 2], [8]], padding_free=True, share_prefix=True).batch
    b.parent_ids = np.asarray(parent_ids, np.int32)
    with pytest.raises(DataError, match=match):
        check_batch(b, VOCAB)


def test_a_parent_whose_positions_overlap_is_refused():
    b = collate_completions([[1, 5, 6]] * 2, [[7, 2], [8]], padding_free=True, share_prefix=True).batch
    b.position_ids = b.position_ids.copy()
    b.position_ids[0, 2:5] -= 2  # the first child restarts at 0: it would see its parent's tokens as its future
    with pytest.raises(DataError, match="continues its parent's positions"):
        check_batch(b, VOCAB)
