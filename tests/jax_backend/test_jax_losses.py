"""JAX causal-LM losses: ``chunked_nll`` and ``fused_linear`` are ``nll``, in less memory.

Invariants:
- for any chunk size (dividing N or not, larger than N), any vocabulary size (the fused
  backward's vocabulary chunks overlap when they do not divide V), an all-ignored chunk and
  an all-ignored batch: loss and gradients (hidden and LM head) equal ``nll`` within the
  float32 parity bounds, and ``nll`` equals the float64 numpy reference;
- an all-ignored batch has loss exactly 0 and gradients exactly 0 (finite);
- the metrics equal ``twinseq.common.objectives.nll.metrics``;
- ``fused_linear`` and ``chunked_nll`` never hold an [N, V] array (checked on the jaxpr),
  while ``nll`` does (so the check can fail), and the compiled temp memory is 8x smaller.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests.inputs import rel_norm
from parity_tests.tolerances import tol
from twinseq.common.objectives import nll as ref_loss
from twinseq.jax_backend.losses import LOSS_TYPES, causal_lm_loss, check_labels, shift_labels


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _problem(b: int, t: int, h: int, v: int, seed: int = 0, ignore_rows: tuple = ()):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((b, t, h), dtype=np.float32)
    weight = (rng.standard_normal((v, h), dtype=np.float32) * 0.2).astype(np.float32)
    labels = rng.integers(0, v, (b, t)).astype(np.int32)
    labels[rng.random((b, t)) < 0.3] = -100
    for r in ignore_rows:
        labels[r] = -100
    return hidden, weight, labels


def _value_and_grads(loss_type, hidden, weight, labels, num_items, chunk_size):
    def f(h, w):
        return causal_lm_loss(h, w, labels, num_items, loss_type, chunk_size=chunk_size)

    loss, (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, weight)
    return float(loss), np.asarray(dh), np.asarray(dw)


# (B, T, H, V, chunk_size): chunk divides N; does not; exceeds N; V prime (overlapping vocab chunks)
CASES = [(2, 16, 8, 64, 8), (3, 10, 8, 50, 7), (1, 5, 4, 33, 64), (2, 12, 8, 97, 5)]


@pytest.mark.parametrize("loss_type", ["chunked_nll", "fused_linear"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}T{c[1]}V{c[3]}c{c[4]}" for c in CASES])
def test_chunked_and_fused_equal_nll(loss_type, case):
    b, t, h, v, chunk = case
    # row 0 all-ignored: with these shapes at least one chunk of the flattened tokens is all-ignored
    hidden, weight, labels = _problem(b, t, h, v, seed=sum(case), ignore_rows=(0,))
    num_items = int((labels[:, 1:] != -100).sum())
    ref = _value_and_grads("nll", hidden, weight, labels, num_items, chunk)
    got = _value_and_grads(loss_type, hidden, weight, labels, num_items, chunk)
    assert abs(got[0] - ref[0]) <= tol("float32", "loss_rel") * abs(ref[0])
    assert rel_norm(got[1], ref[1]) <= tol("float32", "grad_rel")
    assert rel_norm(got[2], ref[2]) <= tol("float32", "grad_rel")
    logits = np.einsum("bth,vh->btv", hidden.astype(np.float64), weight.astype(np.float64))
    assert ref[0] == pytest.approx(ref_loss.nll_loss(logits, labels, num_items), rel=tol("float32", "loss_rel"))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_ignored_batch_is_zero_with_zero_grads(loss_type):
    hidden, weight, labels = _problem(2, 6, 4, 16, ignore_rows=(0, 1))
    for num_items in (0, 5):  # nothing valid here, whether or not other micro-batches have labels
        loss, dh, dw = _value_and_grads(loss_type, hidden, weight, labels, num_items, 4)
        assert loss == 0.0
        assert np.isfinite(dh).all() and np.isfinite(dw).all()
        assert not dh.any() and not dw.any()


def test_loss_is_normalised_by_num_items_in_batch():
    hidden, weight, labels = _problem(2, 8, 4, 16)
    valid = int((labels[:, 1:] != -100).sum())
    for loss_type in LOSS_TYPES:
        alone = _value_and_grads(loss_type, hidden, weight, labels, valid, 4)[0]
        in_step = _value_and_grads(loss_type, hidden, weight, labels, 4 * valid, 4)[0]
        assert in_step == pytest.approx(alone / 4, rel=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_metrics_match_reference(loss_type):
    hidden, weight, labels = _problem(3, 10, 8, 40, seed=3)
    num_items = int((labels[:, 1:] != -100).sum())
    _, metrics = causal_lm_loss(jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(labels), num_items,
                                loss_type, chunk_size=7, return_metrics=True)
    logits = np.einsum("bth,vh->btv", hidden.astype(np.float64), weight.astype(np.float64))
    expected = ref_loss.metrics(logits, labels)
    assert int(metrics["num_tokens"]) == expected["num_tokens"]
    assert float(metrics["mean_token_accuracy"]) == pytest.approx(expected["mean_token_accuracy"], abs=1e-7)
    assert float(metrics["entropy"]) == pytest.approx(expected["entropy"], rel=tol("float32", "entropy_rel"))
    assert int(metrics["num_correct_tokens"]) == round(expected["mean_token_accuracy"] * expected["num_tokens"])


def test_shift_labels_matches_common():
    labels = np.array([[-100, 6, 7, -100, 9], [1, 2, 3, 4, -100]], np.int32)
    np.testing.assert_array_equal(np.asarray(shift_labels(jnp.asarray(labels))), ref_loss.shift_labels(labels))


def _largest_intermediate(jaxpr) -> int:
    """Largest number of elements of any value in a (closed) jaxpr, sub-jaxprs included."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            subs = param if isinstance(param, (list, tuple)) else [param]
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    largest = max(largest, _largest_intermediate(inner))
    return largest


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_only_nll_materialises_the_logits(loss_type):
    n, h, v, chunk = 64, 8, 256, 16

    def f(hidden, weight):
        return causal_lm_loss(hidden, weight, jnp.zeros((1, n), jnp.int32), n, loss_type, chunk_size=chunk)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1)))(jnp.ones((1, n, h)), jnp.ones((v, h))).jaxpr
    largest = _largest_intermediate(jaxpr)
    if loss_type == "nll":
        assert largest >= n * v
    else:
        assert largest <= max(chunk * v, v * h), largest  # one chunk of logits, or the LM head itself


