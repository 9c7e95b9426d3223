"""Expert parallelism for the MoE layers (``model.SparseMoeBlock``): the experts sharded over one mesh axis, the
tokens exchanged with ``jax.lax.all_to_all`` inside ``jax.shard_map``.

``shard_experts(model, mesh, axis)`` replaces each MoE layer's ``mlp`` with an ``ExpertParallelMoeBlock`` holding
the block's own parameters (the router ``gate`` and the fused ``experts``, the same ``nnx`` variables) and places
the model on ``mesh``: the experts' tensors sharded on their expert dimension over ``axis`` (device ``d`` owns experts
``[d * E / P, (d + 1) * E / P)``), everything else replicated.

The router runs on all tokens as in ``SparseMoeBlock.route``; then, per device of ``axis`` (its slice of the
tokens): every token copy (token, expert) goes to the device owning its expert, that device runs its experts on
what it received (``moe.grouped_experts`` on CPU, a grouped matmul per projection elsewhere), the outputs
go back, and each device combines its tokens' copies with the router weights. ``all_to_all`` needs equal blocks, so a
device sends each peer a block of ``tokens * top_k`` rows (room for all its copies) of which the first ``count``
are real: no capacity, no token dropped, at the price of ``P``-fold padded exchange buffers.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twinseq.common.errors import ConfigError
from twinseq.jax_backend import moe
from twinseq.jax_backend.grouped import default_block_rows, grouped_matmul, ragged_dot_is_grouped, varying_like
from twinseq.jax_backend.model import ACTIVATIONS, CausalLM, GptOssMoeBlock, SparseMoeBlock

logger = logging.getLogger(__name__)

EXPERT_AXIS = "expert"


def _dispatch_slots(owner_C: jax.Array, world: int) -> jax.Array:
    """Row of each copy in the ``[world * C]`` send buffer: peer ``owner``'s block, in copy order within it; copies
    with ``owner == world`` (padding tokens) get ``world * C``, out of bounds."""
    c = owner_C.shape[0]
    order = jnp.argsort(owner_C, stable=True)
    counts = jnp.bincount(owner_C, length=world + 1)
    starts = jnp.cumsum(counts) - counts
    rank_in_block = jnp.zeros(c, jnp.int32).at[order].set(jnp.arange(c, dtype=jnp.int32) - starts[owner_C[order]])
    return jnp.where(owner_C < world, owner_C * c + rank_in_block, world * c)


def _local_experts(hidden_act: str, x_RH, local_R, gate_up_LXH, down_LHM) -> jax.Array:
    """Expert ``local_R[i]``'s gated MLP of received row ``i``; rows with ``local_R == L`` (empty slots) give 0. On
    CPU and GPU ``moe.grouped_experts`` (each row its own token, weight 1: the empty slots sort last, past every
    group); on TPU one grouped matmul per projection (``grouped.ragged_dot_is_grouped``)."""
    num_local = gate_up_LXH.shape[0]
    order = jnp.argsort(local_R, stable=True)
    group_sizes_L = jnp.bincount(local_R, length=num_local + 1)[:num_local].astype(jnp.int32)
    if not ragged_dot_is_grouped():
        compute = jnp.result_type(x_RH, gate_up_LXH)
        layout = moe.Layout(True, moe.GluGate(ACTIVATIONS[hidden_act]), jnp.dtype(compute).name)
        ones_R = varying_like(jnp.ones(order.shape, compute), x_RH)  # varying as the rows, as its cotangent
        return moe.grouped_experts(
            x_RH, ones_R, order, group_sizes_L, gate_up_LXH, down_LHM, None, None, layout, default_block_rows()
        )
    x_SH = x_RH[order]
    gate_up_S2 = grouped_matmul(x_SH, gate_up_LXH, group_sizes_L, transposed=True)
    h_SM = moe.GluGate(ACTIVATIONS[hidden_act])(gate_up_S2)
    y_SH = grouped_matmul(h_SM, down_LHM, group_sizes_L, transposed=True)
    y_RH = jnp.zeros_like(y_SH).at[order].set(y_SH)
    return jnp.where((local_R < num_local)[:, None], y_RH, 0)


def _dispatch(axis: str, world: int, x_NH, experts_NK, valid_N, num_local: int):
    """Sends each copy of this device's tokens to the device owning its expert. Returns (received rows
    ``[world * C, H]``, their local expert ids (``num_local`` on empty slots), each copy's row in the send buffer
    (out of bounds for padding tokens)) with ``C = tokens * top_k``."""
    k = experts_NK.shape[1]
    expert_C = experts_NK.reshape(-1)
    owner_C = jnp.where(jnp.repeat(valid_N, k), expert_C // num_local, world)
    slot_C = _dispatch_slots(owner_C, world)
    rows = world * expert_C.shape[0]
    send_SH = jnp.zeros((rows, x_NH.shape[1]), x_NH.dtype).at[slot_C].set(jnp.repeat(x_NH, k, 0), mode="drop")
    send_S = jnp.full((rows,), -1, jnp.int32).at[slot_C].set(expert_C.astype(jnp.int32), mode="drop")
    recv_SH = jax.lax.all_to_all(send_SH, axis, 0, 0, tiled=True)
    recv_S = jax.lax.all_to_all(send_S, axis, 0, 0, tiled=True)
    first = jax.lax.axis_index(axis) * num_local
    return recv_SH, jnp.where(recv_S >= 0, recv_S - first, num_local), slot_C


def _expert_parallel_shard(
    hidden_act: str, axis: str, world: int, x_NH, weights_NK, experts_NK, valid_N, gate_up, down
):
    """One device's tokens through the exchange (see the module docstring); returns its tokens' outputs."""
    n, k = experts_NK.shape
    recv_SH, local_S, slot_C = _dispatch(axis, world, x_NH, experts_NK, valid_N, gate_up.shape[0])
    back_SH = jax.lax.all_to_all(_local_experts(hidden_act, recv_SH, local_S, gate_up, down), axis, 0, 0, tiled=True)
    sent_C = slot_C < back_SH.shape[0]  # every copy of a real token (no capacity)
    y_CH = jnp.where(sent_C[:, None], back_SH[jnp.minimum(slot_C, back_SH.shape[0] - 1)], 0)
    y_CH = y_CH * weights_NK.reshape(-1)[:, None]
    # summed in the weights' dtype (float32 for Mixtral), then cast back, as SparseMoeBlock
    return jnp.zeros((n, x_NH.shape[1]), y_CH.dtype).at[jnp.arange(n * k) // k].add(y_CH).astype(x_NH.dtype)


class ExpertParallelMoeBlock(SparseMoeBlock):
    """A ``SparseMoeBlock`` whose experts run sharded over ``axis`` of ``mesh`` (see the module docstring)."""

    def __init__(self, block: SparseMoeBlock, mesh: Mesh, axis: str = EXPERT_AXIS):
        self.gate, self.experts = block.gate, block.experts
        self.num_experts, self.top_k = block.num_experts, block.top_k
        self.renormalise_top_k, self.routing_weights_f32 = block.renormalise_top_k, block.routing_weights_f32
        self.hidden_act = block.hidden_act
        self._init_expert_state()  # float experts without LoRA: check_expert_parallel refuses the others
        self.tile_size = block.tile_size
        self.mesh, self.axis = mesh, axis

    def with_router_logits(self, x_BTH: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, t, h = x_BTH.shape
        router_logits_NE, weights_NK, experts_NK = self.route(x_BTH.reshape(b * t, h))
        world, tokens = self.mesh.shape[self.axis], P(self.axis)
        shard = functools.partial(_expert_parallel_shard, self.hidden_act, self.axis, world)
        run: Any = jax.shard_map(shard, mesh=self.mesh, in_specs=(tokens,) * 6, out_specs=tokens)
        y_NH = run(*self._padded(x_BTH, weights_NK, experts_NK), *self._expert_tensors()[:2])
        return y_NH[: b * t].reshape(b, t, h), router_logits_NE

    def _padded(self, x_BTH, weights_NK, experts_NK) -> tuple[jax.Array, ...]:
        """(x_NH, weights_NK, experts_NK, valid_N), the tokens padded to a multiple of the axis size."""
        n = x_BTH.shape[0] * x_BTH.shape[1]
        pad = -n % self.mesh.shape[self.axis]
        padded = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x_BTH.reshape(n, -1), weights_NK, experts_NK))
        return (*padded, jnp.arange(n + pad) < n)

    def received_counts(self, x_BTH: jax.Array) -> jax.Array:
        """int32 ``[E]``: the token copies each expert computed, on the device owning it (a check that every copy
        reaches its expert)."""
        _, _, experts_NK = self.route(x_BTH.reshape(-1, x_BTH.shape[-1]))
        world, tokens = self.mesh.shape[self.axis], P(self.axis)
        num_local = self.num_experts // world

        def count(x_NH, experts_NK, valid_N):
            local_S = _dispatch(self.axis, world, x_NH, experts_NK, valid_N, num_local)[1]
            return jnp.bincount(local_S, length=num_local + 1)[:num_local]

        run = jax.shard_map(count, mesh=self.mesh, in_specs=(tokens,) * 3, out_specs=tokens)
        x_NH, _, experts_NK, valid_N = self._padded(x_BTH, experts_NK, experts_NK)
        return run(x_NH, experts_NK, valid_N)


def expert_mesh(num_devices: int, axis: str = EXPERT_AXIS) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` devices, axis ``axis``."""
    devices = jax.devices()
    if num_devices > len(devices):
        raise ConfigError(
            f"expert_parallel_size={num_devices} exceeds the {len(devices)} devices JAX sees; set "
            f"expert_parallel_size <= {len(devices)}."
        )
    return Mesh(np.asarray(devices[:num_devices]), (axis,))


