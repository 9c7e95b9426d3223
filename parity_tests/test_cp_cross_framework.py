"""Context parallelism across frameworks: torch ``allgather`` CP (2 gloo ranks) vs JAX ring attention.

Same weights (``init_weights``, seed 0), same packed ``Batch`` (two rows of several documents,
documents crossing the shard boundary), cp = 2, float32, TF32 off, JAX matmul precision highest.

What is compared:

1. the packed-batch loss: torch FSDP2 + allgather CP summed over 2 processes vs the JAX model
   with ``ring_attention_fn`` on a cp=2 mesh of host devices, both in the zigzag order. The JAX
   model takes the ring through its ``attend=`` hook; a JAX model without that hook gets the same
   forward assembled in ``_jax_hidden`` from its own modules (embeddings, RoPE, projections, MLP,
   norms), only the attention call swapped;
2. ``_jax_hidden`` with dense attention vs the JAX model's own loss (the assembly is the model),
   the ring vs that dense loss, and torch CP vs the torch single-process loss;
3. attention outputs: torch allgather CP on each rank vs JAX ring attention, same q/k/v.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "torch_backend"))
import _dist_workers as W  # noqa: E402

from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.data.context_parallel import shard_sequence  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.multi_device, pytest.mark.slow]

CP = 2
LOSS_REL = 1e-5     # the brief's bound for the loss; torch vs jax float32 loss parity is 1e-6 (tolerances.py)
ATTN_ABS = 1e-5     # as tolerances.py "logits_abs": outputs are O(1)


@pytest.fixture(scope="module")
def torch_cp(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("cp_parity")
    results = W.launch({"jobs": [{"kind": "cp_parity", "name": "cp", "cp": CP}]}, out_dir, world_size=CP)
    assert results[0]["cp"] == results[1]["cp"]
    return results[0]["cp"]["loss"], [np.load(out_dir / f"attention_rank{r}.npy") for r in range(CP)]


@pytest.fixture(scope="module")
def setup(exact_fp32):
    import twinseq.jax_backend as jb
    from twinseq.jax_backend.parallel import make_mesh

    if jax.device_count() < CP:
        pytest.skip(f"needs {CP} JAX host devices (conftest sets XLA_FLAGS); found {jax.device_count()}")
    cfg = ModelConfig.preset("tiny")
    weights = init_weights(cfg, seed=0)
    return cfg, weights, jb.build_model(cfg, weights), make_mesh(cp=CP, devices=jax.devices()[:CP])


def _jax_hidden(model, ids_BT, pos_BT, seg_BT, attend):
    """The JAX Llama forward with ``attend(q, k, v, seg, pos, scaling)`` in place of its dense attention."""
    from twinseq.jax_backend.model import apply_rope, rope_cos_sin

    body = model.model
    x_BTH = body.embed_tokens(ids_BT)
    cos, sin = rope_cos_sin(pos_BT, np.asarray(body.inv_freq, np.float32), x_BTH.dtype)
    for layer in body.layers:
        attn, h_BTH = layer.self_attn, layer.input_layernorm(x_BTH)
        q = apply_rope(attn._heads(attn.q_proj(h_BTH)), cos, sin)
        k = apply_rope(attn._heads(attn.k_proj(h_BTH)), cos, sin)
        out_BNTD = attend(q, k, attn._heads(attn.v_proj(h_BTH)), seg_BT, pos_BT, attn.scaling)
        b, _, t, _ = out_BNTD.shape
        x_BTH = x_BTH + attn.o_proj(out_BNTD.transpose(0, 2, 1, 3).reshape(b, t, -1))
        x_BTH = x_BTH + layer.mlp(layer.post_attention_layernorm(x_BTH))
    return body.norm(x_BTH)


def _loss_from_targets(model, hidden_BTH, targets_BT, num_items: int) -> float:
    """sum over targets != -100 of CE(hidden @ lm_head^T, target) / num_items; targets already shifted."""
    logits_BTV = (hidden_BTH @ model.lm_head_VH().T).astype(jnp.float32)
    safe_BT = jnp.where(targets_BT == -100, 0, targets_BT)
    nll_BT = jax.nn.logsumexp(logits_BTV, -1) - jnp.take_along_axis(logits_BTV, safe_BT[..., None], -1)[..., 0]
    return float(jnp.where(targets_BT == -100, 0.0, nll_BT).sum() / num_items)


def _dense(q, k, v, seg, pos, scaling):
    from twinseq.jax_backend.attention import document_causal_mask, dot_product_attention

    return dot_product_attention(q, k, v, document_causal_mask(seg, pos), scaling)


def _jax_leaky_loss(model, batch) -> float:
    """The assembled forward with documents mixed (one segment per row, positions 0..T-1): a leak's loss."""
    from twinseq.common.objectives.nll import shift_labels

    B, T = batch.input_ids.shape
    seg = jnp.asarray(batch.segment_ids != 0, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden = _jax_hidden(model, jnp.asarray(batch.input_ids, jnp.int32), pos, seg, _dense)
    return _loss_from_targets(model, hidden, jnp.asarray(shift_labels(batch.labels)), batch.num_items_in_batch)


def _jax_losses(model, mesh, batch) -> tuple[float, float, float]:
    """(JAX model loss, assembled forward with dense attention, assembled forward with ring attention)."""
    import twinseq.jax_backend as jb
    from twinseq.common.objectives.nll import shift_labels
    from twinseq.jax_backend.parallel import ring_attention_fn, shard_batch

    model_loss = float(jb.token_losses(model, batch).sum() / batch.num_items_in_batch)
    ids, pos, seg = (jnp.asarray(x, jnp.int32) for x in (batch.input_ids, batch.position_ids, batch.segment_ids))
    dense_loss = _loss_from_targets(model, _jax_hidden(model, ids, pos, seg, _dense),
                                    jnp.asarray(shift_labels(batch.labels)), batch.num_items_in_batch)
    arrays = shard_batch(batch, mesh)  # zigzag order, targets shifted before the reorder, on the cp mesh
    if "attend" in inspect.signature(type(model).__call__).parameters:
        forward = lambda i, p, s: model(i, p, s, attend=ring_attention_fn(mesh))  # noqa: E731 - the model's own hook
    else:
        forward = lambda i, p, s: _jax_hidden(model, i, p, s, ring_attention_fn(mesh))  # noqa: E731
    hidden = jax.jit(forward)(arrays["input_ids"], arrays["position_ids"], arrays["segment_ids"])
    ring_loss = _loss_from_targets(model, hidden, arrays["targets"], arrays["num_items_in_batch"])
    return model_loss, dense_loss, ring_loss


def test_torch_allgather_cp_loss_equals_jax_ring_attention_loss(torch_cp, setup):
    import twinseq.torch_backend as tb

    cfg, weights, jax_model, mesh = setup
    batch = W.packed_batch(pad_to=2 * CP)
    model_loss, dense_loss, ring_loss = _jax_losses(jax_model, mesh, batch)
    torch_cp_loss, _ = torch_cp
    torch_loss = float(tb.compute_loss(tb.build_model(cfg, weights), batch).detach())
    assert abs(dense_loss - model_loss) / model_loss <= LOSS_REL, "the assembled JAX forward is not the model"
    assert abs(ring_loss - dense_loss) / dense_loss <= LOSS_REL
    assert abs(torch_cp_loss - torch_loss) / torch_loss <= LOSS_REL
    assert abs(torch_cp_loss - ring_loss) / ring_loss <= LOSS_REL, (torch_cp_loss, ring_loss)
    leak = abs(_jax_leaky_loss(jax_model, batch) - dense_loss) / dense_loss
    assert leak > 10 * LOSS_REL, f"mixing documents moves the loss by only {leak:.1e}: the comparison is blind"


def test_torch_allgather_cp_attention_equals_jax_ring_attention(torch_cp, setup):
    from twinseq.jax_backend.parallel import ring_attention_fn

    _, _, _, mesh = setup
    batch = W.packed_batch(pad_to=2 * CP)
    q, k, v = (shard_sequence(x, CP, axis=2) for x in W.attention_inputs(batch))
    seg, pos = (shard_sequence(x, CP, axis=1) for x in (batch.segment_ids, batch.position_ids))
    out_BNTD = np.asarray(ring_attention_fn(mesh)(*(jnp.asarray(x) for x in (q, k, v, seg, pos)), 8 ** -0.5))
    _, torch_outs = torch_cp
    for rank, out_jax_BLHD in enumerate(np.split(out_BNTD.transpose(0, 2, 1, 3), CP, axis=1)):
        real = np.split(seg != 0, CP, axis=1)[rank][:, :, None, None]  # padding queries: JAX zeros, torch self
        err = float((np.abs(out_jax_BLHD - torch_outs[rank]) * real).max())
        assert err <= ATTN_ABS, f"rank {rank}: max abs difference {err:.2e}"
