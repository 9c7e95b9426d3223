"""Rematerialisation policies: numerically a no-op, clear errors for bad names and platforms.

Invariants:
- every policy gives the loss and gradients of ``none`` (float32 parity bounds);
- an unknown policy raises ``ValueError`` listing the valid names;
- a host-offload policy on a device without a ``pinned_host`` memory space raises ``ValueError``.

What this CPU platform reports (checked, not assumed): the XLA CPU client exposes
``device``, ``pinned_host`` and ``unpinned_host`` memory kinds, so ``offload_dots`` compiles and
runs here; host and device memory are the same RAM, so it saves nothing (``remat`` logs that).
"""

from __future__ import annotations

import logging

import jax
import pytest

import twinseq.jax_backend as jb
from parity_tests.inputs import parity_batches, rel_norm
from parity_tests.tolerances import tol
from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.jax_backend.memory import (REMAT_POLICIES, apply_activation_checkpointing, check_policy,
                                        device_memory_kinds, remat)


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def reference():
    cfg = ModelConfig.preset("tiny", vocab_size=256)
    weights = init_weights(cfg, seed=0)
    batch = parity_batches(cfg.vocab_size)["padding_free"]
    with jax.default_matmul_precision("highest"):
        return cfg, weights, batch, jb.loss_and_grads(jb.build_model(cfg, weights), batch)


def _model(cfg, weights, policy):
    model = jb.build_model(cfg, weights)
    apply_activation_checkpointing(model, policy)
    return model


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_policies_do_not_change_the_numbers(reference, policy, caplog):
    cfg, weights, batch, (loss, grads) = reference
    with caplog.at_level(logging.INFO, logger="twinseq.jax_backend.memory"):
        got_loss, got_grads = jb.loss_and_grads(_model(cfg, weights, policy), batch)
    assert abs(got_loss - loss) <= tol("float32", "loss_rel") * loss
    for name in grads:
        assert rel_norm(got_grads[name], grads[name]) <= tol("float32", "grad_rel"), (policy, name)
    if policy == "offload_dots" and jax.devices()[0].platform == "cpu":
        assert "no memory is saved" in caplog.text


@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_policy_reaches_the_traced_layers(reference, policy):
    """A remat policy that silently did nothing would pass the numerics test; the jaxpr tells."""
    from flax import nnx

    cfg, weights, batch, _ = reference
    graphdef, state = nnx.split(_model(cfg, weights, policy))
    inputs = jb.batch_inputs(batch, cfg.vocab_size)[:3]
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(*inputs).sum())(state).jaxpr
    remat_eqns = [e for e in jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2")]  # name varies by version
    assert len(remat_eqns) == (0 if policy == "none" else cfg.num_hidden_layers), policy


def test_cpu_reports_host_memory_spaces():
    kinds = device_memory_kinds(jax.devices()[0])
    assert "device" in kinds and "pinned_host" in kinds, kinds


def test_unknown_policy_lists_the_names():
    with pytest.raises(ValueError, match="dots_saveable"):
        remat(lambda x: x, "everything")
    cfg = ModelConfig.preset("tiny", vocab_size=256)
    with pytest.raises(ValueError, match="remat policy 'offload_everything' is unknown"):
        apply_activation_checkpointing(jb.build_model(cfg, init_weights(cfg)), "offload_everything")


def test_host_offload_without_host_memory_raises():
    with pytest.raises(ValueError, match="pinned_host"):
        check_policy("offload_dots", ("device",))
    check_policy("offload_dots", ("device", "pinned_host"))  # accepted where host memory exists
    check_policy("full", ("device",))