def check_expert_parallel(num_experts: int, world: int, blocks: list) -> None:
    """Refuses what expert parallelism cannot shard, naming the field, the value and the fix."""
    if not blocks:
        raise ConfigError(
            "expert_parallel_size > 1 needs a mixture-of-experts model (model_type qwen3_moe or mixtral); this "
            "model has no MoE layer: set expert_parallel_size=1."
        )
    if any(isinstance(block, GptOssMoeBlock) for block in blocks):
        raise ConfigError(
            "expert_parallel_size > 1 does not shard gpt_oss's experts yet (model_type 'gpt_oss': a biased router "
            "and biased, interleaved, clamped-SwiGLU experts that ExpertParallelMoeBlock does not compute); set "
            "expert_parallel_size=1."
        )
    if num_experts % world:
        raise ConfigError(
            f"ModelConfig.num_experts={num_experts} is not divisible by expert_parallel_size={world} (each device "
            f"owns an equal contiguous slice of experts); set expert_parallel_size to a divisor of {num_experts}."
        )
    if any(block.expert_lora for block in blocks):
        raise ConfigError(
            "expert parallelism does not yet shard LoRA on experts (lora_target_parameters on experts.*): set "
            "expert_parallel_size=1 or drop the expert targets."
        )
    if any(block.nf4_shapes for block in blocks):
        raise ConfigError(
            "expert parallelism does not yet shard NF4 experts (load_in_4bit=True on a MoE model): set "
            "expert_parallel_size=1 or drop --load-in-4bit."
        )


