"""Forward parity: logits and per-token loss of torch, jax and the float64 numpy reference.

Invariants (float32, tiny preset, identical weights and batches):
- every non-padding logit agrees within ``logits_abs`` across the three;
- every per-token NLL agrees within ``token_loss_abs`` across the three;
- padding positions are finite in both backends (a padding row must not produce NaN);
- padded and padding-free layouts of the same documents give the same per-document loss.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.inputs import LAYOUTS, valid_positions
from parity_tests.tolerances import tol
from twinseq.common.objectives.nll import per_document_loss, shift_labels, token_nll

pytest.importorskip("torch")
pytest.importorskip("jax")


def _max_abs(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))[where].max())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_agree(harness, layout):
    batch = harness.batches[layout]
    valid = valid_positions(batch)
    jax_BTV, _ = harness.jax_forward(layout)
    torch_BTV, _ = harness.torch_forward(layout)
    ref_BTV = harness.reference_logits(layout)
    assert jax_BTV.dtype == np.float32 and jax_BTV.shape == (*batch.shape, harness.cfg.vocab_size)
    assert np.isfinite(jax_BTV).all() and np.isfinite(torch_BTV).all()
    diffs = {"torch-jax": _max_abs(torch_BTV, jax_BTV, valid), "jax-ref": _max_abs(jax_BTV, ref_BTV, valid),
             "torch-ref": _max_abs(torch_BTV, ref_BTV, valid)}
    print(f"{layout} logits max abs diff: {diffs}")
    assert max(diffs.values()) <= tol("float32", "logits_abs"), diffs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_losses_agree(harness, layout):
    batch = harness.batches[layout]
    targets_BT = shift_labels(batch.labels)
    scored = targets_BT != -100
    _, jax_BT = harness.jax_forward(layout)
    _, torch_BT = harness.torch_forward(layout)
    ref_BT = token_nll(harness.reference_logits(layout), targets_BT)
    assert (jax_BT[~scored] == 0).all(), "ignored targets must have exactly zero loss"
    everywhere = np.ones_like(scored)
    diffs = {"torch-jax": _max_abs(torch_BT, jax_BT, everywhere), "jax-ref": _max_abs(jax_BT, ref_BT, everywhere),
             "torch-ref": _max_abs(torch_BT, ref_BT, everywhere)}
    print(f"{layout} per-token loss max abs diff: {diffs}")
    assert max(diffs.values()) <= tol("float32", "token_loss_abs"), diffs


def test_padded_and_padding_free_give_the_same_document_losses(harness):
    """The per-document NLL sums of both layouts agree, in each backend (DESIGN: same thing)."""
    for name, forward in (("jax", harness.jax_forward), ("torch", harness.torch_forward)):
        docs = {}
        for layout in LAYOUTS:
            batch = harness.batches[layout]
            logits_BTV, _ = forward(layout)
            docs[layout] = per_document_loss(logits_BTV, batch.labels, batch.segment_ids)
        np.testing.assert_array_equal(docs["padded"]["count"], docs["padding_free"]["count"])
        assert docs["padded"]["count"].sum() == harness.batches["padded"].num_items_in_batch
        per_token_bound = tol("float32", "token_loss_abs")
        bound = per_token_bound * docs["padded"]["count"]  # each summed token may differ by the per-token bound
        diff = np.abs(docs["padded"]["nll_sum"] - docs["padding_free"]["nll_sum"])
        print(f"{name}: per-document NLL sum diff padded vs padding-free {diff.max():.2e}")
        assert (diff <= bound).all(), (name, diff, bound)
