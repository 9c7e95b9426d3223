"""The numpy loss reference (common/objectives/nll.py): the shift, normalisation and metrics.

Everything else (both backends' parity tests) is checked against these functions, so they
are checked here against first principles: brute-force sums, closed forms, and the
padded / padding-free equivalence of the data contract.
"""

import logging
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinseq.common.objectives import nll as L
from twinseq.common.data.batching import collate

IGN = L.IGNORE_INDEX


def _brute_nll(logits, targets):
    """Per-element loops in Python floats: the definition, no vectorisation."""
    out = np.zeros(targets.shape)
    for b in range(targets.shape[0]):
        for t in range(targets.shape[1]):
            if targets[b, t] == IGN:
                continue
            row = [float(x) for x in logits[b, t]]
            m = max(row)
            lse = m + math.log(sum(math.exp(x - m) for x in row))
            out[b, t] = lse - row[targets[b, t]]
    return out


def test_shift_labels_moves_left_and_ends_ignored():
    labels = np.array([[-100, 6, 7, -100, 9], [1, 2, 3, 4, 5]])
    targets = L.shift_labels(labels)
    assert targets.tolist() == [[6, 7, -100, 9, -100], [2, 3, 4, 5, -100]]
    assert targets.dtype == labels.dtype


def test_shift_labels_rejects_1d():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        L.shift_labels(np.array([1, 2, 3]))


def test_log_softmax_is_stable_for_huge_logits():
    logits = np.array([[1e4, 1e4 - 1.0, -1e4]])
    logp = L.log_softmax(logits)
    assert np.isfinite(logp).all()
    np.testing.assert_allclose(np.exp(logp).sum(-1), 1.0, rtol=1e-15)
    np.testing.assert_allclose(logp[0, :2], L.log_softmax(np.array([[1.0, 0.0]]))[0], rtol=1e-14)


def test_token_nll_matches_brute_force():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, 11)) * 3
    targets = rng.integers(0, 11, size=(2, 6))
    targets[0, 2] = targets[1, 5] = IGN
    got = L.token_nll(logits, targets)
    np.testing.assert_allclose(got, _brute_nll(logits, targets), rtol=1e-13, atol=0)
    assert got[0, 2] == 0.0 and got[1, 5] == 0.0


def test_nll_loss_of_uniform_logits_is_log_vocab_times_fraction():
    labels = np.array([[-100, 3, 1, -100, 2, 2]])  # 4 targets after the shift: 3, 1, 2, 2
    loss = L.nll_loss(np.zeros((1, 6, 7)), labels, num_items_in_batch=5)
    assert loss == pytest.approx(4 * math.log(7) / 5, rel=1e-15)


def test_nll_loss_of_all_ignored_microbatch_is_exactly_zero():
    labels = np.full((2, 4), IGN)
    assert L.nll_loss(np.random.default_rng(1).normal(size=(2, 4, 5)), labels, 10) == 0.0


def test_zero_items_for_the_step_returns_zero_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="twinseq.common.objectives.nll"):
        assert L.nll_loss(np.zeros((1, 3, 4)), np.full((1, 3), IGN), 0) == 0.0
    assert "num_items_in_batch=0" in caplog.text


@pytest.mark.parametrize("num_items", [1, -1, 2.5])
def test_num_items_smaller_than_local_count_or_invalid_raises(num_items):
    labels = np.array([[0, 1, 2, 3]])  # 3 targets
    with pytest.raises(ValueError, match="num_items_in_batch"):
        L.nll_loss(np.zeros((1, 4, 5)), labels, num_items)


@pytest.mark.parametrize("bad", [5, -1, -7])
def test_label_outside_vocab_raises(bad):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        L.nll_loss(np.zeros((1, 3, 5)), np.array([[0, bad, 1]]), 3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=2, max_size=8), st.integers(0, 2**31 - 1))
def test_summing_microbatch_losses_gives_the_step_mean(cuts, seed):
    """ANCHORS failure 8: any split of the step, each part normalised by the step's count."""
    rng = np.random.default_rng(seed)
    num_rows, T, V = 8, 6, 5
    logits = rng.normal(size=(num_rows, T, V))
    labels = np.where(rng.random((num_rows, T)) < 0.4, IGN, rng.integers(0, V, (num_rows, T)))
    total = int((L.shift_labels(labels) != IGN).sum())
    bounds = sorted({0, num_rows, *[c % num_rows for c in cuts]})
    parts = sum(L.nll_loss(logits[a:b], labels[a:b], total) for a, b in zip(bounds, bounds[1:]))
    expected = L.token_nll(logits, L.shift_labels(labels)).sum() / max(total, 1)
    assert parts == pytest.approx(expected, rel=1e-12, abs=1e-15)