def _temp_bytes(loss_type: str, n: int, h: int, v: int, chunk: int) -> int:
    def f(hidden, weight, labels):
        return causal_lm_loss(hidden[None], weight, labels[None], n, loss_type, chunk_size=chunk)

    shapes = (jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((v, h), jnp.float32),
              jax.ShapeDtypeStruct((n,), jnp.int32))
    compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_fused_temp_memory_is_an_eighth_of_nll():
    n, h, v = 1024, 64, 4096  # full logits: 16 MiB; 16 chunks of 64 tokens
    nll, fused = _temp_bytes("nll", n, h, v, 64), _temp_bytes("fused_linear", n, h, v, 64)
    assert fused * 8 <= nll, (fused, nll)


def test_bad_inputs_raise():
    hidden, weight, labels = _problem(1, 4, 4, 8)
    with pytest.raises(ValueError, match="loss_type='liger'"):
        causal_lm_loss(hidden, weight, labels, 3, "liger")
    with pytest.raises(ValueError, match="chunk_size=0"):
        causal_lm_loss(hidden, weight, labels, 3, "chunked_nll", chunk_size=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_labels(np.array([[0, 8, 1]]), 8, 2)
    with pytest.raises(ValueError, match="num_items_in_batch=1"):
        check_labels(np.array([[0, 3, 1]]), 8, 1)
    assert check_labels(np.array([[0, 3, -100]]), 8, 10) == 1
