"""All torch parallelism: the named ("dp", "cp") mesh, and ``parallelize``, which turns the plain model
into what a trainer steps: context parallelism, activation checkpointing, compile and FSDP2, in that order.

The model code (``model.py``, ``attention.py``) has no distributed imports: a trainer builds the
plain Hugging Face model, then calls ``parallelize(model, runtime, cfg)`` (torchtitan's split).

Mesh. ``world_size = dp * cp`` ranks on a ``DeviceMesh`` named ``("dp", "cp")``, cp innermost
(the ranks of a cp group are neighbours, so on one node they share the fastest links). Ranks
of one cp group read the same rows and each keeps ``T / cp`` tokens of them
(``twinseq.torch_backend.context_parallel``); dp groups read different rows.

FSDP2. Parameters, gradients and optimizer state are sharded with ``fully_shard`` over the
flattened ``dp x cp`` mesh (as torchtitan's ``dp_shard_cp``): cp ranks hold different tokens
of the same rows, so their gradients are partial sums exactly like dp ranks', and one
reduce-scatter over all ranks adds both. Each decoder layer is its own FSDP unit; the root is
``CausalLMLoss`` (model body + lm_head + loss in one forward, so the tied embedding is
gathered once and its gradient reduced once). Mixed precision (bf16 params, fp32 reduce) is
used on CUDA with ``dtype=bfloat16`` only.

Loss normalisation (ANCHORS failure 8). Every micro-batch loss is ``sum of its NLL /
num_items_in_batch``, where ``num_items_in_batch`` counts the labels of the whole optimizer
step over every micro-batch and every rank (``StepIterator`` computes it locally). Gradients
are therefore SUMMED over ranks (FSDP's divide factor is set to 1), never averaged, and the
logged loss is the all-reduced sum.

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

from twinseq.common.batching import Batch, pad_batch
from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.step_metrics import ADDITIVE, INTEGER
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
        raise ConfigError(f"the accelerate config asks for fsdp_version={env['FSDP_VERSION']}; twinseq shards with "
                          f"FSDP2 only. Set fsdp_version: 2 in the accelerate YAML.")
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        cp_env = int(env.get("PARALLELISM_CONFIG_CP_SIZE", "1"))
        if cp_env != cfg.parallel.context_parallel_size:
            raise ConfigError(f"the accelerate config sets parallelism_config_cp_size={cp_env} but "
                              f"context_parallel_size={cfg.parallel.context_parallel_size}; pass --context-parallel-size "
                              f"{cp_env} (or change the YAML) so both agree.")
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "bf16" and cfg.model.dtype != "bfloat16":
        raise ConfigError(f"the accelerate config sets mixed_precision=bf16 but dtype={cfg.model.dtype!r}; pass "
                          f"--dtype bfloat16 (or set mixed_precision: 'no').")


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
    mesh: Any                 # DeviceMesh ("dp", "cp")
    fsdp_mesh: Any            # the flattened dp x cp mesh FSDP shards over
    owns_group: bool          # this module initialised the process group (and destroys it)

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
    from torch.distributed.device_mesh import init_device_mesh

    from twinseq.common.capabilities import Runtime as CapabilityRuntime
    from twinseq.common.runner import preflight

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
        raise ConfigError(f"WORLD_SIZE={world_size} but the process group has {dist.get_world_size()} ranks.")
    mesh = init_device_mesh(device.type, (mesh_cfg.dp, mesh_cfg.cp), mesh_dim_names=MESH_DIMS)
    # DeviceMesh has no public flatten yet; torchtitan uses the same private call.
    fsdp_mesh = mesh[MESH_DIMS]._flatten(FSDP_DIM)
    return Runtime(device, dist.get_rank(), mesh_cfg, mesh, fsdp_mesh, owns_group)


# --------------------------------------------------------------------------------------
# The model: body + loss in one FSDP root, and the sharding
# --------------------------------------------------------------------------------------


class CausalLMLoss(torch.nn.Module):
    """``forward(micro) -> (loss, metrics)`` for a ``Batch`` (no CP) or a ``CPShard``.

    Running the body, the lm_head and the loss inside one module forward lets FSDP2's hooks
    gather the root parameters (embeddings, final norm, lm_head) around all of their uses.
    """

    def __init__(self, causal_lm: torch.nn.Module, cfg: TrainConfig, cp_group=None) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.cfg, self.cp_group = cfg, cp_group

    def _hidden(self, micro) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(hidden_BTH, labels or targets, whether they are already shifted)."""
        from twinseq.torch_backend.attention import forward_hidden

        if isinstance(micro, Batch):
            hidden = forward_hidden(self.causal_lm, micro, self.cfg.model.attn_implementation)
            return hidden, torch.as_tensor(micro.labels, dtype=torch.long, device=hidden.device), False
        from twinseq.torch_backend.attention import mask_layout

        ctx = cpmod.make_context(micro, self.cp_group, self.cfg.parallel.context_parallel_strategy,
                                 mask_layout(self.causal_lm.config).sliding_window)
        from twinseq.torch_backend.peft import causal_lm_of

        out = causal_lm_of(self.causal_lm).model(input_ids=micro.input_ids, position_ids=micro.position_ids, use_cache=False,
                                   **{cpmod.CP_KWARG: ctx})
        return out.last_hidden_state, micro.targets, True

    def forward(self, micro):
        """``micro``: a ``Batch`` or ``CPShard`` (the SFT loss), or a function of the causal LM (online RL's policy
        forward), run here so that an engine wrapping this module gathers the root parameters around it."""
        from twinseq.torch_backend.losses import causal_lm_loss
        from twinseq.torch_backend.model import final_logit_softcap
        from twinseq.torch_backend.peft import lm_head_weight

        if callable(micro):
            return micro(self.causal_lm)
        hidden_BTH, labels_BT, shifted = self._hidden(micro)
        return causal_lm_loss(hidden_BTH, lm_head_weight(self.causal_lm), labels_BT, micro.num_items_in_batch,
                              self.cfg.loss.loss_type, chunk_size=self.cfg.loss.loss_chunk_size, return_metrics=True,
                              targets_are_shifted=shifted, logit_softcap=final_logit_softcap(self.causal_lm),
                              triton_gradients=self.cfg.loss.triton_gradients)


