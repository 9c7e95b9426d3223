"""Preference batches: layout, prompt masking, and per-sequence log-probs equal in padded and
padding-free form (and equal to a direct per-example computation)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinseq.common.data.batching import IGNORE_INDEX
from twinseq.common.objectives.dpo import dpo_loss
from twinseq.common.data.preference_batching import (collate_preference, sequence_logps_from_logits,
                                         sequence_logps_from_tokens, token_logps_from_logits)

VOCAB = 11
_rng = np.random.default_rng(0)
# A bigram "model": the log-prob of token j after token i is LOGP[i, j]. It sees only the previous
# token, so the expected sequence log-prob of an example can be computed without any batch.
LOGITS_VV = _rng.normal(size=(VOCAB, VOCAB))
LOGP_VV = LOGITS_VV - np.log(np.exp(LOGITS_VV).sum(axis=1, keepdims=True))


def _row(prompt, chosen, rejected, **extra):
    return {"prompt_input_ids": prompt, "chosen_input_ids": chosen, "rejected_input_ids": rejected, **extra}


EXAMPLES = [_row([1, 2, 3], [4, 5], [6]), _row([7], [8, 9, 10, 1], [2, 3]), _row([4, 4], [5], [6, 7, 8])]


def _direct_logps(prompt, completion):
    """Σ over completion tokens of log p(token | previous token), straight from the definition."""
    seq = list(prompt) + list(completion)
    start = max(len(prompt), 1)   # with no prompt the first completion token has no context
    return sum(LOGP_VV[seq[t - 1], seq[t]] for t in range(start, len(seq)))


def _bigram_token_logps(input_ids_BT):
    """[B, T]: log-prob of input_ids[t + 1] after input_ids[t] everywhere, boundaries and padding
    included (garbage there); the last column, which has no next token, is NaN."""
    out = np.full(input_ids_BT.shape, np.nan)
    out[:, :-1] = LOGP_VV[input_ids_BT[:, :-1], input_ids_BT[:, 1:]]
    return out


def test_layout_padded_and_padding_free():
    ex = [_row([5, 6], [7, 8], [9]), _row([1], [2], [3, 4])]
    padded = collate_preference(ex)
    # Documents: chosen_0, chosen_1, rejected_0, rejected_1; one row each; prompts masked.
    assert padded.batch.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 0, 0], [5, 6, 9, 0], [1, 3, 4, 0]]
    assert padded.batch.labels.tolist() == [[-100, -100, 7, 8], [-100, 2, -100, -100],
                                            [-100, -100, 9, -100], [-100, 3, 4, -100]]
    assert padded.target_doc_ids.tolist() == [[-1, 0, 0, -1], [1, -1, -1, -1], [-1, 2, -1, -1], [3, 3, -1, -1]]
    assert padded.doc_example_index.tolist() == [0, 1, 0, 1]
    assert padded.doc_is_chosen.tolist() == [True, True, False, False]
    assert padded.chosen_num_tokens.tolist() == [2, 1] and padded.rejected_num_tokens.tolist() == [1, 2]

    free = collate_preference(ex, padding_free=True, pad_to_multiple_of=8)
    assert free.batch.input_ids.tolist() == [[5, 6, 7, 8, 1, 2, 5, 6, 9, 1, 3, 4, 0, 0, 0, 0]]
    assert free.batch.segment_ids.tolist() == [[1, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4, 0, 0, 0, 0]]
    assert free.target_doc_ids.tolist() == [[-1, 0, 0, -1, 1, -1, -1, 2, -1, 3, 3, -1, -1, -1, -1, -1]]
    assert free.batch.cu_seqlens.tolist() == padded.batch.cu_seqlens.tolist() == [0, 4, 6, 9, 12]
    np.testing.assert_array_equal(free.num_target_tokens, padded.num_target_tokens)


@pytest.mark.parametrize("padding_free,multiple", [(False, None), (False, 4), (True, None), (True, 16)])
def test_labels_are_exactly_the_completion_tokens(padding_free, multiple):
    pb = collate_preference(EXAMPLES, padding_free=padding_free, pad_to_multiple_of=multiple)
    b = pb.batch
    completions = [e["chosen_input_ids"] for e in EXAMPLES] + [e["rejected_input_ids"] for e in EXAMPLES]
    for d, completion in enumerate(completions):
        r = 0 if padding_free else d
        in_doc = b.segment_ids[r] == (d + 1 if padding_free else 1)
        assert b.labels[r][in_doc][b.labels[r][in_doc] != IGNORE_INDEX].tolist() == completion
        assert b.input_ids[r][in_doc][-len(completion):].tolist() == completion
    total = sum(map(len, completions))
    assert b.num_items_in_batch == b.num_label_tokens == int(pb.num_target_tokens.sum()) == total
    # Every target position maps to exactly one document, and only target positions do.
    assert ((pb.target_doc_ids >= 0) == np.pad(b.labels[:, 1:] != IGNORE_INDEX, ((0, 0), (0, 1)))).all()


token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=6)
rows_strategy = st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                                   token_lists.filter(bool), token_lists.filter(bool)), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, multiple=st.sampled_from([None, 3, 8]))
def test_padded_and_padding_free_give_the_same_sequence_logps(rows, multiple):
    examples = [_row(*r) for r in rows]
    want_c = np.array([_direct_logps(p, c) for p, c, _ in rows])
    want_r = np.array([_direct_logps(p, r) for p, _, r in rows])
    for padding_free in (False, True):
        pb = collate_preference(examples, padding_free=padding_free, pad_to_multiple_of=multiple)
        chosen, rejected = sequence_logps_from_tokens(_bigram_token_logps(pb.batch.input_ids), pb)
        # The NaN and cross-document garbage outside the targets must not leak in.
        np.testing.assert_allclose(chosen, want_c, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(rejected, want_r, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(pb.chosen_num_tokens, [len(c) for _, c, _ in rows])


@pytest.mark.parametrize("padding_free", [False, True])
def test_sequence_logps_from_logits_match_direct(padding_free):
    pb = collate_preference(EXAMPLES, padding_free=padding_free, pad_to_multiple_of=4)
    logits_BTV = LOGITS_VV[pb.batch.input_ids] * 1.0
    chosen, rejected = sequence_logps_from_logits(logits_BTV, pb)
    np.testing.assert_allclose(chosen, [_direct_logps(e["prompt_input_ids"], e["chosen_input_ids"])
                                        for e in EXAMPLES], rtol=1e-12)
    np.testing.assert_allclose(rejected, [_direct_logps(e["prompt_input_ids"], e["rejected_input_ids"])
                                          for e in EXAMPLES], rtol=1e-12)
    assert (token_logps_from_logits(logits_BTV, pb)[pb.target_doc_ids < 0] == 0).all()


def test_feeds_the_dpo_loss_with_length_normalised_ipo():
    pb = collate_preference(EXAMPLES, padding_free=True)
    chosen, rejected = sequence_logps_from_tokens(_bigram_token_logps(pb.batch.input_ids), pb)
    out = dpo_loss(chosen, rejected, chosen - 1.0, rejected + 1.0, loss_type="ipo", beta=0.5,
                   chosen_num_tokens=pb.chosen_num_tokens, rejected_num_tokens=pb.rejected_num_tokens)
    # c = 1, r = -1 for every example: (1/n_c + 1/n_r - 1)² with (n_c, n_r) = (2, 1), (4, 2), (1, 3).
    np.testing.assert_allclose(out.losses, [(0.5 + 1 - 1) ** 2, (0.25 + 0.5 - 1) ** 2, (1 + 1 / 3 - 1) ** 2])


def test_empty_prompt_leaves_first_completion_token_unscored():
    pb = collate_preference([_row([], [3, 4, 5], [6, 7])])
    assert pb.chosen_num_tokens.tolist() == [2] and pb.rejected_num_tokens.tolist() == [1]
    chosen, rejected = sequence_logps_from_tokens(_bigram_token_logps(pb.batch.input_ids), pb)
    np.testing.assert_allclose(chosen, [LOGP_VV[3, 4] + LOGP_VV[4, 5]])
    np.testing.assert_allclose(rejected, [LOGP_VV[6, 7]])


def test_precomputed_reference_logps_are_carried():
    rows = [dict(e, ref_chosen_logps=-1.5 * i, ref_rejected_logps=-2.5 * i) for i, e in enumerate(EXAMPLES)]
    pb = collate_preference(rows, padding_free=True)
    assert pb.ref_chosen_logps.tolist() == [0.0, -1.5, -3.0]
    assert pb.ref_rejected_logps.tolist() == [0.0, -2.5, -5.0]
    assert collate_preference(EXAMPLES).ref_chosen_logps is None


@pytest.mark.parametrize("rows,match", [
    ([_row([1], [2], []), ], r"example 0: 'rejected_input_ids' is empty.*drop such rows upstream"),
    ([_row([1], [2], [3]), _row([1, 2], [], [3])], r"example 1: 'chosen_input_ids' is empty"),
    ([_row([], [2], [3, 4])], r"example 0: the chosen sequence has no scored completion token"),
    ([_row([1], [2], [3]), _row([], [5, 6], [4])], r"example 1: the rejected sequence has no scored"),
    ([{"prompt_input_ids": [1], "chosen_input_ids": [2]}], r"example 0 lacks \['rejected_input_ids'\]"),
    ([_row([1], [[2, 3]], [4])], r"'chosen_input_ids' must be a flat list of integers"),
    ([_row([1], [2], [3], ref_chosen_logps=-1.0), _row([1], [2], [3])], r"'ref_chosen_logps' is set on 1 of 2"),
    ([], r"needs a non-empty list of preference rows"),
])
def test_contract_violations_raise_clear_errors(rows, match):
    for padding_free in (False, True):
        with pytest.raises(ValueError, match=match):
            collate_preference(rows, padding_free=padding_free)


def test_token_logps_shape_is_checked():
    pb = collate_preference(EXAMPLES)
    with pytest.raises(ValueError, match=r"token_logps shape \(6, 4\) must equal the batch shape \(6, 5\)"):
        sequence_logps_from_tokens(np.zeros((6, 4)), pb)