def _toy_logits(batch, vocab=13):
    """A 'model' whose logits depend only on (token, position in document): the same document
    gives the same logits whether it is padded or packed."""
    rng = np.random.default_rng(42)
    tok_table, pos_table = rng.normal(size=(50, vocab)), rng.normal(size=(64, vocab))
    return tok_table[batch.input_ids] + pos_table[batch.position_ids]


def test_per_document_loss_padded_equals_padding_free():
    examples = [{"input_ids": [3, 4, 5, 6]}, {"input_ids": [7, 8]}, {"input_ids": [9, 10, 11]},
                {"input_ids": [12]}]
    padded = collate(examples, padding_free=False)
    packed = collate(examples, padding_free=True)
    docs_pad = L.per_document_loss(_toy_logits(padded), padded.labels, padded.segment_ids)
    docs_free = L.per_document_loss(_toy_logits(packed), packed.labels, packed.segment_ids)
    np.testing.assert_array_equal(docs_pad["count"], [3, 1, 2, 0])
    np.testing.assert_array_equal(docs_free["count"], docs_pad["count"])
    np.testing.assert_allclose(docs_free["nll_sum"], docs_pad["nll_sum"], rtol=1e-14)
    assert docs_free["row"].tolist() == [0, 0, 0, 0] and docs_free["segment"].tolist() == [1, 2, 3, 4]


def test_per_document_sums_add_up_to_the_loss():
    examples = [{"input_ids": [3, 4, 5, 6], "completion_mask": [0, 0, 1, 1]}, {"input_ids": [7, 8, 9]}]
    batch = collate(examples, padding_free=True)
    logits = _toy_logits(batch)
    docs = L.per_document_loss(logits, batch.labels, batch.segment_ids)
    assert docs["count"].sum() == batch.num_items_in_batch == L.num_tokens(batch.labels)
    assert docs["nll_sum"].sum() / batch.num_items_in_batch == pytest.approx(
        L.nll_loss(logits, batch.labels, batch.num_items_in_batch), rel=1e-14)


def test_mean_token_accuracy_counts_argmax_hits_over_valid_targets():
    logits = np.zeros((1, 4, 3))
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 0] = 5.0  # predicts 1, 2, 0, (tie -> 0)
    labels = np.array([[-100, 1, 0, 2]])  # targets 1, 0, 2, ignored
    assert L.mean_token_accuracy(logits, labels) == pytest.approx(1 / 3)
    labels_tie = np.array([[-100, 1, -100, 0]])  # targets 1, ignored, 0: position 2 predicts 0 -> hit
    assert L.mean_token_accuracy(logits, labels_tie) == 1.0


def test_entropy_closed_forms():
    V = 6
    uniform = np.zeros((1, 3, V))
    labels = np.array([[0, 1, 2]])
    assert L.entropy(uniform, labels) == pytest.approx(math.log(V), rel=1e-14)
    peaked = np.full((1, 3, V), -1e3)
    peaked[..., 0] = 0.0
    assert L.entropy(peaked, labels) == pytest.approx(0.0, abs=1e-12)


def test_metrics_of_all_ignored_batch_are_zero():
    m = L.metrics(np.ones((1, 3, 4)), np.full((1, 3), IGN))
    assert m == {"mean_token_accuracy": 0.0, "entropy": 0.0, "num_tokens": 0}


def test_loss_module_imports_without_torch_or_jax():
    code = ("import sys\n"
            "for name in ('torch', 'jax', 'jaxlib', 'flax', 'optax'): sys.modules[name] = None\n"
            "import twinseq.common.objectives.nll\n")
    subprocess.run([sys.executable, "-c", code], check=True)
