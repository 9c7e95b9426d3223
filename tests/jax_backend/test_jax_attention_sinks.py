"""Attention sinks (gpt-oss) on every JAX attention path: one learned logit per query head in every softmax
denominator, with no value (``softmax([scores, sink])[:-1] @ V``).

Invariants (float32, matmuls at full precision):
- the blocked kernel (tiles smaller than the row), with and without a sliding window and with shared prefixes
  (parent ids), equals the dense reference with the same sinks: output and the gradients of q, k, v and the
  sinks within 1e-5;
- on 4 host devices the ring and all-gather context-parallel attention with sinks (zigzag order) equal the
  dense reference the same way;
- generation's cached attention: the KV-cache prefill and one decode step of a gpt-oss model equal the full
  forward's logits;
- negative controls: the same paths without the sinks (or with them zeroed) are far from the references, so
  every comparison can fail; a sink of -inf is no sink at all.
(Equality with transformers' ``GptOssForCausalLM`` on every path: ``parity_tests/test_jax_families_vs_hf.py``.)
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from parity_tests.families import FAMILY_CASES, family_examples  # noqa: E402
from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.data.context_parallel import shard_sequence  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.jax_backend.attention import blocked_document_attention, document_attention  # noqa: E402
from twinseq.jax_backend.context_parallel import sharded_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("highest_precision")

TOL = 1e-5
CP = 4
SCALE = 0.3


def _inputs(t: int, seed: int = 0):
    """q [1, 4, t, 16], k, v [1, 2, t, 16] (grouped-query), dout like q, sinks [4] of both signs."""
    rng = np.random.default_rng(seed)
    q, dout = (jnp.asarray(rng.standard_normal((1, 4, t, 16)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, 2, t, 16)), jnp.float32) for _ in range(2))
    return q, k, v, dout, jnp.asarray([1.5, -0.5, 0.0, 2.5], jnp.float32)


def _shared_ids():
    """A prompt (segment 1, positions 0..7) and two completions of it (segments 2 and 3, parent 1, positions 8..15),
    then a lone document (segment 4) and padding: 40 columns."""
    seg = [1] * 8 + [2] * 8 + [3] * 8 + [4] * 12 + [0] * 4
    pos = list(range(8)) + list(range(8, 16)) * 2 + list(range(12)) + [0] * 4
    par = [0] * 8 + [1] * 16 + [0] * 16
    return (jnp.asarray([a], jnp.int32) for a in (seg, pos, par))


@functools.partial(jax.jit, static_argnames=("attend", "window"))
def _vjp(q, k, v, sinks, dout, seg, pos, par, *, attend, window):
    """(out, dq, dk, dv, dsinks) of ``attend`` with the model's keywords (``sinks=``, ``parent_ids_BT=``)."""

    def f(q, k, v, sinks):
        return attend(q, k, v, seg, pos, SCALE, sliding_window=window, parent_ids_BT=par, sinks=sinks)

    out, vjp = jax.vjp(f, q, k, v, sinks)
    return (out, *vjp(dout))