def use_cp_attention(model: torch.nn.Module, strategy: str) -> None:
    """Switch an HF model's attention to the registered CP function of ``strategy`` (logged); the ring
    refuses models with sliding windows or soft-capped scores (``context_parallel.check_ring_model``)."""
    if strategy == "ring":
        cpmod.check_ring_model(model.config)
    cpmod.register_cp_attention()
    name = cpmod.HF_NAMES[strategy]
    logger.info("context parallelism: attention runs %r (replaces %r)", name, model.config._attn_implementation)
    model.set_attn_implementation(name)


def apply_fsdp(module: CausalLMLoss, runtime: Runtime, cfg: TrainConfig) -> CausalLMLoss:
    """``fully_shard`` every decoder layer, then the root; gradients summed over ranks (factor 1)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": runtime.fsdp_mesh}
    if runtime.device.type == "cuda" and cfg.model.dtype == "bfloat16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    from twinseq.torch_backend.peft import causal_lm_of

    for layer in causal_lm_of(module.causal_lm).model.layers:  # an adapter model: inside PEFT's wrapper
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            # a plain SUM: the losses are already normalised by the whole step (gloo has no PREMUL_SUM)
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)
    return module


def apply_compile(causal_lm: torch.nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (dynamic shapes: batches vary in length), as
    torchtitan does: per-layer graphs compose with checkpointing and FSDP2's per-layer hooks."""
    from twinseq.torch_backend.peft import causal_lm_of

    for layer in causal_lm_of(causal_lm).model.layers:
        layer.compile(dynamic=True)


def parallelize(causal_lm: torch.nn.Module, runtime: Optional[Runtime], cfg: TrainConfig) -> CausalLMLoss:
    """The module a trainer steps, from the plain model, in a stated order:

    1. context parallelism: the attention of every layer becomes the cp strategy's (``cp > 1``);
    2. activation checkpointing of every decoder layer (``gradient_checkpointing``);
    3. ``torch.compile`` of every decoder layer (``torch_compile``);
    4. FSDP2 over the flattened dp x cp mesh (any multi-process or ``fsdp`` run).

    ``runtime`` is None for a plain one-process run (steps 1 and 4 are skipped).
    """
    if runtime is not None and runtime.mesh_cfg.cp > 1:
        use_cp_attention(causal_lm, cfg.parallel.context_parallel_strategy)
    from twinseq.torch_backend.memory import apply_long_context

    apply_long_context(causal_lm, cfg.memory)  # blocked attention's block size; tiled MLP (tiled_mlp)
    if cfg.memory.gradient_checkpointing:
        from twinseq.torch_backend.memory import apply_activation_checkpointing

        apply_activation_checkpointing(causal_lm)
    if cfg.memory.torch_compile:
        apply_compile(causal_lm)
    if runtime is None:
        return CausalLMLoss(causal_lm, cfg)
    return apply_fsdp(CausalLMLoss(causal_lm.to(runtime.device), cfg, runtime.cp_group), runtime, cfg)


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
    """Sum the additive metrics (``common.step_metrics.ADDITIVE``) over all ranks."""
    keys = [k for k in ADDITIVE if k in out]
    values = torch.tensor([float(out[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    out = {**out, **dict(zip(keys, values.tolist()))}
    for k in INTEGER:
        if k in out:
            out[k] = int(round(out[k]))
    return out


def any_over_ranks(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def max_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@contextlib.contextmanager
def main_process_first(runtime: Optional[Runtime]) -> Iterator[None]:
    """Rank 0 runs the block first (it may build caches: corpus, tokenizer), the others after it."""
    if runtime is not None and not runtime.is_main:
        dist.barrier()
    yield
    if runtime is not None and runtime.is_main:
        dist.barrier()


# --------------------------------------------------------------------------------------
# Full (unsharded) state on rank 0, for checkpoints and the final export
# --------------------------------------------------------------------------------------


def _full_options(**kw: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def full_model_state(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Unsharded parameters by name (``prefix`` stripped), gathered on every rank's CPU (a collective
    under FSDP2); buffers excluded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    state = get_model_state_dict(module, options=_full_options())
    return {k.removeprefix(prefix): v for k, v in state.items() if k in params}


def load_full_model_state(module: torch.nn.Module, tensors: Mapping[str, np.ndarray], prefix: str = "") -> None:
    """Load unsharded parameters (every rank holds them all) into a plain or FSDP2 module."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state = {prefix + k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}
    set_model_state_dict(module, state, options=_full_options(strict=False))


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name (``{"state": {fqn: {...}}, "param_groups": [...]}``)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_full_options())


def load_full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=_full_options())
