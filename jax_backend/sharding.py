"""Device meshes and shardings for the JAX backend: data parallel, FSDP and context parallel.

The mesh always has the three named axes ``("data", "fsdp", "cp")`` (size 1 when unused), so a
``PartitionSpec`` naming any of them is valid on every mesh:

- batch arrays ``[B, T]`` are split over ``("data", "fsdp")`` on B and over ``cp`` on T, in the
  load-balanced zigzag order of ``twinseq.common.context_parallel`` (see ``shard_batch``);
- parameters are replicated, except over ``fsdp`` where the largest divisible dim is split;
- attention inside the model runs ``ring_attention_fn(mesh)`` in place of dense attention.

Axis types are ``Auto``: ``jit`` propagates shardings from its inputs and ``shard_map`` reshards
its operands as needed, so the model code stays free of sharding annotations.

Typical use::

    mesh = make_mesh(data=2, cp=4)
    arrays = shard_batch(batch, mesh)          # zigzag-reordered, targets shifted, on the mesh
    attend = ring_attention_fn(mesh)           # a drop-in for dense attention, HF layout
    out_BNTD = attend(q_BNTD, k_BKTD, v_BKTD, arrays["segment_ids"], arrays["position_ids"], scaling)
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twinseq.common.batching import Batch
from twinseq.common.context_parallel import CPBatch
from twinseq.common.context_parallel import shard_batch as reorder_batch
from twinseq.common.context_parallel import unshard_sequence
from twinseq.jax_backend.ring_attention import STRATEGIES, sharded_attention

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "cp")
BATCH_AXES = ("data", "fsdp")
CP_AXIS = "cp"


def _check_axis_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"mesh axis {name}={value!r} must be a positive integer.")
    return int(value)


def make_mesh(data: int = 1, cp: int = 1, fsdp: int = 1, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ``Mesh`` of shape ``(data, fsdp, cp)`` named ``("data", "fsdp", "cp")`` over ``devices``.

    ``devices`` defaults to all of ``jax.devices()``; the axis sizes must multiply to their count.
    Devices that are neighbours in the list are neighbours on ``cp`` (the ring's hops).
    """
    sizes = {"data": _check_axis_size("data", data), "fsdp": _check_axis_size("fsdp", fsdp),
             "cp": _check_axis_size("cp", cp)}
    devices = list(jax.devices() if devices is None else devices)
    if sizes["cp"] > len(devices):
        raise ValueError(f"cp={cp} is larger than the {len(devices)} available devices; use cp <= {len(devices)} "
                         f"(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax).")
    product = sizes["data"] * sizes["fsdp"] * sizes["cp"]
    if product != len(devices):
        model_parallel = sizes["fsdp"] * sizes["cp"]
        fits = len(devices) % model_parallel == 0
        hint = f"e.g. data={len(devices) // model_parallel}" if fits else "pick sizes whose product is the device count"
        raise ValueError(f"mesh axes data={data} x fsdp={fsdp} x cp={cp} = {product} do not multiply to the "
                         f"{len(devices)} devices; {hint}, or pass devices=jax.devices()[:{product}].")
    grid = np.asarray(devices, dtype=object).reshape(sizes["data"], sizes["fsdp"], sizes["cp"])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _check_mesh(mesh: Mesh) -> None:
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} are not {MESH_AXES}; build the mesh with make_mesh().")


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``[B, T]`` (and ``[B, T, ...]``) arrays: B over ``("data", "fsdp")``, T over ``cp``."""
    _check_mesh(mesh)
    return NamedSharding(mesh, P(BATCH_AXES, CP_AXIS))


def param_spec(shape: Sequence[int], fsdp_size: int) -> P:
    """Replicated, or with ``fsdp > 1`` the largest dim divisible by it split over ``fsdp``.

    >>> param_spec((4096, 1024), 8), param_spec((1024,), 8), param_spec((6, 5), 4)
    (P('fsdp', None), P('fsdp',), P())
    """
    if fsdp_size == 1:
        return P()
    dims = sorted(range(len(shape)), key=lambda d: -shape[d])
    for d in dims:
        if shape[d] % fsdp_size == 0:
            return P(*[("fsdp" if i == d else None) for i in range(len(shape))])
    return P()


def param_shardings(mesh: Mesh, params: Any) -> Any:
    """A pytree of ``NamedSharding`` matching ``params`` (a pytree of arrays or shape-dtype structs)."""
    _check_mesh(mesh)
    fsdp_size = mesh.shape["fsdp"]

    def one(x):
        spec = param_spec(np.shape(x), fsdp_size)
        if fsdp_size > 1 and spec == P() and np.size(x) > 1:
            logger.info("parameter of shape %s has no dim divisible by fsdp=%d; replicating it.",
                        np.shape(x), fsdp_size)
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, params)


def shard_params(mesh: Mesh, params: Any) -> Any:
    """``jax.device_put`` every parameter with ``param_shardings``."""
    return jax.device_put(params, param_shardings(mesh, params))


def shard_batch(batch: Batch, mesh: Mesh, load_balance: bool = True) -> dict[str, Any]:
    """Reorder ``batch`` for CP (labels shifted first) and place it on ``mesh``.

    Returns ``input_ids``, ``targets`` (already shifted: the loss must not shift again),
    ``position_ids`` and ``segment_ids`` as [B, T] ``jax.Array`` with ``batch_sharding(mesh)``,
    plus ``num_items_in_batch`` (an int) and ``cp_batch`` (the numpy ``CPBatch``, whose
    ``unshard`` puts per-token outputs back in token order).
    """
    _check_mesh(mesh)
    num_rows = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch.input_ids.shape[0] % num_rows:
        raise ValueError(f"batch size B={batch.input_ids.shape[0]} is not divisible by data x fsdp = {num_rows}; "
                         f"set per_device_train_batch_size so that B is a multiple of {num_rows}.")
    cp_batch = reorder_batch(batch, mesh.shape[CP_AXIS], load_balance)
    sharding = batch_sharding(mesh)
    arrays: dict[str, Any] = {k: jax.device_put(v, sharding) for k, v in cp_batch.arrays().items()}
    arrays["num_items_in_batch"] = cp_batch.num_items_in_batch
    arrays["cp_batch"] = cp_batch
    return arrays


def unshard_tokens(x_BT: Any, mesh: Mesh, load_balance: bool = True) -> np.ndarray:
    """A per-token result [B, T, ...] of a sharded step, back in token order (numpy)."""
    _check_mesh(mesh)
    return unshard_sequence(np.asarray(x_BT), mesh.shape[CP_AXIS], load_balance, axis=1)


AttentionFn = Callable[..., jax.Array]


def ring_attention_fn(mesh: Mesh, strategy: str = "ring", block_q: Optional[int] = None,
                      block_k: Optional[int] = None) -> AttentionFn:
    """Context-parallel attention with the model's (Hugging Face) layout.

    The returned ``attend(q_BNTD, k_BKTD, v_BKTD, segment_ids_BT, position_ids_BT, scaling) -> out_BNTD``
    takes global arrays whose T axis is in the ``shard_batch`` order (and sharded over ``cp``);
    it equals ``dot_product_attention(q, k, v, document_causal_mask(seg, pos), scaling)`` of
    ``twinseq.jax_backend.attention``, except that queries with no allowed key give zeros in both.
    """
    _check_mesh(mesh)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not valid; choose one of {STRATEGIES}.")

    def attend(q_BNTD, k_BKTD, v_BKTD, segment_ids_BT, position_ids_BT, scaling):
        out_BTND = sharded_attention(q_BNTD.transpose(0, 2, 1, 3), k_BKTD.transpose(0, 2, 1, 3),
                                     v_BKTD.transpose(0, 2, 1, 3), segment_ids_BT, position_ids_BT, mesh,
                                     strategy=strategy, axis_name=CP_AXIS, batch_axes=BATCH_AXES,
                                     scale=scaling, block_q=block_q, block_k=block_k)
        return out_BTND.transpose(0, 2, 1, 3)

    return attend


__all__ = ["MESH_AXES", "BATCH_AXES", "CP_AXIS", "CPBatch", "make_mesh", "batch_sharding", "param_spec",
           "param_shardings", "shard_params", "shard_batch", "unshard_tokens", "ring_attention_fn"]
