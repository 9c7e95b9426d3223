"""Gradient accumulation at the model level (ANCHORS failure 8).

Invariant: with every micro-batch normalised by the label count of the whole optimizer step
(``num_items_in_batch``), summed micro-batch gradients do not depend on the split: 1x8, 4x2
and 8x1 give the same gradients (1e-6 relative per tensor), for padded and padding-free
batches, even when the micro-batches hold very different numbers of labels.
"""

from __future__ import annotations

import numpy as np
import pytest

from twinseq.common.data.batching import collate
from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.torch_backend.model import build_model, loss_and_grads

LENGTHS = (6, 31, 9, 40, 5, 18, 27, 12)
PROMPT_FRACTION = (0.0, 0.9, 0.2, 0.5, 0.0, 0.7, 0.1, 0.4)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny")
    return build_model(cfg, init_weights(cfg, seed=0), attn_implementation="varlen")


@pytest.fixture(scope="module")
def sdpa_model():
    cfg = ModelConfig.preset("tiny")
    return build_model(cfg, init_weights(cfg, seed=0), attn_implementation="sdpa")


@pytest.fixture(scope="module")
def examples():
    rng = np.random.default_rng(3)
    out = []
    for n, frac in zip(LENGTHS, PROMPT_FRACTION):
        mask = np.ones(n, dtype=np.int64)
        mask[: int(frac * n)] = 0
        out.append({"input_ids": rng.integers(3, 8000, n).tolist(), "completion_mask": mask.tolist()})
    return out


def accumulate(model, examples, micro_size, padding_free, normalise_per_micro=False):
    micro = [collate(examples[i:i + micro_size], padding_free=padding_free)
             for i in range(0, len(examples), micro_size)]
    step_items = sum(b.num_label_tokens for b in micro)
    total_loss, total = 0.0, None
    for b in micro:
        b = b if normalise_per_micro else b.with_num_items(step_items)
        loss, grads = loss_and_grads(model, b)
        scale = 1.0 / len(micro) if normalise_per_micro else 1.0
        total_loss += loss * scale
        total = {k: g * scale for k, g in grads.items()} if total is None else \
            {k: total[k] + g * scale for k, g in grads.items()}
    return total_loss, total, [b.num_label_tokens for b in micro]


def max_rel_err(grads, ref):
    return max(float(np.linalg.norm(grads[k] - ref[k]) / np.linalg.norm(ref[k])) for k in ref)


@pytest.mark.parametrize("attn,padding_free", [("varlen", False), ("varlen", True), ("sdpa", False)],
                         ids=["varlen-padded", "varlen-padding_free", "sdpa-padded"])
def test_split_does_not_change_loss_or_gradients(request, examples, attn, padding_free):
    model = request.getfixturevalue("model" if attn == "varlen" else "sdpa_model")
    ref_loss, ref, _ = accumulate(model, examples, 8, padding_free)
    for micro_size in (1, 2):
        loss, grads, counts = accumulate(model, examples, micro_size, padding_free)
        assert len(set(counts)) > 2, "micro-batches must hold uneven label counts"
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert max_rel_err(grads, ref) <= 1e-6, (micro_size, max_rel_err(grads, ref))


def test_padded_and_padding_free_steps_agree(model, examples):
    loss_a, grads_a, _ = accumulate(model, examples, 2, False)
    loss_b, grads_b, _ = accumulate(model, examples, 2, True)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert max_rel_err(grads_a, grads_b) <= 1e-5


def test_per_micro_batch_normalisation_is_detectably_wrong(model, examples):
    """The negative control: averaging per-micro-batch means (the HF bug) changes the gradients."""
    _, ref, _ = accumulate(model, examples, 8, True)
    _, wrong, _ = accumulate(model, examples, 1, True, normalise_per_micro=True)
    assert max_rel_err(wrong, ref) > 1e-2
