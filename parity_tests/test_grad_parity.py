"""Loss, gradient and metric parity of torch and jax for ``nll``, ``chunked_nll``, ``fused_linear``.

Invariants (float32, identical weights and batches, padded and padding-free):
- torch and jax give the same scalar loss (``loss_rel``) and, per parameter tensor, the same
  gradient (``grad_rel``), under the same HF names and ``[out, in]`` layout;
- within each backend, chunked and fused losses equal the full ``nll`` (loss and gradients);
- the gradients are the derivative of the float64 numpy reference loss: per tensor, the
  directional derivative along a random direction matches a central finite difference;
- the metrics (token accuracy, entropy, token count) match ``twinseq.common.objectives.nll.metrics``.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests import numpy_reference
from parity_tests.inputs import LAYOUTS, rel_norm
from parity_tests.tolerances import tol
from twinseq.common.objectives import nll as ref_loss

pytest.importorskip("torch")
pytest.importorskip("jax")

LOSS_TYPES = ("nll", "chunked_nll", "fused_linear")


def _worst(a: dict, b: dict) -> tuple[str, float]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    rel = {k: rel_norm(a[k], b[k]) for k in b}
    name = max(rel, key=rel.get)
    return name, rel[name]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_and_jax_agree(harness, layout, loss_type):
    jax_loss, jax_grads, _ = harness.jax_grads(layout, loss_type)
    torch_loss, torch_grads, _ = harness.torch_grads(layout, loss_type)
    for name, grad in jax_grads.items():
        assert grad.shape == harness.weights[name].shape and grad.dtype == np.float32, name
        assert np.isfinite(grad).all(), name
    worst, rel = _worst(jax_grads, torch_grads)
    loss_rel = abs(jax_loss - torch_loss) / abs(torch_loss)
    print(f"{layout} {loss_type}: loss rel {loss_rel:.2e}, worst grad rel {rel:.2e} ({worst})")
    assert loss_rel <= tol("float32", "loss_rel")
    assert rel <= tol("float32", "grad_rel"), worst


@pytest.mark.parametrize("loss_type", ("chunked_nll", "fused_linear"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_and_fused_equal_nll(harness, layout, loss_type):
    for backend in ("jax", "torch"):
        results = harness.jax_grads if backend == "jax" else harness.torch_grads
        nll_loss, nll_grads, _ = results(layout, "nll")
        loss, grads, _ = results(layout, loss_type)
        worst, rel = _worst(grads, nll_grads)
        print(f"{backend} {layout} {loss_type} vs nll: loss rel {abs(loss - nll_loss) / nll_loss:.2e}, "
              f"worst grad rel {rel:.2e} ({worst})")
        assert abs(loss - nll_loss) <= tol("float32", "loss_rel") * abs(nll_loss), backend
        assert rel <= tol("float32", "grad_rel"), (backend, worst)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_matches_reference(harness, layout):
    batch = harness.batches[layout]
    expected = ref_loss.nll_loss(harness.reference_logits(layout), batch.labels, batch.num_items_in_batch)
    for loss_type in LOSS_TYPES:
        for backend, results in (("jax", harness.jax_grads), ("torch", harness.torch_grads)):
            loss = results(layout, loss_type)[0]
            assert abs(loss - expected) <= tol("float32", "loss_rel") * expected, (backend, loss_type, loss, expected)


def test_metrics_match_reference(harness):
    layout = "padding_free"
    batch = harness.batches[layout]
    expected = ref_loss.metrics(harness.reference_logits(layout), batch.labels)
    for loss_type in LOSS_TYPES:
        for backend, results in (("jax", harness.jax_grads), ("torch", harness.torch_grads)):
            metrics = results(layout, loss_type)[2]
            assert metrics["num_tokens"] == expected["num_tokens"] == batch.num_label_tokens
            assert metrics["mean_token_accuracy"] == expected["mean_token_accuracy"], (backend, loss_type)
            assert abs(metrics["entropy"] - expected["entropy"]) <= tol("float32", "entropy_rel") * expected["entropy"]


def _reference_loss(harness, layout: str, weights: dict) -> float:
    batch = harness.batches[layout]
    logits_BTV = numpy_reference.logits(harness.cfg, weights, batch)
    return ref_loss.nll_loss(logits_BTV, batch.labels, batch.num_items_in_batch)


def test_gradients_are_the_reference_derivative(harness):
    """<grad, d> vs the float64 central difference of the reference loss, one random d per tensor,
    relative to ||grad|| (padding-free layout: several documents and padding in one row).

    At eps = 1e-5 the central difference's truncation error is ~1e-7 relative (1e-5 at
    eps = 1e-4 on the embedding, measured) and its float64 rounding error ~1e-9.
    """
    layout = "padding_free"
    rng = np.random.default_rng(123)
    w64 = {k: v.astype(np.float64) for k, v in harness.weights.items()}
    eps = 1e-5
    worst = {"jax": 0.0, "torch": 0.0}
    grads = {"jax": harness.jax_grads(layout, "nll")[1], "torch": harness.torch_grads(layout, "nll")[1]}
    for name in w64:
        direction = rng.standard_normal(w64[name].shape)
        plus = _reference_loss(harness, layout, {**w64, name: w64[name] + eps * direction})
        minus = _reference_loss(harness, layout, {**w64, name: w64[name] - eps * direction})
        finite_difference = (plus - minus) / (2 * eps)
        for backend, g in grads.items():
            g64 = g[name].astype(np.float64)
            directional = float(np.sum(g64 * direction))
            # For d ~ N(0, I), E[<dg, d>^2] = ||dg||^2: this is the per-tensor relative gradient error
            # (as grad_rel) seen along d. Dividing by |<g, d>| instead would divide by a random
            # projection that can come arbitrarily close to 0.
            rel = abs(directional - finite_difference) / np.linalg.norm(g64)
            worst[backend] = max(worst[backend], rel)
            assert rel <= tol("float32", "grad_directional_rel"), (backend, name, directional, finite_difference)
    print(f"{layout}: worst directional-derivative error / ||grad||: {worst}")