def _max_diff(got, want) -> float:
    return max(float(np.abs(np.asarray(g) - np.asarray(w)).max()) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("window", [None, 8])
def test_blocked_attention_with_sinks_equals_dense(window):
    seg, pos, par = _shared_ids()
    q, k, v, dout, sinks = _inputs(seg.shape[1])
    blocked = functools.partial(blocked_document_attention, block_size=8)  # 5 tiles of the 40 columns
    want = _vjp(q, k, v, sinks, dout, seg, pos, par, attend=document_attention, window=window)
    got = _vjp(q, k, v, sinks, dout, seg, pos, par, attend=blocked, window=window)
    assert _max_diff(got, want) <= TOL, window
    assert float(np.abs(np.asarray(want[-1])).min()) > 1e-3  # every head's sink has a gradient
    # controls: without sinks, or with the children blind to their prompt, the outputs are far off
    no_sinks = _vjp(q, k, v, jnp.full_like(sinks, -jnp.inf), dout, seg, pos, par, attend=blocked, window=window)
    unshared = _vjp(q, k, v, sinks, dout, seg, pos, jnp.zeros_like(par), attend=blocked, window=window)
    assert _max_diff(no_sinks[:1], want[:1]) > 1e-2 and _max_diff(unshared[:1], want[:1]) > 1e-2


@pytest.mark.parametrize("blocked", [False, True], ids=["dense", "blocked"])
def test_a_sink_of_minus_infinity_is_no_sink(blocked):
    """``sinks=-inf`` gives the attention without sinks (``sigmoid(lse + inf) = 1`` on the blocked path); a finite
    sink only takes probability mass away from the keys; padding queries get zeros either way."""
    seg, pos, par = _shared_ids()
    q, k, v, _, sinks = _inputs(seg.shape[1])
    attend = functools.partial(blocked_document_attention, block_size=8) if blocked else document_attention
    run = jax.jit(lambda sinks: attend(q, k, v, seg, pos, SCALE, parent_ids_BT=par, sinks=sinks))
    plain = np.asarray(jax.jit(lambda: attend(q, k, v, seg, pos, SCALE, parent_ids_BT=par))())
    assert _max_diff([run(jnp.full_like(sinks, -jnp.inf))], [plain]) <= 1e-6
    with_sinks = np.asarray(run(sinks))
    assert not with_sinks[:, :, -4:].any()  # padding
    assert np.abs(with_sinks).sum() < np.abs(plain).sum()


@pytest.fixture(scope="module")
def cp_mesh():
    from twinseq.jax_backend.parallel import make_mesh

    if jax.device_count() < CP:
        pytest.skip(f"needs {CP} JAX host devices (the root conftest sets XLA_FLAGS); found {jax.device_count()}")
    return make_mesh(cp=CP, devices=jax.devices()[:CP])


@functools.partial(jax.jit, static_argnames=("mesh", "strategy", "window"))
def _cp_vjp(q, k, v, sinks, dout, seg, pos, *, mesh, strategy, window):
    from twinseq.jax_backend.parallel import BATCH_AXES, CP_AXIS

    def f(q, k, v, sinks):
        out_BTND = sharded_attention(
            *(x.transpose(0, 2, 1, 3) for x in (q, k, v)),
            seg,
            pos,
            mesh,
            strategy=strategy,
            axis_name=CP_AXIS,
            batch_axes=BATCH_AXES,
            scale=SCALE,
            sliding_window=window,
            sinks_N=sinks,
        )
        return out_BTND.transpose(0, 2, 1, 3)

    out, vjp = jax.vjp(f, q, k, v, sinks)
    return (out, *vjp(dout))


@pytest.mark.slow  # fast-tier budget (~5 s each): runs in make test-all and CI
@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_context_parallel_attention_with_sinks_equals_dense(cp_mesh, strategy):
    batch = collate(family_examples(), padding_free=True, pad_to_multiple_of=2 * CP)  # 48 columns, 3 documents
    t = batch.shape[1]
    q, k, v, dout, sinks = _inputs(t, seed=1)
    order = shard_sequence(np.arange(t)[None], CP, True)[0]  # the zigzag token order of the trainer
    seg, pos = (jnp.asarray(a[:, order]) for a in (batch.segment_ids, batch.position_ids))
    q, k, v, dout = (x[:, :, order] for x in (q, k, v, dout))
    want = _vjp(q, k, v, sinks, dout, seg, pos, None, attend=document_attention, window=8)
    got = _cp_vjp(q, k, v, sinks, dout, seg, pos, mesh=cp_mesh, strategy=strategy, window=8)
    assert _max_diff(got, want) <= TOL
    no_sinks = _cp_vjp(
        q, k, v, jnp.full_like(sinks, -jnp.inf), dout, seg, pos, mesh=cp_mesh, strategy=strategy, window=8
    )
    assert _max_diff(no_sinks[:1], want[:1]) > 1e-2  # the control: the sinks change the answer


@functools.partial(jax.jit, static_argnums=(0, 4))
def _cached_logits(graphdef, state, cache, ids, start, query_pos, key_pos, valid):
    from flax import nnx

    from twinseq.jax_backend.generation import _cached_forward

    return _cached_forward(nnx.merge(graphdef, state), cache, ids, start, query_pos, key_pos, valid)


@pytest.mark.slow  # fast-tier budget (~10 s of compiles): runs in make test-all and CI
def test_generation_cache_with_sinks_equals_the_full_forward():
    """A gpt-oss model's KV-cache prefill of a prompt and one cached decode step give the logits of the full
    forward over the same tokens (the cached attention carries the sinks); zeroing the sinks changes them."""
    from flax import nnx

    import twinseq.jax_backend as jb
    from twinseq.jax_backend.generation import _empty_cache

    cfg = FAMILY_CASES["gpt_oss"]
    weights = init_weights(cfg, seed=0)
    for name in weights:  # large sinks, so that dropping them would show
        if name.endswith("sinks"):
            weights[name] = np.linspace(-1.0, 2.0, weights[name].size, dtype=np.float32)
    model = jb.build_model(cfg, weights)
    graphdef, state = nnx.split(model)
    ids = jnp.asarray([family_examples()[0]["input_ids"][:12]], jnp.int32)  # past the window of 8
    pos = jnp.arange(12, dtype=jnp.int32)[None]
    full = jax.jit(model.logits)(ids, pos, jnp.ones_like(ids))
    valid, empty = jnp.ones((1, 12), bool), _empty_cache(model, 1, 12)
    prefill, cache = _cached_logits(graphdef, state, empty, ids[:, :11], 0, pos[:, :11], pos, valid)
    step, _ = _cached_logits(graphdef, state, cache, ids[:, 11:], 11, pos[:, 11:], pos, valid)
    assert _max_diff([prefill, step], [full[:, 10], full[:, 11]]) <= 1e-5
    zeroed_state = jax.tree.map(lambda x: x, state)
    for layer in range(cfg.num_hidden_layers):
        zeroed_state["model"]["layers"][layer]["self_attn"]["sinks"].set_value(jnp.zeros((cfg.num_attention_heads,)))
    zeroed, _ = _cached_logits(graphdef, zeroed_state, empty, ids[:, :11], 0, pos[:, :11], pos, valid)
    assert _max_diff([zeroed], [prefill]) > 1e-3
