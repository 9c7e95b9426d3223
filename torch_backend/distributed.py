"""torch's distributed runtime: the launcher's environment, the process group and the named ("dp", "cp") mesh,
each rank's share of a step, the reductions over ranks, and the full (unsharded) state on rank 0.

Mesh. ``world_size = dp * cp`` ranks on a ``DeviceMesh`` named ``("dp", "cp")``, cp innermost
(the ranks of a cp group are neighbours, so on one node they share the fastest links). Ranks
of one cp group read the same rows and each keeps ``T / cp`` tokens of them
(``twinseq.torch_backend.context_parallel``); dp groups read different rows.

Loss normalisation. Every micro-batch loss is ``sum of its NLL / num_items_in_batch``, where
``num_items_in_batch`` counts the labels of the whole optimizer step over every micro-batch and every rank
(``StepIterator`` computes it locally). Gradients are therefore SUMMED over ranks (``parallel.apply_fsdp`` sets
FSDP's divide factor to 1), never averaged, and the logged loss is the all-reduced sum
(``reduce_step_metrics``).

Process group: gloo on CPU, NCCL on CUDA; rank and world size come from the environment that
``torchrun`` / ``accelerate launch`` set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from twinseq.common.config import TrainConfig
from twinseq.common.data.batching import Batch, pad_batch
from twinseq.common.errors import ConfigError
from twinseq.common.models.safetensors_stream import LazyArray
from twinseq.common.run.capabilities import Runtime as CapabilityRuntime
from twinseq.common.run.runner import preflight
from twinseq.common.run.step_metrics import ADDITIVE, INTEGER
from twinseq.torch_backend import context_parallel as cpmod

logger = logging.getLogger(__name__)

MESH_DIMS = ("dp", "cp")
FSDP_DIM = "dp_cp"


# --------------------------------------------------------------------------------------
# The named mesh and its rules
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshConfig:
    """``world_size`` ranks as ``dp x cp``; rank ``r`` sits at ``(r // cp, r % cp)``.

    >>> m = MeshConfig(world_size=4, cp=2)
    >>> m.dp, m.coords(3)
    (2, (1, 1))
    """

    world_size: int
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // self.cp

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, cp_rank) of a global rank."""
        return rank // self.cp, rank % self.cp


def check_launcher_env(cfg: TrainConfig, env: Optional[Mapping[str, str]] = None) -> None:
    """Refuse a launcher config (``accelerate launch --config_file``) that disagrees with ``cfg``.

    accelerate exports its YAML as environment variables; twinseq does its own FSDP2 and CP, so
    a YAML asking for something else must not be silently ignored.
    """
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and env.get("FSDP_VERSION", "2") != "2":
        raise ConfigError(
            f"the accelerate config asks for fsdp_version={env['FSDP_VERSION']}; twinseq shards with "
            f"FSDP2 only. Set fsdp_version: 2 in the accelerate YAML."
        )
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        cp_env = int(env.get("PARALLELISM_CONFIG_CP_SIZE", "1"))
        if cp_env != cfg.parallel.context_parallel_size:
            raise ConfigError(
                f"the accelerate config sets parallelism_config_cp_size={cp_env} but "
                f"context_parallel_size={cfg.parallel.context_parallel_size}; pass --context-parallel-size "
                f"{cp_env} (or change the YAML) so both agree."
            )
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "bf16" and cfg.model.dtype != "bfloat16":
        raise ConfigError(
            f"the accelerate config sets mixed_precision=bf16 but dtype={cfg.model.dtype!r}; pass "
            f"--dtype bfloat16 (or set mixed_precision: 'no')."
        )


def wants_distributed(cfg: TrainConfig, env: Optional[Mapping[str, str]] = None) -> bool:
    """True when the run must go through ``train_distributed`` (FSDP2 and/or CP)."""
    env = os.environ if env is None else env
    return int(env.get("WORLD_SIZE", "1")) > 1 or cfg.parallel.fsdp or cfg.parallel.context_parallel_size > 1


# --------------------------------------------------------------------------------------
# Process group and mesh
# --------------------------------------------------------------------------------------


@dataclass
class Runtime:
    """Where this process stands: device, global rank, mesh and its coordinates."""

    device: torch.device
    rank: int
    mesh_cfg: MeshConfig
    mesh: Any  # DeviceMesh ("dp", "cp")
    fsdp_mesh: Any  # the flattened dp x cp mesh FSDP shards over
    owns_group: bool  # this module initialised the process group (and destroys it)

    @property
    def dp_rank(self) -> int:
        return self.mesh_cfg.coords(self.rank)[0]

    @property
    def cp_rank(self) -> int:
        return self.mesh_cfg.coords(self.rank)[1]

    @property
    def cp_group(self):
        return self.mesh.get_group("cp") if self.mesh_cfg.cp > 1 else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer (set by torchrun).") from None


def init_runtime(cfg: TrainConfig, env: Optional[Mapping[str, str]] = None) -> Runtime:
    """Init the process group from the environment (or reuse one), check ``cfg``, build the mesh."""
    env = os.environ if env is None else env
    world_size, rank = _env_int(env, "WORLD_SIZE", 1), _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    preflight(cfg, CapabilityRuntime("torch", device.type, world_size, accelerator=device.type == "cuda"))
    check_launcher_env(cfg, env)
    mesh_cfg = MeshConfig(world_size=world_size, cp=cfg.parallel.context_parallel_size)
    owns_group = not dist.is_initialized()
    if owns_group:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world_size == 1 and "MASTER_ADDR" not in env:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
    if dist.get_world_size() != world_size:
        raise ConfigError(
            f"WORLD_SIZE={world_size} but the process group has {dist.get_world_size()} ranks; launch with "
            f"torchrun/accelerate so that they agree, or unset WORLD_SIZE."
        )
    mesh = init_device_mesh(device.type, (mesh_cfg.dp, mesh_cfg.cp), mesh_dim_names=MESH_DIMS)
    # DeviceMesh has no public flatten yet; torchtitan uses the same private call.
    fsdp_mesh = mesh[MESH_DIMS]._flatten(FSDP_DIM)
    return Runtime(device, dist.get_rank(), mesh_cfg, mesh, fsdp_mesh, owns_group)


# --------------------------------------------------------------------------------------
# A step on this rank: its share of the batch, and the metrics over all ranks
# --------------------------------------------------------------------------------------


def prepare_micro_batches(batches: list[Batch], cfg: TrainConfig, runtime: Runtime) -> list[Any]:
    """This rank's view of a step: the batches as they are (no CP), their ``CPShard`` (allgather),
    or ``RingMicroBatch`` (ring: the checked full batch, which ``ring_context`` shards). Rows are
    padded to a multiple of ``2 * cp`` when ``pad_to_multiple_of`` is unset."""
    cp = runtime.mesh_cfg.cp
    if cp == 1:
        return batches
    batches = [pad_batch(b, b.shape[0], 2 * cp) for b in batches]
    if cfg.parallel.context_parallel_strategy == "ring":
        return [cpmod.ring_micro_batch(b, cp, runtime.cp_rank) for b in batches]
    return [cpmod.shard_for_rank(b, cp, runtime.cp_rank, runtime.device) for b in batches]


@contextlib.contextmanager
def micro_batch_context(micro: Any, runtime: Optional[Runtime]) -> Iterator[Any]:
    """Yield what the model consumes for ``micro``; a ring micro-batch runs its forward and backward
    inside torch's ``context_parallel`` block, which shards the batch itself."""
    if isinstance(micro, cpmod.RingMicroBatch):
        with cpmod.ring_context(runtime.mesh["cp"], micro.batch, runtime.device) as shard:
            yield shard
    else:
        yield micro


def reduce_step_metrics(out: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Sum the additive metrics (``common.run.step_metrics.ADDITIVE``) over all ranks."""
    keys = [k for k in ADDITIVE if k in out]
    values = torch.tensor([float(out[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    out = {**out, **dict(zip(keys, values.tolist()))}
    for k in INTEGER:
        if k in out:
            out[k] = int(round(out[k]))
    return out


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) over ``group``. Backward: the identity, on every rank.

    For a loss ``L(S)`` of ``S = Σ_r s_r`` computed identically on every rank, rank r's backward of ``L`` then
    gives ``dL/dS · ds_r/dθ``, the gradient of its OWN share, and the sum over ranks that FSDP2 forms
    (``parallel.apply_fsdp``: divide factor 1) is ``dL/dθ`` exactly, with nothing counted twice. (torch's
    ``torch.distributed.nn.all_reduce`` sums the gradients in backward too, which would count it ``cp`` times.)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """``Σ_r x_r`` over the ranks of ``group`` (the same value on each), whose gradient is each rank's own share
    (``_SumOverRanks``); ``x`` itself when ``group`` is None (one rank)."""
    return x if group is None else _SumOverRanks.apply(x, group)


def any_over_ranks(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def max_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block first (it may build caches: corpus, tokenizer), the others after it; a no-op without
    a multi-rank process group (FSDP2's launch and DeepSpeed's alike)."""
    ranked = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if ranked and dist.get_rank() != 0:
        dist.barrier()
    yield
    if ranked and dist.get_rank() == 0:
        dist.barrier()


# --------------------------------------------------------------------------------------
# Full (unsharded) state on rank 0, for checkpoints and the final export
# --------------------------------------------------------------------------------------


def _full_options(**kw: Any):
    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def full_model_state(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Unsharded parameters by name (``prefix`` stripped), gathered on every rank's CPU (a collective
    under FSDP2); buffers excluded."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    state = get_model_state_dict(module, options=_full_options())
    return {k.removeprefix(prefix): v for k, v in state.items() if k in params}


def load_full_model_state(module: torch.nn.Module, tensors: Mapping[str, np.ndarray], prefix: str = "") -> None:
    """Load unsharded parameters (every rank holds them all) into a plain or FSDP2 module."""
    state = {prefix + k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}
    set_model_state_dict(module, state, options=_full_options(strict=False))


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name (``{"state": {fqn: {...}}, "param_groups": [...]}``)."""
    return get_optimizer_state_dict(module, optimizer, options=_full_options())


def load_full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    set_optimizer_state_dict(module, optimizer, state, options=_full_options())


# The same two states, streamed: each tensor is a ``LazyArray`` that gathers (a collective under FSDP2: every
# rank produces every tensor, in the same order) and converts that one tensor only when the writer asks for it.
# What ``full_model_state`` / ``full_optimizer_state`` gather at once, a save then holds one tensor at a time.


def lazy_tensor(tensor: torch.Tensor, *, float32: bool = False) -> LazyArray:
    """``tensor`` (plain or a sharded ``DTensor``) as a numpy array on the host when produced: a zero-copy view
    of a CPU float32 tensor; bfloat16 as float32 (``float32``) or as its raw 16-bit words."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    as_float32 = float32 and tensor.dtype in (torch.bfloat16, torch.float16)

    def produce() -> np.ndarray:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = full.detach().cpu()
        if as_float32:
            return full.float().numpy()
        if full.dtype == torch.bfloat16:
            return full.contiguous().view(torch.int16).numpy()
        return full.numpy()

    return LazyArray(tuple(tensor.shape), "float32" if as_float32 else dtype, produce)


def lazy_model_state(
    module: torch.nn.Module, names: list[str], prefix: str = "", *, float32: bool = False
) -> dict[str, LazyArray]:
    """``full_model_state`` restricted to ``names`` (``prefix`` stripped), streamed."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return {name: lazy_tensor(params[prefix + name], float32=float32) for name in names}


def lazy_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``full_optimizer_state`` as ``to_numpy_tree`` writes it (tuples as lists, bfloat16 as float32), streamed.

    Keyed as torch's own full optimizer state dict is: a tied parameter by its first name, a parameter the
    optimizer has no state for yet left out of ``state`` but named in its group (``tests`` compare the two)."""
    fqn = {param: name for name, param in module.named_parameters()}

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return lazy_tensor(value, float32=True)
        if isinstance(value, (list, tuple)):
            return [leaf(v) for v in value]
        if isinstance(value, dict):
            return {str(k): leaf(v) for k, v in value.items()}
        return value

    groups = [
        {**{k: leaf(v) for k, v in group.items() if k != "params"}, "params": [fqn[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    state = {
        fqn[p]: leaf(optimizer.state[p])
        for group in optimizer.param_groups
        for p in group["params"]
        if optimizer.state.get(p)
    }
    return {"state": state, "param_groups": groups}
