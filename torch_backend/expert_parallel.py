"""Expert parallelism for transformers' mixture-of-experts blocks (``qwen3_moe``, ``mixtral``) on torch.distributed.

``shard_experts(model, group)`` swaps each MoE layer's ``mlp`` (transformers' ``Qwen3MoeSparseMoeBlock`` /
``MixtralSparseMoeBlock``) for an ``ExpertParallelMoe`` that reads the block's own parameters: the router (``gate``)
stays replicated, the same module object; the fused experts (``gate_up_proj [E, 2m, h]``, ``down_proj [E, h, m]``)
keep only this rank's contiguous slice of ``E / P`` experts (rank ``r`` owns experts ``[r * E / P, (r + 1) * E / P)``),
under the same parameter names.

Each rank routes its own tokens, sends every token copy (token, expert) to the rank owning the expert, computes the
experts it owns on what it received, sends the outputs back, and combines them with its router weights. The token
exchange is ``torch.distributed.all_to_all_single`` with per-rank split sizes (gloo implements it on CPU tensors),
inside an autograd function whose backward is the reverse exchange. No capacity: every copy reaches its expert.

Gradients: the experts' gradients of a rank cover every rank's tokens routed to them (through the backward
exchange); the replicated parameters' gradients are this rank's tokens only and are summed over the group by the
caller, as under data parallelism.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from twinseq.common.errors import ConfigError

logger = logging.getLogger(__name__)

EXCHANGE = "all_to_all_single"
"""The collective that moves token copies between ranks (gloo supports it with uneven split sizes)."""


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` in rank order, ``send[p]`` of them to rank ``p``; receives ``recv[p]`` rows from each rank ``p``.
    Backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` of the rows of ``x`` (no autograd)."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def exchange_counts(send_P: torch.Tensor, group) -> torch.Tensor:
    """How many rows each rank sends this rank, from the counts ``send_P`` this rank sends each rank."""
    recv_P = torch.empty_like(send_P)
    dist.all_to_all_single(recv_P, send_P.contiguous(), group=group)
    return recv_P


class LocalExperts(torch.nn.Module):
    """This rank's slice of transformers' fused experts: experts ``first .. first + num_local - 1``."""

    def __init__(self, experts: Any, first: int, num_local: int):
        super().__init__()
        self.first, self.num_local = first, num_local
        local = slice(first, first + num_local)
        self.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[local].clone())
        self.down_proj = torch.nn.Parameter(experts.down_proj.detach()[local].clone())
        self.act_fn: Any = experts.act_fn

    def forward(self, x_RH: torch.Tensor, local_R: torch.Tensor) -> torch.Tensor:
        """Expert ``local_R[i]``'s gated MLP of row ``i`` (``local_R`` counts from this rank's first expert)."""
        y_RH = x_RH.new_zeros(x_RH.shape)
        for j in range(self.num_local):
            rows = (local_R == j).nonzero().squeeze(1)
            gate, up = torch.nn.functional.linear(x_RH[rows], self.gate_up_proj[j]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[j])
            y_RH = y_RH.index_add(0, rows, y)
        return y_RH


class ExpertParallelMoe(torch.nn.Module):
    """A MoE block with its experts sharded over ``group`` (see the module docstring). ``received_E`` holds, after
    each forward, how many token copies each of this rank's experts computed (from every rank)."""

    def __init__(self, block: torch.nn.Module, group, num_experts: int):
        super().__init__()
        self.group = group
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.per_rank = num_experts // self.world
        self.gate: Any = block.gate
        self.experts = LocalExperts(block.experts, rank * self.per_rank, self.per_rank)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.received_E: Optional[torch.Tensor] = None

    def forward(self, hidden_states_BTH: torch.Tensor) -> torch.Tensor:
        b, t, h = hidden_states_BTH.shape
        if self.training and self.jitter_noise > 0:  # MixtralSparseMoeBlock's router jitter
            noise = torch.empty_like(hidden_states_BTH).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states_BTH = hidden_states_BTH * noise
        x_NH = hidden_states_BTH.reshape(-1, h)
        _, weights_NK, experts_NK = self.gate(x_NH)
        k = experts_NK.shape[-1]
        order_C = torch.argsort(experts_NK.reshape(-1), stable=True)  # copies by expert, hence by owning rank
        expert_C = experts_NK.reshape(-1)[order_C]
        send_P = torch.bincount(expert_C // self.per_rank, minlength=self.world)
        send, recv = send_P.tolist(), exchange_counts(send_P, self.group).tolist()
        x_RH = _AllToAll.apply(x_NH[order_C // k], send, recv, self.group)
        local_R = _exchange(expert_C, send, recv, self.group) - self.experts.first
        self.received_E = torch.bincount(local_R, minlength=self.per_rank).detach()
        y_CH = _AllToAll.apply(self.experts(x_RH, local_R), recv, send, self.group)
        # weighed and summed in the weights' dtype (float32 for Mixtral), then cast back, as transformers' experts
        y_CH = y_CH * weights_NK.reshape(-1)[order_C, None]
        y_NH = y_CH.new_zeros((b * t, h)).index_add(0, order_C // k, y_CH)
        return y_NH.to(hidden_states_BTH.dtype).reshape(b, t, h)


def _moe_blocks(model: Any) -> list[tuple[Any, Any]]:
    """(decoder layer, its MoE block) of every layer whose ``mlp`` has fused experts."""
    layers = model.get_decoder().layers
    return [(layer, layer.mlp) for layer in layers if hasattr(getattr(layer.mlp, "experts", None), "gate_up_proj")]


def check_expert_parallel(num_experts: int, world: int, blocks: list) -> None:
    """Refuses what expert parallelism cannot shard, naming the field, the value and the fix."""
    if not blocks:
        raise ConfigError(
            "expert_parallel_size > 1 needs a mixture-of-experts model (model_type qwen3_moe or mixtral with fused "
            "experts); this model has no MoE layer: set expert_parallel_size=1."
        )
    if num_experts % world:
        raise ConfigError(
            f"ModelConfig.num_experts={num_experts} is not divisible by expert_parallel_size={world} (each rank owns "
            f"an equal contiguous slice of experts); set expert_parallel_size to a divisor of {num_experts}."
        )
    for _, block in blocks:
        if not hasattr(block, "gate") or hasattr(block.experts, "gate_up_proj_bias"):
            raise ConfigError(
                f"expert parallelism shards the fused bias-free experts of qwen3_moe and mixtral; this model's MoE "
                f"block ({type(block).__name__}, as gpt_oss's: expert biases, a clamped SwiGLU on interleaved "
                f"gate/up columns, a router module) is not supported: set expert_parallel_size=1."
            )
        if not isinstance(block.experts.gate_up_proj, torch.nn.Parameter):
            raise ConfigError(
                "expert parallelism shards plain expert parameters; this model's experts carry adapters "
                "(lora_target_parameters on experts.*): install expert parallelism before adding adapters, or "
                "set expert_parallel_size=1."
            )


def shard_experts(model: torch.nn.Module, group=None) -> int:
    """Swaps every MoE layer's block for an ``ExpertParallelMoe`` over ``group`` (default: the world); returns the
    number of layers swapped. The full expert tensors are released: each rank keeps its own experts."""
    if not dist.is_initialized():
        raise ConfigError(
            "expert_parallel_size > 1 exchanges tokens between ranks, but torch.distributed is not initialised: "
            "launch with torchrun --nproc-per-node <expert_parallel_size> (or init_process_group first), or set "
            "expert_parallel_size=1."
        )
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    model_config: Any = model.config
    num_experts = int(getattr(model_config, "num_experts", 0) or getattr(model_config, "num_local_experts", 0))
    blocks = _moe_blocks(model)
    check_expert_parallel(num_experts, world, blocks)
    for layer, block in blocks:
        layer.mlp = ExpertParallelMoe(block, group, num_experts)
    logger.info(
        "expert parallelism: %d experts over %d ranks (%d per rank) in %d layers; token exchange by "
        "torch.distributed.%s with split sizes (backend %s)",
        num_experts,
        world,
        num_experts // world,
        len(blocks),
        EXCHANGE,
        dist.get_backend(group),
    )
    return len(blocks)
