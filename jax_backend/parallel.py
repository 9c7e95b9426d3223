"""All JAX parallelism: the named ("data", "fsdp", "cp") mesh, shardings, and context-parallel data.

The mesh always has the three named axes ``("data", "fsdp", "cp")`` (size 1 when unused), so a
``PartitionSpec`` naming any of them is valid on every mesh:

- batch arrays ``[B, T]`` are split over ``("data", "fsdp")`` on B and over ``cp`` on T, in the
  load-balanced zigzag order of ``twinseq.common.data.context_parallel`` (see ``shard_batch``; a DPO
  preference batch, with its targets' document ids, ``shard_preference_batch``);
- parameters are replicated, except over ``fsdp`` where the largest divisible dim is split;
- attention inside the model runs ``ring_attention_fn(mesh)`` in place of dense attention.

Axis types are ``Auto``: ``jit`` propagates shardings from its inputs and ``shard_map`` reshards
its operands as needed, so the model code stays free of sharding annotations.

The trainer (``twinseq train --backend jax --context-parallel-size N``) builds its mesh with
``mesh_from_config``, feeds it global micro-batches from ``DataParallelSteps`` (each data-axis
replica reads its own rows, as a torch data-parallel rank does) and runs the model with
``attend=ring_attention_fn(mesh, ...)`` on the ``shard_batch`` arrays.

Typical use::

    mesh = make_mesh(data=2, cp=4)
    arrays = shard_batch(batch, mesh)          # zigzag-reordered, targets shifted, on the mesh
    attend = ring_attention_fn(mesh)           # a drop-in for dense attention, HF layout
    out_BNTD = attend(q_BNTD, k_BKTD, v_BKTD, arrays["segment_ids"], arrays["position_ids"], scaling)
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twinseq.common.config import TrainConfig
from twinseq.common.data.batching import IGNORE_INDEX, Batch, pad_batch
from twinseq.common.data.context_parallel import CPBatch, shard_sequence, unshard_sequence
from twinseq.common.data.context_parallel import shard_batch as reorder_batch
from twinseq.common.data.preference_batching import PreferenceBatch
from twinseq.common.data.sft_steps import StepIterator
from twinseq.common.errors import ConfigError
from twinseq.common.run.capabilities import Runtime, check_runtime
from twinseq.jax_backend.context_parallel import STRATEGIES, sharded_attention
from twinseq.jax_backend.memory import apply_activation_checkpointing, remat_policy_of

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "cp")
BATCH_AXES = ("data", "fsdp")
CP_AXIS = "cp"


def _check_axis_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"mesh axis {name}={value!r} must be a positive integer; pass 1 or more devices.")
    return int(value)


def make_mesh(data: int = 1, cp: int = 1, fsdp: int = 1, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ``Mesh`` of shape ``(data, fsdp, cp)`` named ``("data", "fsdp", "cp")`` over ``devices``.

    ``devices`` defaults to all of ``jax.devices()``; the axis sizes must multiply to their count.
    Devices that are neighbours in the list are neighbours on ``cp`` (the ring's hops).
    """
    sizes = {
        "data": _check_axis_size("data", data),
        "fsdp": _check_axis_size("fsdp", fsdp),
        "cp": _check_axis_size("cp", cp),
    }
    devices = list(jax.devices() if devices is None else devices)
    if sizes["cp"] > len(devices):
        raise ConfigError(
            f"cp={cp} is larger than the {len(devices)} available devices; use cp <= {len(devices)} "
            f"(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)."
        )
    product = sizes["data"] * sizes["fsdp"] * sizes["cp"]
    if product != len(devices):
        model_parallel = sizes["fsdp"] * sizes["cp"]
        fits = len(devices) % model_parallel == 0
        hint = f"e.g. data={len(devices) // model_parallel}" if fits else "pick sizes whose product is the device count"
        raise ConfigError(
            f"mesh axes data={data} x fsdp={fsdp} x cp={cp} = {product} do not multiply to the "
            f"{len(devices)} devices; {hint}, or pass devices=jax.devices()[:{product}]."
        )
    grid = np.asarray(devices, dtype=object).reshape(sizes["data"], sizes["fsdp"], sizes["cp"])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _check_mesh(mesh: Mesh) -> None:
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ConfigError(f"mesh axes {tuple(mesh.axis_names)} are not {MESH_AXES}; build the mesh with make_mesh().")


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
            logger.info(
                "parameter of shape %s has no dim divisible by fsdp=%d; replicating it.", np.shape(x), fsdp_size
            )
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
    if batch.shares_prefix:
        raise ConfigError(
            f"a prefix-shared batch (parent_ids set) on a mesh with cp={mesh.shape[CP_AXIS]}: the sharded step "
            f"does not carry parent segments yet; pass share_prefix=False when collating (--no-share-prefix)."
        )
    num_rows = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch.input_ids.shape[0] % num_rows:
        raise ConfigError(
            f"batch size B={batch.input_ids.shape[0]} is not divisible by data x fsdp = {num_rows}; "
            f"set per_device_train_batch_size so that B is a multiple of {num_rows}."
        )
    cp_batch = reorder_batch(batch, mesh.shape[CP_AXIS], load_balance)
    sharding = batch_sharding(mesh)
    arrays: dict[str, Any] = {k: jax.device_put(v, sharding) for k, v in cp_batch.arrays().items()}
    arrays["num_items_in_batch"] = cp_batch.num_items_in_batch
    arrays["cp_batch"] = cp_batch
    return arrays


