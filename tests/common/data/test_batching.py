import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinseq.common.data.batching import IGNORE_INDEX, collate, split_documents

docs_strategy = st.lists(st.lists(st.integers(3, 500), min_size=1, max_size=30), min_size=1, max_size=8)


def _examples(docs, with_mask=False):
    out = []
    for d in docs:
        ex = {"input_ids": d}
        if with_mask:
            ex["completion_mask"] = [0] * (len(d) // 2) + [1] * (len(d) - len(d) // 2)
        out.append(ex)
    return out


@settings(max_examples=150, deadline=None)
@given(docs=docs_strategy, padding_free=st.booleans(), side=st.sampled_from(["right", "left"]),
       multiple=st.sampled_from([None, 1, 4, 8]), with_mask=st.booleans())
def test_batch_contract_invariants(docs, padding_free, side, multiple, with_mask):
    if padding_free and side == "left":
        side = "right"
    b = collate(_examples(docs, with_mask), padding_free=padding_free, padding_side=side, pad_to_multiple_of=multiple)
    B, T = b.input_ids.shape
    assert B == (1 if padding_free else len(docs))
    if multiple:
        assert T % multiple == 0
    for arr in (b.input_ids, b.labels, b.position_ids, b.segment_ids, b.cu_seqlens):
        assert arr.dtype == np.int32
    # No token lost or duplicated, in order.
    assert np.concatenate([d["input_ids"] for d in split_documents(b)]).tolist() == sum(docs, [])
    assert np.diff(b.cu_seqlens).tolist() == [len(d) for d in docs]
    for r in range(B):
        seg, pos, lab = b.segment_ids[r], b.position_ids[r], b.labels[r]
        real = seg != 0
        # Padding is inert.
        assert (lab[~real] == IGNORE_INDEX).all() and (pos[~real] == 0).all() and (b.input_ids[r, ~real] == 0).all()
        ids = seg[real]
        # Segments contiguous and numbered 1..k in order.
        assert (np.diff(ids) >= 0).all() and (np.diff(ids) <= 1).all() and ids[0] == 1
        for s in np.unique(ids):
            idx = np.nonzero(seg == s)[0]
            assert (np.diff(idx) == 1).all()
            # Positions restart at each document; its first token is never a target.
            assert pos[idx].tolist() == list(range(len(idx)))
            assert lab[idx[0]] == IGNORE_INDEX
    assert b.num_items_in_batch == int((b.labels != IGNORE_INDEX).sum())


@settings(max_examples=100, deadline=None)
@given(docs=docs_strategy, with_mask=st.booleans())
def test_padded_and_padding_free_hold_the_same_targets(docs, with_mask):
    padded = collate(_examples(docs, with_mask))
    free = collate(_examples(docs, with_mask), padding_free=True)
    assert padded.num_items_in_batch == free.num_items_in_batch
    for a, c in zip(split_documents(padded), split_documents(free)):
        assert a["input_ids"].tolist() == c["input_ids"].tolist()
        assert a["labels"].tolist() == c["labels"].tolist()


def test_no_target_crosses_a_document_boundary():
    b = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}], padding_free=True)
    # labels[t+1] is the target at t: position 2 (last of doc 1) must predict nothing.
    assert b.labels[0, 3] == IGNORE_INDEX
    allowed = b.attention_allowed()[0]
    assert not allowed[3:, :3].any() and not allowed[:3, 3:].any()
    assert allowed[4, 3] and not allowed[3, 4]


def test_packed_rows_with_seq_lengths_and_left_padding():
    b = collate([{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]}, {"input_ids": [6, 7]}], padding_side="left")
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [0, 0, 0, 6, 7]]
    assert b.segment_ids.tolist() == [[1, 1, 2, 2, 2], [0, 0, 0, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 0, 1, 2], [0, 0, 0, 0, 1]]
    assert b.labels.tolist() == [[-100, 2, -100, 4, 5], [-100, -100, -100, -100, 7]]
    assert b.cu_seqlens.tolist() == [0, 2, 5, 7]


def test_completion_and_assistant_masks():
    ex = {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1], "assistant_masks": [1, 1, 1, 0]}
    b = collate([ex], assistant_only_loss=True)
    assert b.labels.tolist() == [[-100, -100, 3, -100]]
    b = collate([ex], completion_only_loss=False)
    assert b.labels.tolist() == [[-100, 2, 3, 4]]


def test_step_normaliser_is_kept():
    b = collate([{"input_ids": [1, 2, 3]}], num_items_in_batch=17)
    assert b.num_items_in_batch == 17 and b.num_label_tokens == 2


@pytest.mark.parametrize(
    "examples, kwargs, fragment",
    [
        ([], {}, "non-empty list"),
        ([{"text": "hi"}], {}, "no 'input_ids'"),
        ([{"input_ids": [1.5, 2.0]}], {}, "must hold integers"),
        ([{"input_ids": [[1, 2], [3, 4]]}], {}, "flat list"),
        ([{"input_ids": [1, 2], "labels": [1]}], {}, "'labels' has length 1"),
        ([{"input_ids": [1, 2, 3], "seq_lengths": [1, 1]}], {}, "'seq_lengths'"),
        ([{"input_ids": [1, 2]}], {"completion_only_loss": True}, "needs a 'completion_mask'"),
        ([{"input_ids": [1, 2]}], {"assistant_only_loss": True}, "needs an 'assistant_masks'"),
        ([{"input_ids": [1, 2]}], {"padding_side": "middle"}, "padding_side='middle'"),
        ([{"input_ids": [1, 2]}], {"pad_to_multiple_of": 0}, "pad_to_multiple_of=0"),
        ([{"input_ids": [1, 2]}], {"padding_free": True, "padding_side": "left"}, "padding_free=True"),
    ],
)
def test_collate_bad_input(examples, kwargs, fragment):
    with pytest.raises(ValueError, match=None) as err:
        collate(examples, **kwargs)
    assert fragment in str(err.value)
