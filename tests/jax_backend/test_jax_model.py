"""The Flax NNX Llama against the float64 numpy reference, and the model's invariants.

Invariants:
- logits equal the numpy reference within the float32 parity bound for tied/untied
  embeddings, MHA/GQA/MQA and an explicit head_dim, padded and padding-free;
- documents are isolated: changing one document of a packed row leaves every logit of the
  other documents bit-identical, and a padding-only row yields finite outputs and gradients;
- ``export_weights`` returns exactly the weights given to ``build_model`` (names, order, bits);
- weight mismatches and bad arguments raise ``ValueError`` naming the problem.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import twinseq.jax_backend as jb
from parity_tests import numpy_reference
from parity_tests.inputs import LAYOUTS, parity_batches, rel_norm, valid_positions
from parity_tests.tolerances import tol
from twinseq.common.data.batching import collate
from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.common.objectives.nll import shift_labels, token_nll


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


ARCHITECTURES = {
    "tiny": {},
    "untied_mha_head_dim": dict(tie_word_embeddings=False, num_key_value_heads=4, head_dim=16, vocab_size=512),
    "mqa": dict(num_key_value_heads=1, vocab_size=512, rope_theta=500000.0, rms_norm_eps=1e-6),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_logits_match_numpy_reference(arch):
    cfg = ModelConfig.preset("tiny", **ARCHITECTURES[arch])
    weights = init_weights(cfg, seed=5)
    model = jb.build_model(cfg, weights)
    for layout, batch in parity_batches(cfg.vocab_size).items():
        valid = valid_positions(batch)
        ref = numpy_reference.logits(cfg, weights, batch)
        got = jb.logits(model, batch)
        assert got.dtype == np.float32 and np.isfinite(got).all()
        diff = np.abs(got - ref)[valid].max()
        assert diff <= tol("float32", "logits_abs"), (arch, layout, diff)
        token_diff = np.abs(jb.token_losses(model, batch) - token_nll(ref, shift_labels(batch.labels))).max()
        assert token_diff <= tol("float32", "token_loss_abs"), (arch, layout, token_diff)


def test_documents_are_isolated_bitwise():
    cfg = ModelConfig.preset("tiny", vocab_size=512)
    model = jb.build_model(cfg, init_weights(cfg, seed=0))
    docs = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}, {"input_ids": [12, 13, 14, 15, 16]}]
    changed = [docs[0], {"input_ids": [300, 301, 302]}, docs[2]]
    a = jb.logits(model, collate(docs, padding_free=True))
    b = jb.logits(model, collate(changed, padding_free=True))
    np.testing.assert_array_equal(a[0, :4], b[0, :4])
    np.testing.assert_array_equal(a[0, 7:], b[0, 7:])
    assert not np.array_equal(a[0, 4:7], b[0, 4:7])


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_padding_only_row_is_finite_and_inert():
    cfg = ModelConfig.preset("tiny", vocab_size=512)
    model = jb.build_model(cfg, init_weights(cfg, seed=0))
    batch = collate([{"input_ids": [5, 6, 7, 8, 9]}, {"input_ids": []}])
    assert (batch.segment_ids[1] == 0).all()
    logits = jb.logits(model, batch)
    assert np.isfinite(logits).all()
    loss, grads = jb.loss_and_grads(model, batch)
    alone, alone_grads = jb.loss_and_grads(model, collate([{"input_ids": [5, 6, 7, 8, 9]}]))
    assert all(np.isfinite(g).all() for g in grads.values())
    assert loss == pytest.approx(alone, rel=1e-6)
    for name in grads:  # different shapes, different float32 summation orders: the parity bound
        assert rel_norm(grads[name], alone_grads[name]) <= tol("float32", "grad_rel"), name


def test_export_weights_round_trip_is_exact():
    cfg = ModelConfig.preset("tiny", tie_word_embeddings=False, vocab_size=512)
    weights = init_weights(cfg, seed=2)
    exported = jb.export_weights(jb.build_model(cfg, weights))
    assert list(exported) == list(weights)
    for name in weights:
        assert exported[name].dtype == np.float32 and exported[name].tobytes() == weights[name].tobytes(), name


def test_grads_use_hf_names_and_layout():
    cfg = ModelConfig.preset("tiny", vocab_size=512)
    weights = init_weights(cfg, seed=0)
    _, grads = jb.loss_and_grads(jb.build_model(cfg, weights), parity_batches(cfg.vocab_size)["padded"])
    assert list(grads) == list(weights)
    assert all(grads[k].shape == weights[k].shape for k in weights)


@pytest.mark.parametrize("mutate,expected", [
    (lambda w: w.pop("model.norm.weight"), "missing"),
    (lambda w: w.__setitem__("lm_head.weight", w["model.embed_tokens.weight"]), "unexpected"),
    (lambda w: w.__setitem__("model.layers.0.mlp.up_proj.weight", np.zeros((3, 3), np.float32)), "wrong shape"),
])
def test_weight_mismatch_raises(mutate, expected):
    cfg = ModelConfig.preset("tiny", vocab_size=512)
    weights = init_weights(cfg, seed=0)
    mutate(weights)
    with pytest.raises(ValueError, match=expected):
        jb.build_model(cfg, weights)


def test_bad_arguments_raise():
    cfg = ModelConfig.preset("tiny", vocab_size=512)
    weights = init_weights(cfg, seed=0)
    with pytest.raises(ValueError, match="dtype='float16'"):
        jb.build_model(cfg, weights, dtype="float16")
    model = jb.build_model(cfg, weights)
    batch = parity_batches(cfg.vocab_size)["padded"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jb.logits(model, dataclasses.replace(batch, input_ids=batch.input_ids + 600))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jb.loss_and_grads(model, dataclasses.replace(batch, labels=np.where(batch.labels >= 0, 9999, -100)))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        jb.loss_and_grads(model, batch.with_num_items(1))
    with pytest.raises(ValueError, match="loss_type='liger'"):
        jb.loss_and_grads(model, batch, loss_type="liger")
    with pytest.raises(TypeError, match="Batch"):
        jb.logits(model, {"input_ids": batch.input_ids})


def test_train_stays_a_function_after_the_submodule_is_imported():
    import importlib

    from twinseq.common.backend import PROTOCOL, load_backend

    importlib.import_module("twinseq.jax_backend.trainer")
    backend = load_backend("jax")
    for name in PROTOCOL:
        assert callable(getattr(backend, name)) and not isinstance(getattr(backend, name), type(jax)), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_model_runs_and_tracks_float32(layout):
    cfg = ModelConfig.preset("tiny", vocab_size=512)
    weights = init_weights(cfg, seed=0)
    batch = parity_batches(cfg.vocab_size)[layout]
    valid = valid_positions(batch)
    fp32 = jb.logits(jb.build_model(cfg, weights), batch)
    bf16 = jb.logits(jb.build_model(cfg, weights, dtype="bfloat16"), batch)
    # bf16 weights and activations: a few bf16 ulps (2**-7 at |logit| < 2) from float32
    assert np.isfinite(bf16).all() and np.abs(bf16 - fp32)[valid].max() < 8 * 2.0 ** -7
