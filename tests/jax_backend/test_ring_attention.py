"""Ring and all-gather attention on 8 host CPU devices against dense single-device attention.

Invariant: for any token order produced by ``twinseq.common.data.context_parallel`` and any packing,
context-parallel attention equals the dense document-causal attention of
``twinseq.jax_backend.attention`` (forward and the gradients of q, k, v) within 1e-5 in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from twinseq.common.data.context_parallel import shard_sequence, unshard_sequence
from twinseq.jax_backend.attention import document_causal_mask, dot_product_attention
from twinseq.jax_backend.context_parallel import (
    STRATEGIES,
    blocked_attention,
    sharded_attention,
)

CP = 8
TOL = 1e-5
HEAD_DIM = 16


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < CP:
        pytest.skip(f"needs {CP} JAX devices (conftest sets XLA_FLAGS); found {jax.device_count()}")
    return jax.make_mesh((CP,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:CP])


def _inputs(batch, seq_len, num_heads, num_kv_heads, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads, "dout": num_heads}
    return {k: rng.standard_normal((batch, seq_len, h, HEAD_DIM)).astype(np.float32) for k, h in shapes.items()}


def _packed_ids(lengths, seq_len):
    """segment/position ids of documents ``lengths`` packed in one row, padded (segment 0) to ``seq_len``."""
    assert sum(lengths) <= seq_len
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(seq_len - sum(lengths))])
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(seq_len - sum(lengths))])
    return seg.astype(np.int32), pos.astype(np.int32)


def _to_bntd(a):
    return a.transpose(0, 2, 1, 3)


# Module-level jits: repeated shapes reuse the compiled step. The ids are arguments, not
# constants, so XLA does not fold the [T, T] mask at compile time.
@jax.jit
def _dense_run(q, k, v, dout, seg, pos):
    def attend(q, k, v):
        mask = document_causal_mask(seg, pos)
        return _to_bntd(dot_product_attention(_to_bntd(q), _to_bntd(k), _to_bntd(v), mask, HEAD_DIM ** -0.5))

    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(dout))


@functools.partial(jax.jit, static_argnames=("mesh", "strategy", "block_q", "block_k"))
def _sharded_run(q, k, v, dout, seg, pos, *, mesh, strategy, block_q=None, block_k=None):
    def attend(q, k, v):
        return sharded_attention(q, k, v, seg, pos, mesh, strategy=strategy, block_q=block_q, block_k=block_k)

    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(dout))


def _dense_value_and_grads(x, seg_BT, pos_BT):
    """Dense single-device reference: out, dq, dk, dv as numpy, in token order."""
    return [np.asarray(a) for a in _dense_run(x["q"], x["k"], x["v"], x["dout"], seg_BT, pos_BT)]


def _sharded_value_and_grads(x, seg_BT, pos_BT, mesh, strategy, load_balance, **kwargs):
    """Reorder (zigzag or contiguous), run sharded attention fwd + vjp, and put results back in token order."""
    def reorder(a):
        return jnp.asarray(shard_sequence(np.asarray(a), CP, load_balance, axis=1))

    arrays = (reorder(a) for a in (x["q"], x["k"], x["v"], x["dout"], seg_BT, pos_BT))
    results = _sharded_run(*arrays, mesh=mesh, strategy=strategy, **kwargs)
    return [unshard_sequence(np.asarray(a), CP, load_balance, axis=1) for a in results]


def _assert_close(got, want, label, tol=TOL):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, (label, name, g.shape, w.shape)
        for row in range(g.shape[0]):
            err = float(np.abs(g[row] - w[row]).max())
            assert err <= tol, f"{label}, row {row}, {name}: max abs diff {err:.3g} > {tol}"


# --- acceptance: T = 8192 on 8 devices ------------------------------------------------------------

LONG_T = 8192
# Row 1 packs documents that cross shard (1024) and zigzag-chunk (512) boundaries, one spanning three
# shards, a one-token document, then padding.
LONG_DOCS = [1500, 2600, 1, 37, 900, 2100, 1000]


@pytest.fixture(scope="module")
def long_case():
    x = _inputs(batch=2, seq_len=LONG_T, num_heads=2, num_kv_heads=2)
    seg_packed, pos_packed = _packed_ids(LONG_DOCS, LONG_T)
    seg_BT = np.stack([np.ones(LONG_T, np.int32), seg_packed])        # row 0: one causal document
    pos_BT = np.stack([np.arange(LONG_T, dtype=np.int32), pos_packed])
    with jax.default_matmul_precision("highest"):
        return x, seg_BT, pos_BT, _dense_value_and_grads(x, seg_BT, pos_BT)


@pytest.mark.multi_device
@pytest.mark.slow
@pytest.mark.parametrize("load_balance", [True, False], ids=["zigzag", "contiguous"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_long_causal_and_packed_match_dense(long_case, mesh, strategy, load_balance):
    x, seg_BT, pos_BT, want = long_case
    got = _sharded_value_and_grads(x, seg_BT, pos_BT, mesh, strategy, load_balance)
    _assert_close(got, want, f"T={LONG_T} {strategy} load_balance={load_balance} (row 0 causal, row 1 packed)")


# --- fast checks at small T --------------------------------------------------------------------------

SHORT_T = 512


@pytest.mark.multi_device
@pytest.mark.parametrize("num_kv_heads", [1, 2])  # N == K (no GQA): the long test
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gqa_packed_matches_dense(mesh, strategy, num_kv_heads):
    x = _inputs(batch=1, seq_len=SHORT_T, num_heads=4, num_kv_heads=num_kv_heads, seed=num_kv_heads)
    seg, pos = _packed_ids([100, 3, 250, 120], SHORT_T)
    seg_BT, pos_BT = seg[None], pos[None]
    want = _dense_value_and_grads(x, seg_BT, pos_BT)
    got = _sharded_value_and_grads(x, seg_BT, pos_BT, mesh, strategy, load_balance=True)
    _assert_close(got, want, f"{strategy} GQA 4/{num_kv_heads}")


@pytest.mark.multi_device
def test_uneven_blocks_match_dense(mesh):
    """Query and key blocks of different sizes exercise the block-pair indexing."""
    x = _inputs(batch=1, seq_len=SHORT_T, num_heads=2, num_kv_heads=1, seed=3)
    seg, pos = _packed_ids([300, 150], SHORT_T)
    want = _dense_value_and_grads(x, seg[None], pos[None])
    got = _sharded_value_and_grads(x, seg[None], pos[None], mesh, "ring", True, block_q=16, block_k=64)
    _assert_close(got, want, "ring block_q=16 block_k=64")


def test_blocked_single_device_matches_dense():
    x = _inputs(batch=2, seq_len=256, num_heads=4, num_kv_heads=2, seed=4)
    seg, pos = _packed_ids([60, 1, 140], 256)
    seg_BT, pos_BT = np.stack([seg, np.ones(256, np.int32)]), np.stack([pos, np.arange(256, dtype=np.int32)])
    want = _dense_value_and_grads(x, seg_BT, pos_BT)

    @jax.jit
    def run(q, k, v, dout, seg, pos):
        out, vjp = jax.vjp(lambda q, k, v: blocked_attention(q, k, v, seg, pos, block_q=32, block_k=64), q, k, v)
        return (out, *vjp(dout))

    got = run(x["q"], x["k"], x["v"], x["dout"], seg_BT, pos_BT)
    _assert_close([np.asarray(a) for a in got], want, "blocked")


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fully_masked_blocks_are_skipped(mesh, strategy):
    """NaN in q/k/v of an all-padding tail: a computed masked block would spread it (0 * NaN), a skipped one cannot.

    With the zigzag order and 32-token chunks, the last 128 tokens fill whole blocks of ranks 0 and 1.
    """
    x = _inputs(batch=1, seq_len=SHORT_T, num_heads=2, num_kv_heads=2, seed=5)
    seg, pos = _packed_ids([200, 184], SHORT_T)
    pad = slice(384, SHORT_T)
    for name in ("q", "k", "v"):
        x[name][:, pad] = 0.0
    want = _dense_value_and_grads(x, seg[None], pos[None])
    poisoned = {name: a.copy() for name, a in x.items()}
    for name in ("q", "k", "v"):
        poisoned[name][:, pad] = np.nan
    leaked = _dense_value_and_grads(poisoned, seg[None], pos[None])[0]
    assert np.isnan(leaked).any(), "dense attention should leak NaN through masked entries (test premise)"
    got = _sharded_value_and_grads(poisoned, seg[None], pos[None], mesh, strategy, load_balance=True)
    _assert_close(got, want, f"{strategy} with NaN padding")
    assert all(np.isfinite(a).all() for a in got)


@pytest.mark.multi_device
def test_bfloat16_runs_and_stays_close(mesh):
    x = _inputs(batch=1, seq_len=256, num_heads=2, num_kv_heads=1, seed=6)
    seg, pos = _packed_ids([256], 256)
    want = _dense_value_and_grads(x, seg[None], pos[None])[0]
    seg_r, pos_r = (jnp.asarray(shard_sequence(a[None], CP, axis=1)) for a in (seg, pos))
    q, k, v = (jnp.asarray(shard_sequence(x[n], CP, axis=1), dtype=jnp.bfloat16) for n in ("q", "k", "v"))
    out = jax.jit(lambda q, k, v: sharded_attention(q, k, v, seg_r, pos_r, mesh))(q, k, v)
    assert out.dtype == jnp.bfloat16
    err = np.abs(unshard_sequence(np.asarray(out, np.float32), CP, axis=1) - want).max()
    assert err < 5e-2, err  # bf16 inputs: about 3 significant digits


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_device_temp_memory_is_a_fraction_of_dense(mesh, strategy):
    """Compile-only: the fwd+bwd step never holds a [T, T] score matrix (dense holds several)."""
    seq_len = 4096
    x = {k: jax.ShapeDtypeStruct((1, seq_len, 2, HEAD_DIM), jnp.float32) for k in ("q", "k", "v", "dout")}
    ids = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    dense = _dense_run.lower(*x.values(), ids, ids).compile().memory_analysis().temp_size_in_bytes
    sharded = _sharded_run.lower(*x.values(), ids, ids, mesh=mesh, strategy=strategy).compile()
    per_device = sharded.memory_analysis().temp_size_in_bytes
    scores_bytes = 2 * seq_len * seq_len * 4
    assert dense >= scores_bytes  # the baseline really materialises the scores
    assert per_device <= dense / 4, (per_device, dense)
    assert per_device < scores_bytes / 16


@pytest.mark.multi_device
def test_errors_name_the_problem(mesh):
    x = _inputs(batch=1, seq_len=64, num_heads=3, num_kv_heads=2)
    ids = jnp.ones((1, 64), jnp.int32)
    with pytest.raises(ValueError, match=r"num_heads=3 must be a multiple of num_kv_heads=2"):
        sharded_attention(x["q"], x["k"], x["v"], ids, ids, mesh)
    x = _inputs(batch=1, seq_len=60, num_heads=2, num_kv_heads=2)
    ids = jnp.ones((1, 60), jnp.int32)
    with pytest.raises(ValueError, match=r"T=60 is not divisible by cp=8.*--pad-to-multiple-of 16"):
        sharded_attention(x["q"], x["k"], x["v"], ids, ids, mesh)
    with pytest.raises(ValueError, match=r"strategy='tree' is not valid"):
        sharded_attention(x["q"], x["k"], x["v"], ids, ids, mesh, strategy="tree")
    with pytest.raises(ValueError, match=r"axis_name='seq' is not a mesh axis"):
        sharded_attention(x["q"], x["k"], x["v"], ids, ids, mesh, axis_name="seq")
    x = _inputs(batch=1, seq_len=64, num_heads=2, num_kv_heads=2)
    ids = jnp.ones((1, 64), jnp.int32)
    with pytest.raises(ValueError, match=r"block_q=3 must divide the local query length 8"):
        sharded_attention(x["q"], x["k"], x["v"], ids, ids, mesh, block_q=3)
    with pytest.raises(ValueError, match=r"B=1 is not divisible by the 2 devices of the batch axes \('data',\)"):
        sharded_attention(x["q"], x["k"], x["v"], ids, ids, jax.make_mesh((2, 4), ("data", "cp"),
                          axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8]))
    with pytest.raises(ValueError, match=r"segment_ids \(1, 32\)"):
        blocked_attention(x["q"], x["k"], x["v"], ids[:, :32], ids, block_q=8)