def shard_preference_batch(pbatch: PreferenceBatch, mesh: Mesh, load_balance: bool = True) -> tuple[Any, ...]:
    """DPO's ``dpo.preference_inputs`` for a CP step: ``(input_ids, position_ids, segment_ids, targets,
    target_doc_ids, num_target_tokens)``, the [B, T] arrays reordered by ``shard_batch`` and placed with
    ``batch_sharding(mesh)``; ``num_target_tokens`` [2N] is replicated.

    ``target_doc_ids[t]`` already names the document of the target predicted at t (``labels[t + 1]``), so it is
    aligned with the shifted targets and takes the same zigzag reorder; the loss must not shift again.

    >>> from twinseq.common.data.preference_batching import collate_preference
    >>> pb = collate_preference([{"prompt_input_ids": [5, 6], "chosen_input_ids": [7, 8],
    ...                           "rejected_input_ids": [9]}], padding_free=True, pad_to_multiple_of=8)
    >>> pb.target_doc_ids.tolist(), shard_sequence(pb.target_doc_ids, 2, axis=1).tolist()
    ([[-1, 0, 0, -1, -1, 1, -1, -1]], [[-1, 0, -1, -1, 0, -1, -1, 1]])
    """
    arrays = shard_batch(pbatch.batch, mesh, load_balance)
    cp_batch: CPBatch = arrays["cp_batch"]
    target_doc_BT = shard_sequence(pbatch.target_doc_ids, mesh.shape[CP_AXIS], load_balance, axis=1)
    assert ((target_doc_BT >= 0) == (cp_batch.targets != IGNORE_INDEX)).all(), "targets and documents disagree"
    replicated = NamedSharding(mesh, P())
    return (
        *(arrays[k] for k in ("input_ids", "position_ids", "segment_ids", "targets")),
        jax.device_put(np.asarray(target_doc_BT, np.int32), batch_sharding(mesh)),
        jax.device_put(np.asarray(pbatch.num_target_tokens, np.int32), replicated),
    )


def unshard_tokens(x_BT: Any, mesh: Mesh, load_balance: bool = True) -> np.ndarray:
    """A per-token result [B, T, ...] of a sharded step, back in token order (numpy)."""
    _check_mesh(mesh)
    return unshard_sequence(np.asarray(x_BT), mesh.shape[CP_AXIS], load_balance, axis=1)


AttentionFn = Callable[..., jax.Array]