def _place(model: CausalLM, mesh: Mesh, axis: str) -> None:
    """The model's variables on ``mesh``: expert tensors sharded on their first dimension, the rest replicated."""
    state = nnx.state(model)

    def put(path, value):
        spec = P(axis) if "experts" in path and {"gate_up_proj", "down_proj"} & set(path) else P()
        return jax.device_put(value, NamedSharding(mesh, spec))

    nnx.update(model, jax.tree_util.tree_map_with_path(lambda p, v: put(tuple(_key(k) for k in p), v), state))


def _key(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry))))


def shard_experts(model: CausalLM, mesh: Mesh, axis: str = EXPERT_AXIS) -> int:
    """Swaps every MoE layer's ``mlp`` for an ``ExpertParallelMoeBlock`` over ``axis`` of ``mesh`` and places the
    model on the mesh; returns the number of layers swapped."""
    layers = [layer for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    world = mesh.shape[axis]
    num_experts = layers[0].mlp.num_experts if layers else 0
    check_expert_parallel(num_experts, world, [layer.mlp for layer in layers])
    for layer in layers:
        layer.mlp = ExpertParallelMoeBlock(layer.mlp, mesh, axis)
    _place(model, mesh, axis)
    logger.info(
        "expert parallelism: %d experts over %d devices of mesh axis %r (%d per device) in %d layers; token "
        "exchange by jax.lax.all_to_all in shard_map (padded blocks, no capacity drop)",
        num_experts,
        world,
        axis,
        num_experts // world,
        len(layers),
    )
    return len(layers)
