"""Meshes, batch/parameter shardings, and the model-layout ring attention on 8 host CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from twinseq.common.data.batching import collate
from twinseq.common.data.context_parallel import shard_batch as reorder_batch
from twinseq.common.data.context_parallel import shard_sequence
from twinseq.common.objectives.nll import shift_labels
from twinseq.jax_backend.attention import document_causal_mask, dot_product_attention
from twinseq.jax_backend.parallel import (
    MESH_AXES,
    make_mesh,
    param_shardings,
    param_spec,
    ring_attention_fn,
    shard_batch,
    unshard_tokens,
)

pytestmark = pytest.mark.multi_device


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 JAX devices (conftest sets XLA_FLAGS); found {jax.device_count()}")
    with jax.default_matmul_precision("highest"):
        yield


def _padded_batch(num_rows: int, multiple: int, seed: int = 0):
    """``num_rows`` rows, each packing two or three documents, so rows differ in layout."""
    rng = np.random.default_rng(seed)
    examples = []
    for r in range(num_rows):
        lengths = rng.integers(3, 20, size=2 + r % 2)
        ids = rng.integers(1, 300, size=int(lengths.sum()))
        examples.append({"input_ids": ids.tolist(), "seq_lengths": lengths.tolist()})
    return collate(examples, padding_free=False, pad_to_multiple_of=multiple)


def test_make_mesh_names_and_shapes():
    mesh = make_mesh(data=2, cp=4)
    assert tuple(mesh.axis_names) == MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "cp": 4}
    assert make_mesh(cp=8).devices.shape == (1, 1, 8)
    assert dict(make_mesh(data=2, fsdp=2, cp=2).shape) == {"data": 2, "fsdp": 2, "cp": 2}
    assert dict(make_mesh(cp=2, devices=jax.devices()[:2]).shape) == {"data": 1, "fsdp": 1, "cp": 2}


def test_make_mesh_errors():
    with pytest.raises(ValueError, match=r"cp=16 is larger than the 8 available devices"):
        make_mesh(cp=16)
    with pytest.raises(ValueError, match=r"data=3 x fsdp=1 x cp=2 = 6 do not multiply to the 8 devices; e.g. data=4"):
        make_mesh(data=3, cp=2)
    with pytest.raises(ValueError, match=r"mesh axis cp=0 must be a positive integer"):
        make_mesh(cp=0)


def test_shard_batch_places_each_rank_shard_on_its_device():
    mesh = make_mesh(data=2, cp=4)
    batch = _padded_batch(num_rows=4, multiple=8)
    arrays = shard_batch(batch, mesh)
    cp_batch = reorder_batch(batch, 4)
    rows_per_replica = batch.input_ids.shape[0] // 2
    coords = {d: idx for idx, d in np.ndenumerate(mesh.devices)}
    for name in ("input_ids", "targets", "position_ids", "segment_ids"):
        arr = arrays[name]
        assert arr.shape == batch.input_ids.shape and arr.sharding.spec == P(("data", "fsdp"), "cp")
        for shard in arr.addressable_shards:
            data_idx, _, cp_idx = coords[shard.device]
            rows = slice(data_idx * rows_per_replica, (data_idx + 1) * rows_per_replica)
            np.testing.assert_array_equal(np.asarray(shard.data), cp_batch.rank(cp_idx)[name][rows])
    np.testing.assert_array_equal(unshard_tokens(arrays["targets"], mesh), shift_labels(batch.labels))
    assert arrays["num_items_in_batch"] == batch.num_items_in_batch


def test_shard_batch_errors():
    mesh = make_mesh(data=2, cp=4)
    with pytest.raises(ValueError, match=r"B=3 is not divisible by data x fsdp = 2"):
        shard_batch(_padded_batch(num_rows=3, multiple=8), mesh)
    with pytest.raises(ValueError, match=r"--pad-to-multiple-of 8"):
        shard_batch(_padded_batch(num_rows=2, multiple=4, seed=1), mesh)


def test_param_shardings_split_only_over_fsdp():
    assert param_spec((4096, 1024), 1) == P()
    assert param_spec((1024, 4096), 8) == P(None, "fsdp")
    assert param_spec((7, 5), 2) == P()
    mesh = make_mesh(data=2, fsdp=2, cp=2)
    specs = param_shardings(mesh, {"w": np.zeros((6, 4)), "norm": np.zeros(5)})
    assert specs["w"].spec == P("fsdp", None) and specs["norm"].spec == P()


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_ring_attention_fn_on_data_and_cp_mesh_matches_dense(strategy):
    """Model layout [B, N, T, D], batch placed by shard_batch on a (data=2, cp=4) mesh, inside one jit."""
    mesh = make_mesh(data=2, cp=4)
    batch = _padded_batch(num_rows=2, multiple=64, seed=2)
    arrays = shard_batch(batch, mesh)
    seg, pos = arrays["segment_ids"], arrays["position_ids"]
    num_rows, seq_len = batch.input_ids.shape
    rng = np.random.default_rng(7)
    q, dout = (rng.standard_normal((num_rows, 4, seq_len, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((num_rows, 2, seq_len, 8)).astype(np.float32) for _ in range(2))
    attend = ring_attention_fn(mesh, strategy=strategy)

    def reorder(x_BNTD):  # the token axis (2 here) in shard_batch's zigzag order
        return jnp.asarray(shard_sequence(x_BNTD, 4, axis=2))

    @jax.jit
    def sharded(q, k, v, dout, seg, pos):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg, pos, 8 ** -0.5), q, k, v)
        return (out, *vjp(dout))

    @jax.jit
    def dense(q, k, v, dout, seg, pos):
        mask = document_causal_mask(seg, pos)
        out, vjp = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, mask, 8 ** -0.5), q, k, v)
        return (out, *vjp(dout))

    want = dense(q, k, v, dout, batch.segment_ids, batch.position_ids)
    got = sharded(*(reorder(x) for x in (q, k, v, dout)), seg, pos)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = np.abs(arrays["cp_batch"].unshard(np.asarray(g), axis=2) - np.asarray(w)).max()
        assert err <= 1e-5, f"{strategy} {name}: {err:.3g}"