@functools.lru_cache(maxsize=None)  # one function per setting: jit keys static args by hash, a new closure recompiles
def ring_attention_fn(
    mesh: Mesh, strategy: str = "ring", block_q: Optional[int] = None, block_k: Optional[int] = None
) -> AttentionFn:
    """Context-parallel attention with the model's (Hugging Face) layout.

    The returned ``attend(q_BNTD, k_BKTD, v_BKTD, segment_ids_BT, position_ids_BT, scaling, *,
    sliding_window=None, softcap=None, sinks=None) -> out_BNTD`` takes global arrays whose T axis is in the
    ``shard_batch`` order (and sharded over ``cp``); it equals ``document_attention(q, k, v, seg, pos, scaling,
    sliding_window=..., softcap=..., sinks_N=...)`` of ``twinseq.jax_backend.attention`` (the window is a band in
    positions, so the zigzag order does not matter), and queries with no allowed key give zeros in both.
    """
    _check_mesh(mesh)
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r} is not valid; choose one of {STRATEGIES}.")

    def attend(
        q_BNTD,
        k_BKTD,
        v_BKTD,
        segment_ids_BT,
        position_ids_BT,
        scaling,
        *,
        sliding_window: Optional[int] = None,
        softcap: Optional[float] = None,
        sinks=None,
    ):
        out_BTND = sharded_attention(
            q_BNTD.transpose(0, 2, 1, 3),
            k_BKTD.transpose(0, 2, 1, 3),
            v_BKTD.transpose(0, 2, 1, 3),
            segment_ids_BT,
            position_ids_BT,
            mesh,
            strategy=strategy,
            axis_name=CP_AXIS,
            batch_axes=BATCH_AXES,
            scale=scaling,
            block_q=block_q,
            block_k=block_k,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks_N=sinks,
        )
        return out_BTND.transpose(0, 2, 1, 3)

    return attend


def parallelize(model, mesh: Optional[Mesh], cfg: TrainConfig):
    """The model a trainer steps, from the plain model, in a stated order (the torch backend's
    ``parallelize`` does context parallelism, checkpointing, compile and FSDP in its own order):

    1. activation memory: rematerialisation or host offload of every decoder layer
       (``memory.remat_policy_of(cfg)``);
    2. parameters placed on ``mesh`` (replicated over data and cp; split over fsdp).

    Context-parallel attention is a function the trainer passes at each call
    (``attention_of_config``), so the model itself is unchanged by it.
    """
    policy = remat_policy_of(cfg)
    if policy != "none":
        apply_activation_checkpointing(model, policy)
    if mesh is not None:
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, shard_params(mesh, state))
    return model


# ---------------------------------------------------------------------------------------
# The trainer's mesh and data feed (TrainConfig.context_parallel_size / _strategy)
# ---------------------------------------------------------------------------------------


def mesh_shape_of_config(cfg: TrainConfig, num_devices: int) -> tuple[int, int]:
    """``(data, cp)`` of the trainer's mesh for ``cfg`` on ``num_devices`` devices.

    ``cp = context_parallel_size``; ``data = num_devices // cp``: every visible device is used, as
    torch's data-parallel size is ``world_size / cp``. ``cp == 1`` means no mesh at all (one device).
    The checks (cp against the devices, ``pad_to_multiple_of`` against ``2 * cp``) are
    ``common.run.capabilities.check_runtime``'s, the same as the torch backend's.

    >>> cfg = TrainConfig.from_flat(context_parallel_size=4, pad_to_multiple_of=64)
    >>> mesh_shape_of_config(cfg, 8)
    (2, 4)
    """
    platform = jax.devices()[0].platform
    check_runtime(cfg, Runtime("jax", platform, num_devices, accelerator=platform != "cpu"))
    cp = cfg.parallel.context_parallel_size
    return (1, 1) if cp == 1 else (num_devices // cp, cp)


def mesh_from_config(cfg: TrainConfig, devices: Optional[Sequence[jax.Device]] = None) -> Optional[Mesh]:
    """The trainer's ``(data, fsdp=1, cp)`` mesh over ``devices`` (default all), or None without CP."""
    devices = list(jax.devices() if devices is None else devices)
    data, cp = mesh_shape_of_config(cfg, len(devices))
    if cp == 1:
        return None
    return make_mesh(data=data, cp=cp, devices=devices)


def attention_of_config(cfg: TrainConfig, mesh: Mesh) -> AttentionFn:
    """``ring_attention_fn`` for ``context_parallel_strategy`` (``allgather`` or ``ring``; both run on CPU)."""
    return ring_attention_fn(mesh, cfg.parallel.context_parallel_strategy)


def sequence_multiple(pad_to_multiple_of: int, cp: int) -> int:
    """The column multiple a CP batch is padded to: ``pad_to_multiple_of`` rounded to a multiple of ``2 * cp``.

    >>> sequence_multiple(64, 4), sequence_multiple(64, 3), sequence_multiple(16, 1)
    (64, 192, 16)
    """
    return pad_to_multiple_of if cp == 1 else math.lcm(pad_to_multiple_of, 2 * cp)


def stack_batches(batches: Sequence[Batch], rows: int, multiple: int) -> Batch:
    """One global micro-batch from the data-parallel ranks' micro-batches (rank order), for ``shard_batch``.

    Each is padded to ``rows`` rows and a common width (the longest, rounded up to ``multiple``), then
    rows are concatenated, so rank r's rows land on replica r of the ``data`` axis. Padding is segment
    0, label -100: it is never attended to nor scored. ``num_items_in_batch`` is the step total, the same
    on every rank.

    >>> from twinseq.common.data.batching import collate
    >>> a = collate([{"input_ids": [5, 6, 7]}], num_items_in_batch=3)
    >>> b = collate([{"input_ids": [8, 9]}], num_items_in_batch=3)
    >>> s = stack_batches([a, b], rows=1, multiple=4)
    >>> s.input_ids.tolist(), s.segment_ids.tolist(), s.cu_seqlens.tolist()
    ([[5, 6, 7, 0], [8, 9, 0, 0]], [[1, 1, 1, 0], [1, 1, 0, 0]], [0, 3, 5])
    """
    totals = {b.num_items_in_batch for b in batches}
    assert len(totals) == 1, f"ranks disagree on the step's label count: {totals}"
    width = -(-max(b.shape[1] for b in batches) // multiple) * multiple
    padded = [pad_batch(b, rows, width) for b in batches]
    lengths = np.concatenate([np.diff(b.cu_seqlens) for b in batches])
    return Batch(
        input_ids=np.concatenate([b.input_ids for b in padded]),
        labels=np.concatenate([b.labels for b in padded]),
        position_ids=np.concatenate([b.position_ids for b in padded]),
        segment_ids=np.concatenate([b.segment_ids for b in padded]),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        num_items_in_batch=totals.pop(),
    )


class DataParallelSteps:
    """The ``StepIterator`` of every data-axis replica, merged into global micro-batches per step.

    Replica r reads exactly the rows that torch's data-parallel rank r reads for the same config
    and seed (``StepIterator(world_size=data, rank=r)``); ``next_step`` returns
    ``gradient_accumulation_steps`` global batches of ``data * rows_per_replica`` rows.
    """

    def __init__(self, rows: Any, cfg: TrainConfig, pad_token_id: int, num_replicas: int, multiple: int) -> None:
        self.iterators = [
            StepIterator(rows, cfg, pad_token_id, world_size=num_replicas, rank=r) for r in range(num_replicas)
        ]
        # A padding-free micro-batch is one row however many examples it holds.
        self.rows_per_replica = 1 if cfg.data.padding_free else cfg.data.per_device_train_batch_size
        self.multiple = multiple

    @property
    def steps_per_epoch(self) -> int:
        return self.iterators[0].steps_per_epoch

    def next_step(self) -> list[Batch]:
        per_replica = [it.next_step() for it in self.iterators]
        return [stack_batches(micro, self.rows_per_replica, self.multiple) for micro in zip(*per_replica)]

    def state_dict(self) -> dict[str, int]:
        return self.iterators[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        for it in self.iterators:
            it.load_state_dict(state)


__all__ = [
    "parallelize",
    "MESH_AXES",
    "BATCH_AXES",
    "CP_AXIS",
    "CPBatch",
    "make_mesh",
    "batch_sharding",
    "param_spec",
    "param_shardings",
    "shard_params",
    "shard_batch",
    "shard_preference_batch",
    "unshard_tokens",
    "ring_attention_fn",
    "mesh_shape_of_config",
    "mesh_from_config",
    "attention_of_config",
    "sequence_multiple",
    "stack_batches",
    "DataParallelSteps",
]
